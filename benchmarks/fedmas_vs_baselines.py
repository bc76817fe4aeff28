"""Fed-MAS against BSM-FL and FedAvg: several seeds, equal rounds and local epochs, in FLARE's simulator.

Settings:
  synthetic  the hyperkvasir-like scenario (long tail, Dirichlet(0.5), 8 sites; synthetic images)
  retina     RetinaMNIST (../shared/data, MD5-checked), Dirichlet(0.5) over 4 simulated sites; shot groups
             by training count: head > 300 (grade 0), tail < 100 (grade 4). Simulated split, not hospitals.

Reports mean ± std over seeds of test balanced accuracy and tail accuracy, and the cost of Fed-MAS over
BSM-FL per round as the ratio of their mean local-work seconds per site and round (train_seconds: teacher
forwards, the w pass and training; evaluation excluded), both measured in the same benchmark run.

Usage:
    python benchmarks/fedmas_vs_baselines.py --setting synthetic [--seeds 0 1 2] [--rounds 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from medflare.config import parse_value
from medflare.console.scenarios import load_scenario
from medflare.console.simulate import run_simulation
from medflare.data.checksums import verify_medmnist_file
from medflare.plan import resolve
from medflare.run_config import RunConfig, merge_sections

RETINA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist" / "retinamnist.npz"


def setting_config(
    setting: str, seed: int, rounds: int, method: str, extra_train: dict[str, Any], method_args: dict[str, Any]
) -> RunConfig:
    """The run configuration of one (setting, seed, method) cell."""
    if setting == "synthetic":
        base = load_scenario("hyperkvasir-like")
    elif setting == "retina":
        verify_medmnist_file(RETINA)
        base = {
            "clients": 4,
            "shot_thresholds": [300, 100],
            "data": {"source": f"medmnist:{RETINA}", "partition": "dirichlet:0.5"},
            "train": {"local_epochs": 1, "batch_size": 64},
        }
    else:
        raise SystemExit(f"unknown setting '{setting}'")
    override = {"method": method, "seed": seed, "rounds": rounds, "train": extra_train, "name": f"{method}-s{seed}",
                "method_args": method_args}
    return RunConfig(**merge_sections(base, override))


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def mean_train_seconds(summary: dict[str, Any]) -> float:
    """Mean local-work seconds per site and round, leaving out round 1 (process warm-up)."""
    values = [t for facts in summary["clients"].values() for t in facts.get("train_seconds", [])[1:] if t]
    return statistics.mean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=["synthetic", "retina"], required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=["fedmas", "bsm-fl", "fedavg"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=0, help="cap optimizer steps per site per round (0 = full epochs)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="method option for every method in --methods, e.g. max_share=0.25 (labelled in the table)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    method_args = {k: parse_value(v) for k, _, v in (item.partition("=") for item in args.set)}
    out = Path(args.out or f"runs/bench-fedmas-{args.setting}")
    out.mkdir(parents=True, exist_ok=True)
    extra_train = {"max_steps": args.max_steps} if args.max_steps else {}
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in args.methods}
    started = time.time()
    for seed in args.seeds:
        for method in args.methods:
            run = setting_config(args.setting, seed, args.rounds, method, extra_train, method_args)
            print(f"[{time.time() - started:6.0f}s] {args.setting} seed {seed} {method} ...", flush=True)
            summary = run_simulation(resolve(run, "byoc"), out / f"{method}-seed{seed}", echo=lambda line: None, overwrite=True)
            final = summary["final"]
            rows[method].append({
                "seed": seed,
                "balanced_accuracy": final["balanced_accuracy"],
                "tail_accuracy": final.get("tail_accuracy"),
                "head_accuracy": final.get("head_accuracy"),
                "medium_accuracy": final.get("medium_accuracy"),
                "train_seconds": mean_train_seconds(summary),
                "round_seconds": summary["timing"]["mean_round_seconds"],
            })
            print(f"         balanced accuracy {final['balanced_accuracy']:.4f}, tail {final.get('tail_accuracy')}", flush=True)
    write_report(args, rows, out, time.time() - started)


def cost_ratio(train_seconds: dict[str, float]) -> float | None:
    """Fed-MAS's mean local-work seconds over BSM-FL's, from one benchmark run; None unless both methods ran.

    Args:
        train_seconds: method name (as registered, without any ``--set`` label) -> mean seconds per site and round.
    """
    if "fedmas" not in train_seconds or "bsm-fl" not in train_seconds:
        return None
    return train_seconds["fedmas"] / train_seconds["bsm-fl"]


def write_report(args: argparse.Namespace, rows: dict[str, list[dict[str, float]]], out: Path, seconds: float) -> None:
    """results.md and results.json; ``rows`` is keyed by method name, and ``--set`` options label the table rows."""
    label = "".join(f"[{item}]" for item in args.set)
    lines = [
        f"# Fed-MAS vs baselines: {args.setting}, seeds {args.seeds}, {args.rounds} rounds",
        "",
        "| method | balanced accuracy | tail accuracy | head accuracy | local work s/site/round |",
        "|---|---|---|---|---|",
    ]
    table = {}
    for method, cells in rows.items():
        stats = {k: mean_std([c[k] for c in cells if c[k] is not None]) for k in
                 ("balanced_accuracy", "tail_accuracy", "head_accuracy", "train_seconds")}
        table[method] = stats
        lines.append(f"| {method}{label} | " + " | ".join(f"{m:.4f} ± {s:.4f}" for m, s in (
            stats["balanced_accuracy"], stats["tail_accuracy"], stats["head_accuracy"])) +
            f" | {stats['train_seconds'][0]:.2f} |")
    ratio = cost_ratio({method: stats["train_seconds"][0] for method, stats in table.items()})
    if ratio is not None:  # only from one benchmark run, so both share the machine's load
        lines += ["", f"Fed-MAS local work per round / BSM-FL local work per round: **{ratio:.2f}x** (same run)."]
    lines += ["", f"Wall time of the whole benchmark: {seconds / 60:.1f} min.", ""]
    (out / "results.md").write_text("\n".join(lines))
    report = {"args": vars(args), "label": label, "rows": rows, "table": table}
    (out / "results.json").write_text(json.dumps(report, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
