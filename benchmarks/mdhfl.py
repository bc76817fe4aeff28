"""MDH-FL against FedMD and local-only training, under label noise, with a different architecture per site.

Three sites train ResNet-10, ShuffleNetV2 and medflare's small CNN (a light net on an edge box; it replaces the
paper's ResNet-12 and MobileNetV2, too slow to train on this CPU). 20 % of the training split is held out as
the unlabelled public set (disjoint from every site), the rest is split Dirichlet(0.5) over the sites, and the
training labels get pair-flip or symmetric noise. Each site's own model is scored once, after the last round,
on its clean test share (site_evaluation=final, so the bytes per round are the method's own traffic).

Settings (every federated split is simulated, no real hospital IDs):
  synthetic  the built-in generator: 5 classes, 1,200 training images at 28 px (RGB)
  retina     RetinaMNIST (../shared/data, MD5-checked): 5 grades, 1,080 training images at 28 px (RGB)

Variants: mdhfl, fedmd, local-only (SCE, the same private data); --ablations adds MDH-FL without SCE
(method.loss=ce) and without KL (method.distill=false), under the --ablation-noise settings. Reported: accuracy
per site (architecture) and the mean over sites, mean ± std over seeds; and the array bytes each site sends per
round against the expected public rows per round × classes × 2 bytes (float16).

Engines: ``simulator`` runs every cell through FLARE's simulator; ``inprocess`` (the default, for CPU budget)
drives the very same site and server code (SiteRuntime, RoundAggregation with the method's rule and every
contract check) round by round in this process, each site with its own random state as if it ran in its own
process (``benchmarks/inprocess.py``, shared with ``ssl_fl.py``). ``--parity`` first runs one cell both ways and
stops unless both give the same accuracies and bytes. Cells run in ``--workers`` parallel processes.

Usage:
    python benchmarks/mdhfl.py --setting retina [--seeds 0 1 2] [--noise clean pairflip:0.2 symmetric:0.2]
        [--rounds 8] [--ablations] [--parity] [--engine inprocess|simulator] [--out DIR]
    python benchmarks/mdhfl.py --setting synthetic --preset cpu60   # the issue's table, CPU-sized (PRESETS)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from medflare import contracts
from medflare.console.simulate import run_simulation
from medflare.data.checksums import verify_medmnist_file
from medflare.evaluation import summarize
from medflare.methods.base import RoundContext
from medflare.plan import resolve
from medflare.run_config import RunConfig

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # benchmarks/ is not a package: the sibling scripts are imported by name
    sys.path.insert(0, str(HERE))

from inprocess import Deliver, run_at_site, run_rounds  # noqa: E402

RETINA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist" / "retinamnist.npz"
SITE_MODELS = {"site-1": "resnet10", "site-2": "shufflenet", "site-3": "cnn"}
CLASSES = 5
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mdhfl": ("mdhfl", {}),
    "fedmd": ("fedmd", {}),
    "local-only": ("local-only", {"loss": "sce"}),
}
# Sized configurations. cpu60: the table (clean, pair-flip and symmetric noise at 0.2; 3 seeds; mdhfl,
# fedmd, local-only; per site and mean; bytes per round) for one setting, without ablations or the parity cell,
# one torch thread per cell and one cell per core. Measured: one (noise, seed) group of 3 cells at these sizes
# took 191 CPU-s (retina), so the 2 x 9 groups of synthetic and retina take about 57 CPU-min: about 30 min on
# 2 idle cores, about 60 min when the cores are shared. (Earlier partial runs were slow because 3 cells with
# 2 torch threads each shared 2 busy cores.)
PRESETS: dict[str, dict[str, Any]] = {
    "cpu60": {"rounds": 8, "max_steps": 12, "public_per_round": 96, "workers": 2, "torch_threads": 1},
}
ABLATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "mdhfl w/o SCE": ("mdhfl", {"loss": "ce"}),
    "mdhfl w/o KL": ("mdhfl", {"distill": False}),
}


def source(setting: str) -> str:
    if setting == "synthetic":
        return f"synthetic:n=1200,classes={CLASSES},n_val=150,n_test=300"
    verify_medmnist_file(RETINA)
    return f"medmnist:{RETINA}"


def run_config(args: argparse.Namespace, variant: str, noise: str, seed: int) -> RunConfig:
    """One cell: the same private data, public set and per-site models for every variant of a (noise, seed)."""
    method, method_args = {**VARIANTS, **ABLATIONS}[variant]
    kind, _, rate = noise.partition(":")
    data = {
        "source": source(args.setting), "partition": "dirichlet:0.5", "public_fraction": 0.2, "augment": "none",
        "label_noise": float(rate or 0), "noise_kind": "symmetric" if kind == "clean" else kind,
    }
    if method != "local-only":
        method_args = {"public_per_round": args.public_per_round, **method_args}
    return RunConfig(
        method=method, seed=seed, rounds=args.rounds, clients=len(SITE_MODELS), model="resnet10",
        site_model=SITE_MODELS, data=data, method_args=method_args, site_evaluation="final",
        train={"batch_size": 16, "max_steps": args.max_steps}, audit=True,
        name=f"{variant.replace(' ', '').replace('/', '-')}-{noise.replace(':', '')}-s{seed}",
    )


def run_in_process(run: RunConfig, deliver: Deliver = run_at_site) -> dict[str, Any]:
    """The cell's rounds in this process (``inprocess.run_rounds``; ``deliver`` as there): the final evaluation
    summary (``by_site``, ``site_mean``, ...) and the array bytes each site sent per round."""
    sent = {site: [0] * run.rounds for site in run.site_names}

    def count(plan: RoundContext, site: str, result: tuple[dict, dict]) -> None:
        sent[site][plan.round] += contracts.result_nbytes(result[0])

    _, evaluations = run_rounds(run, deliver, on_result=count)
    return {**summarize(evaluations), "sent_bytes_per_round": sent}


def run_cell(args: argparse.Namespace, variant: str, noise: str, seed: int, out: Path) -> dict[str, Any]:
    """One cell with the chosen engine: per-site and mean accuracy, bytes sent per round."""
    run = run_config(args, variant, noise, seed)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)  # cells already run in parallel processes
    started, cpu_started = time.time(), time.process_time()
    if args.engine == "inprocess":
        final = run_in_process(run)
        sent, payload = final["sent_bytes_per_round"], {}
    else:
        summary = run_simulation(resolve(run, "byoc"), out / run.name, echo=lambda line: None)
        final, sent = summary["final"], sent_array_bytes(out / run.name)
        payload = {s: p["bytes_per_round"] for s, p in summary["payload"].items()}
    return {
        "noise": noise, "seed": seed, "variant": variant, "engine": args.engine,
        "by_site": {s: m["accuracy"] for s, m in final["by_site"].items()},
        "site_mean": final["site_mean"]["accuracy"],
        "sent_bytes_per_round": sent, "payload_bytes_per_round": payload, "seconds": time.time() - started,
        "cpu_seconds": time.process_time() - cpu_started,  # this process's CPU time (the in-process engine's all)
    }


def sent_array_bytes(out: Path) -> dict[str, list[int]]:
    """Bytes of the arrays each site sent per round (probabilities), from its payload audit."""
    per_site = {}
    for site in SITE_MODELS:
        path = out / "sites" / site / "medflare_payload_audit.jsonl"
        if not path.is_file():
            continue
        rounds: dict[int, int] = {}
        current = 0
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["direction"] == "task":
                current = int(record["header"].get("round", current))
            elif record["task"] != "validate":
                rounds[current] = rounds.get(current, 0) + int(record.get("bytes", 0))
        per_site[site] = [rounds[r] for r in sorted(rounds)]
    return per_site


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {std:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=["synthetic", "retina"], required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--noise", nargs="+", default=["clean", "pairflip:0.2", "symmetric:0.2"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=12, help="cap on local optimizer steps per site and round")
    parser.add_argument("--public-per-round", type=int, default=96, help="public rows exchanged per round")
    parser.add_argument("--ablations", action="store_true", help="add MDH-FL without SCE and without KL")
    parser.add_argument("--ablation-noise", nargs="+", default=["pairflip:0.2"], help="noise settings of the ablations")
    parser.add_argument("--engine", choices=["inprocess", "simulator"], default="inprocess")
    parser.add_argument("--workers", type=int, default=3, help="cells run in parallel processes")
    parser.add_argument("--parity", action="store_true",
                        help="run the first cell with both engines and stop if their accuracies differ")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch threads per cell (0 = torch's default)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a sized configuration (see PRESETS); options given explicitly still win")
    parser.add_argument("--out", default=None)
    preset = parser.parse_known_args()[0].preset
    if preset:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args()
    out = Path(args.out or f"runs/bench-mdhfl-{args.setting}")
    out.mkdir(parents=True, exist_ok=True)
    variants = list(VARIANTS) + (list(ABLATIONS) if args.ablations else [])
    args.ablation_noise = args.ablation_noise if args.ablations else []
    grid = [(variant, noise, seed) for noise in args.noise for seed in args.seeds for variant in variants
            if variant not in ABLATIONS or noise in args.ablation_noise]
    started = time.time()
    parity = check_parity(args, grid[0], out) if args.parity else None
    cells: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(run_cell, args, *cell, out) for cell in grid]
        for (variant, noise, seed), future in zip(grid, futures):
            cells.append(future.result())
            print(f"[{time.time() - started:6.0f}s] {args.setting} {noise} seed {seed} {variant}: mean accuracy "
                  f"{cells[-1]['site_mean']:.4f} ({cells[-1]['seconds']:.0f}s, {cells[-1]['cpu_seconds']:.0f} CPU-s)",
                  flush=True)
    write_report(args, variants, cells, out, time.time() - started, parity)


def check_parity(args: argparse.Namespace, cell: tuple[str, str, int], out: Path) -> dict[str, Any]:
    """The same cell through both engines: per-site accuracies and bytes must agree."""
    results = {engine: run_cell(argparse.Namespace(**{**vars(args), "engine": engine}), *cell, out)
               for engine in ("inprocess", "simulator")}
    same = results["inprocess"]["by_site"] == results["simulator"]["by_site"] and \
        results["inprocess"]["sent_bytes_per_round"] == results["simulator"]["sent_bytes_per_round"]
    print(f"parity on {cell}: {'identical' if same else 'DIFFERENT'}: "
          f"{ {e: r['by_site'] for e, r in results.items()} }", flush=True)
    if not same:
        raise SystemExit("the in-process engine and FLARE's simulator disagree; use --engine simulator")
    return {"cell": list(cell), **results}


def write_report(args: argparse.Namespace, variants: list[str], cells: list[dict[str, Any]], out: Path,
                 seconds: float, parity: dict[str, Any] | None) -> None:
    sites = list(SITE_MODELS)
    lines = [
        f"# MDH-FL vs FedMD vs local-only: {args.setting}, seeds {args.seeds}, {args.rounds} rounds, "
        f"max {args.max_steps} local steps, {args.public_per_round} public rows per round",
        "",
        "| noise | method | " + " | ".join(f"{s} ({SITE_MODELS[s]})" for s in sites) + " | mean |",
        "|---|---|" + "---|" * (len(sites) + 1),
    ]
    for noise in args.noise:
        for variant in variants:
            rows = [c for c in cells if c["noise"] == noise and c["variant"] == variant]
            if not rows:
                continue
            per_site = [mean_std([c["by_site"][s] for c in rows]) for s in sites]
            mean = mean_std([c["site_mean"] for c in rows])
            lines.append(f"| {noise} | {variant} | " + " | ".join(per_site) + f" | {mean} |")
    expected = args.public_per_round * CLASSES * 2
    exchanged = [c for c in cells if c["variant"] in ("mdhfl", "fedmd")]
    measured = sorted({b for c in exchanged for v in c["sent_bytes_per_round"].values() for b in v})
    lines += ["", f"Arrays sent per site and round (mdhfl and fedmd): {measured} bytes; expected public rows per "
              f"round x classes x 2 bytes = {args.public_per_round} x {CLASSES} x 2 = {expected} bytes."]
    if parity:
        simulated = parity["simulator"]
        total = sorted({b for v in simulated["payload_bytes_per_round"].values() for b in v})
        lines += ["", f"Engine parity ({' '.join(map(str, parity['cell']))}): FLARE's simulator and the in-process "
                  f"engine gave the same per-site accuracies {simulated['by_site']} and array bytes; in the simulator "
                  f"each site sent {min(total)}-{max(total)} bytes per round with meta (controller's count)."]
    cpu = sum(c["cpu_seconds"] for c in cells) / 60
    lines += ["", f"Engine: {args.engine}; wall time of the whole benchmark: {seconds / 60:.1f} min; CPU time of its "
              f"cells: {cpu:.1f} min.", ""]
    (out / "results.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps(
        {"args": vars(args), "site_models": SITE_MODELS, "parity": parity, "cells": cells}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
