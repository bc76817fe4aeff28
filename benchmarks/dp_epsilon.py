"""Accuracy against ε: FedAvg on PneumoniaMNIST with DP-SGD at every site, in FLARE's simulator.

Setting: PneumoniaMNIST (../shared/data, MD5-checked), split IID over 2 simulated sites (a simulated split, not
hospitals), ``cnn``, Adam 1e-3, batch 64, ``--steps`` optimizer steps per round. For each target ε the noise
multiplier σ is the one that spends exactly that ε at δ = 1e-5 over the job's steps at each site's Poisson sample
rate (Opacus's ``get_noise_multiplier``, :func:`medflare.dp_sgd.noise_for_epsilon`); clipping bound C = 1.
ε = ∞ is the same job without DP-SGD (BatchNorm, no clipping, no noise). The ε each site reports after the
last round is recorded beside the accuracy.

Reports mean ± std over seeds of test accuracy and balanced accuracy of the final global model (pooled test
split), and the largest ε any site reached. Two rows whose difference is within one std are no difference.

Usage:
    python benchmarks/dp_epsilon.py [--seeds 0 1 2] [--epsilons inf 8 3 1] [--rounds 5] [--steps 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from medflare.data.checksums import verify_medmnist_file
from medflare.dp_sgd import noise_for_epsilon
from medflare.run_config import RunConfig
from medflare.simulate import run_simulation

PNEUMONIA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist" / "pneumoniamnist.npz"
TRAIN_IMAGES = 4708  # PneumoniaMNIST's training split (../shared/data/README.md)
CLIENTS = 2
BATCH = 64
DELTA = 1e-5  # below 1 / (a site's 2354 training images)
MAX_GRAD_NORM = 1.0


def noise_for(epsilon: float, rounds: int, steps: int) -> float:
    """σ that spends ``epsilon`` at DELTA over the job at a site's sample rate (smallest site: largest rate)."""
    sample_rate = BATCH / (TRAIN_IMAGES // CLIENTS)
    return noise_for_epsilon(epsilon, DELTA, sample_rate, rounds * steps)


def run_config(epsilon: float, seed: int, rounds: int, steps: int) -> RunConfig:
    """One (ε, seed) cell; ε = inf is the same job without DP-SGD."""
    dp_sgd = {} if math.isinf(epsilon) else {
        "noise_multiplier": noise_for(epsilon, rounds, steps), "max_grad_norm": MAX_GRAD_NORM, "delta": DELTA}
    return RunConfig(
        method="fedavg", model="cnn", clients=CLIENTS, rounds=rounds, seed=seed, name=f"dp-eps{epsilon:g}-s{seed}",
        data={"source": f"medmnist:{PNEUMONIA}", "partition": "iid"},
        train={"batch_size": BATCH, "max_steps": steps, "local_epochs": 1}, dp_sgd=dp_sgd, tracking="off",
    )


def spent_epsilon(summary: dict[str, Any]) -> float | None:
    """The largest ε any site reported after its last round (None without DP-SGD)."""
    last = [facts["dp_epsilon"][-1] for facts in summary["clients"].values() if facts.get("dp_epsilon")]
    return max(last) if last else None


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(cells: list[dict[str, Any]]) -> str:
    """One markdown row per target ε: σ, the ε reached, accuracy and balanced accuracy (mean ± std over seeds)."""
    lines = ["| target ε | σ | ε reached (max over sites) | seeds | test accuracy | test balanced accuracy |",
             "|---|---|---|---|---|---|"]
    for target in dict.fromkeys(cell["target_epsilon"] for cell in cells):
        runs = [cell for cell in cells if cell["target_epsilon"] == target]
        acc, bacc = (mean_std([run[key] for run in runs]) for key in ("accuracy", "balanced_accuracy"))
        sigma = runs[0]["noise_multiplier"]
        reached = [run["epsilon"] for run in runs if run["epsilon"] is not None]
        lines.append(f"| {'∞' if math.isinf(target) else f'{target:g}'} | {f'{sigma:.3f}' if sigma else '-'} | "
                     f"{f'{max(reached):.2f}' if reached else '-'} | {len(runs)} | {acc[0]:.4f} ± {acc[1]:.4f} | "
                     f"{bacc[0]:.4f} ± {bacc[1]:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[math.inf, 8.0, 3.0, 1.0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per round at each site")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-dp"))
    args = parser.parse_args()
    if not PNEUMONIA.is_file():
        raise SystemExit(f"skipped: {PNEUMONIA} is absent (../shared/data, see its README)")
    verify_medmnist_file(PNEUMONIA)
    cells = []
    for epsilon in args.epsilons:
        for seed in args.seeds:
            config = run_config(epsilon, seed, args.rounds, args.steps)
            started = time.time()
            summary = run_simulation(config, args.out / config.job_name, echo=lambda line: None, overwrite=True)
            cells.append({"target_epsilon": epsilon, "seed": seed,
                          "noise_multiplier": config.dp_sgd.get("noise_multiplier"), "epsilon": spent_epsilon(summary),
                          "accuracy": summary["final"]["accuracy"],
                          "balanced_accuracy": summary["final"]["balanced_accuracy"],
                          "wall_seconds": time.time() - started})
            print(json.dumps(cells[-1]), flush=True)
    (args.out / "results.json").write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "cells": cells},
                                                      indent=1, default=str))
    print(table(cells))


if __name__ == "__main__":
    main()
