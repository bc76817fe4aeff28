"""The robust rules against FedAvg with one hostile site (issue 49): accuracy and time per round, 3 seeds.

Seven sites share PneumoniaMNIST (IID, ``../shared/data``); site-7 is hostile: every round it trains honestly, then
sends θ_global − 8·(θ_site − θ_global), its step reversed and eight times as long (inside the deployment norm bound,
10x the others' median, so that bound does not catch it). Each arm runs the same job through the in-process engine
(``inprocess.py``: the job's plan, each site as the executor builds it, the server's aggregation core with the job's
robust settings), and is scored on the honest sites' pooled test statistics of the final model. The server's
aggregation time is measured around the core's ``aggregate`` (the rule's own cost); a round's time includes the
sites' training, done one after another in this process.

    python benchmarks/robust_rules.py --out runs/bench-robust --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import inprocess  # noqa: E402
from benchmarking import mean_std, versus  # noqa: E402

from medflare.data.checksums import verify_medmnist_file  # noqa: E402
from medflare.errors import MedflareError  # noqa: E402
from medflare.evaluation import summarize  # noqa: E402
from medflare.run_config import RunConfig  # noqa: E402
from medflare.server_round import RoundAggregation  # noqa: E402

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist" / "pneumoniamnist.npz"
SITES, HOSTILE, REVERSED = 7, "site-7", 8.0
ARMS: dict[str, dict[str, Any]] = {  # name -> robust settings (min_clients 1: Krum keeps one site)
    "FedAvg, no hostile site": {},
    "FedAvg": {},
    "FedAvg + norm bound 10, cap 0.6 (deployment default)": {"max_norm_ratio": 10.0, "max_share": 0.6},
    "median (cap 0.45)": {"rule": "median", "max_share": 0.45},
    "trimmed mean (β 0.2, cap 0.2)": {"rule": "trimmed_mean", "trim_fraction": 0.2, "max_share": 0.2},
    "Krum (f 1)": {"rule": "krum", "hostile_sites": 1},
    "Multi-Krum (f 1, keeps 6)": {"rule": "multi_krum", "hostile_sites": 1},
    "Bulyan (f 1)": {"rule": "bulyan", "hostile_sites": 1},
}


def arm_run(robust: dict[str, Any], seed: int, rounds: int) -> RunConfig:
    return RunConfig(method="fedavg", model="cnn", clients=SITES, min_clients=1, rounds=rounds, seed=seed,
                     site_evaluation="final",
                     data={"source": f"medmnist:{DATA}", "partition": "iid"}, robust=dict(robust),
                     train={"batch_size": 32, "local_epochs": 1, "lr": 3e-3})


def reversed_step(hostile: bool):
    """A deliver function: honest training, then the hostile site's step reversed and lengthened."""

    def deliver(runtime, task_name: str, arrays: dict, header: dict) -> tuple[dict, dict]:
        result, meta = inprocess.run_at_site(runtime, task_name, arrays, header)
        if not hostile or runtime.site_name != HOSTILE or task_name != "train":
            return result, meta
        forged = {k: (arrays[k] - REVERSED * (v - arrays[k])).astype(v.dtype) if k in arrays and v.dtype.kind == "f"
                  else v for k, v in result.items()}
        return forged, meta

    return deliver


def one_run(robust: dict[str, Any], seed: int, rounds: int, hostile: bool) -> dict[str, Any]:
    """One arm at one seed: the honest sites' pooled test metrics, mean round and aggregation seconds."""
    aggregation_seconds: list[float] = []
    original = RoundAggregation.aggregate

    def timed(core: RoundAggregation):  # the rule's own cost, measured where the server pays it
        started = time.perf_counter()
        try:
            return original(core)
        finally:
            aggregation_seconds.append(time.perf_counter() - started)

    round_seconds: list[float] = []
    kept: list[list[str]] = []
    RoundAggregation.aggregate = timed
    try:
        _, evaluations = inprocess.run_rounds(
            arm_run(robust, seed, rounds), deliver=reversed_step(hostile),
            on_round=lambda done: (round_seconds.append(done.seconds), kept.append([u.site for u in done.accepted])))
    finally:
        RoundAggregation.aggregate = original
    honest = {site: ev for site, ev in evaluations.items() if site != HOSTILE}
    test = summarize(honest)["test"]
    return {"balanced_accuracy": test["balanced_accuracy"], "accuracy": test["accuracy"],
            "round_seconds": statistics.mean(round_seconds[1:] or round_seconds),
            "aggregation_ms": 1000 * statistics.mean(aggregation_seconds[:rounds]),
            "hostile_kept_rounds": sum(HOSTILE in sites for sites in kept)}


def table(results: dict[str, list[dict[str, Any]]], rounds: int, seeds: list[int]) -> str:
    """The results page's table; an arm whose model went non-finite in a seed says so (its other seeds are shown)."""
    scored = {name: [r for r in rows if "diverged" not in r] for name, rows in results.items()}
    reference_name = "FedAvg" if scored.get("FedAvg") else next(name for name, rows in scored.items() if rows)
    reference = scored[reference_name]
    baseline = [r["balanced_accuracy"] for r in reference]
    base_ms = statistics.mean(r["aggregation_ms"] for r in next(rows for rows in scored.values() if rows))
    lines = [f"PneumoniaMNIST, {SITES} sites IID, cnn, {rounds} rounds of one local epoch, seeds {seeds}; "
             f"{HOSTILE} sends its step reversed x{REVERSED:g} (all arms but the first). Honest sites' pooled test.",
             "",
             f"| arm | balanced accuracy (mean ± std) | vs {reference_name} | hostile site kept (rounds) | "
             f"aggregation ms / round | x {reference_name}'s | round s |",
             "|---|---|---|---|---|---|---|"]
    for name, rows in scored.items():
        diverged = len(results[name]) - len(rows)
        if not rows:
            lines.append(f"| {name} | diverged in {diverged} of {diverged} seeds (a non-finite model) | — | — | — | — "
                         "| — |")
            continue
        bal = mean_std([r["balanced_accuracy"] for r in rows])
        note = f" (diverged in {diverged} more)" if diverged else ""
        ms = statistics.mean(r["aggregation_ms"] for r in rows)
        reading = "—" if rows is reference else versus([r["balanced_accuracy"] for r in rows], baseline)
        kept = "—" if name.endswith("no hostile site") else \
            f"{statistics.mean(r['hostile_kept_rounds'] for r in rows):.1f} of {rounds}"
        lines.append(f"| {name} | {bal[0]:.3f} ± {bal[1]:.3f}{note} | {reading} | {kept} | {ms:.1f} | "
                     f"{ms / base_ms:.1f} | {statistics.mean(r['round_seconds'] for r in rows):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-robust"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--arms", nargs="*", default=list(ARMS), help="a subset of the arms, by name")
    args = parser.parse_args()
    if not DATA.is_file():
        sys.exit(f"robust rules benchmark: {DATA} is absent (../shared/data beside the checkout)")
    verify_medmnist_file(DATA)
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "results.json"
    earlier = json.loads(saved.read_text()) if saved.is_file() else {}  # a stopped run picks up where it was
    results: dict[str, list[dict[str, Any]]] = {}
    for name in args.arms:
        for seed in args.seeds:
            done = [r for r in earlier.get(name, []) if r["seed"] == seed and r.get("rounds") == args.rounds]
            started = time.perf_counter()
            if done:
                row = done[0]
            else:
                try:
                    row = one_run(ARMS[name], seed, args.rounds, hostile=not name.endswith("no hostile site"))
                except MedflareError as exc:  # the model went non-finite: the sites cannot even score it
                    row = {"diverged": str(exc).splitlines()[0]}
                row = {"seed": seed, "rounds": args.rounds, **row}
            results.setdefault(name, []).append(row)
            print(f"{name}, seed {seed}: " + (f"diverged ({row['diverged']})" if "diverged" in row else
                  f"balanced accuracy {row['balanced_accuracy']:.3f}, aggregation {row['aggregation_ms']:.1f} ms")
                  + f", {time.perf_counter() - started:.0f} s", flush=True)
            saved.write_text(json.dumps({**earlier, **results}, indent=1) + "\n")
    text = table(results, args.rounds, args.seeds)
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    np.seterr(all="ignore")  # a diverging FedAvg arm overflows on purpose; its metrics say so
    main()
