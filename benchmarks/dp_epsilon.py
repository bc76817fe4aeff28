"""Accuracy against ε: FedAvg on PneumoniaMNIST with DP-SGD at every site, in FLARE's simulator.

Setting: PneumoniaMNIST (../shared/data, MD5-checked), split IID over 2 simulated sites (a simulated split, not
hospitals), ``cnn``, the DP-SGD recipe of docs/privacy.md for every arm: SGD with momentum 0.9, lr 0.0625, Poisson
batches of expected size 256 (sample rate 256 / 2354 per site), ``--steps`` optimizer steps per round. DP arms clip
each sample's gradient at C = 8 (about the median per-sample gradient norm of the DP-compatible cnn at
initialisation) and use the noise multiplier σ that spends exactly the target ε at δ = 1e-5 over the job's steps
(Opacus's ``get_noise_multiplier``, :func:`medflare.dp_sgd.noise_for_epsilon`). The ε each site reports after the
last round is recorded beside the accuracy.

Two ε = ∞ rows separate the cost of the DP-compatible architecture from the cost of the noise:
- ``inf``: the same DP-compatible cnn (GroupNorm) and recipe, Poisson batches, but C = 100 (about ten times the
  median per-sample norm: nothing is clipped) and σ = 0.001 (noise std σC/256 = 4e-4 per coordinate of the averaged
  gradient): DP-SGD's machinery with no privacy to speak of;
- ``batchnorm``: the plain cnn (BatchNorm), same optimizer, lr, batch and steps, shuffled batches, no DP-SGD.

Reports mean ± std over seeds of test accuracy and balanced accuracy of the final global model (pooled test
split), and the largest ε any site reached. Two rows whose difference is within one std are no difference.

Usage:
    python benchmarks/dp_epsilon.py [--seeds 0 1 2] [--epsilons inf 8 3 1] [--no-batchnorm] [--rounds 5]
        [--steps 15] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from medflare.console.simulate import run_simulation
from medflare.data.checksums import verify_medmnist_file
from medflare.dp_sgd import noise_for_epsilon
from medflare.plan import resolve
from medflare.run_config import RunConfig

PNEUMONIA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist" / "pneumoniamnist.npz"
TRAIN_IMAGES = 4708  # PneumoniaMNIST's training split (../shared/data/README.md)
CLIENTS = 2
BATCH = 256  # expected batch: DP-SGD's noise on the mean gradient is σC / batch
DELTA = 1e-5  # below 1 / (a site's 2354 training images)
MAX_GRAD_NORM = 8.0  # about the median per-sample gradient norm of the DP-compatible cnn at initialisation
UNCLIPPED = {"noise_multiplier": 1e-3, "max_grad_norm": 100.0}  # the ε = ∞ arm: no clipping or noise to speak of
# SGD, not Adam: Adam rescales every coordinate's noise to a step of size lr (docs/privacy.md)
RECIPE = {"optimizer": "sgd", "lr": 0.0625, "momentum": 0.9, "batch_size": BATCH}
BATCHNORM = "batchnorm"  # the arm without DP-SGD: the plain cnn


def noise_for(epsilon: float, rounds: int, steps: int) -> float:
    """σ that spends ``epsilon`` at DELTA over the job at a site's sample rate (smallest site: largest rate)."""
    sample_rate = BATCH / (TRAIN_IMAGES // CLIENTS)
    return noise_for_epsilon(epsilon, DELTA, sample_rate, rounds * steps)


def dp_settings(arm: float | str, rounds: int, steps: int) -> dict[str, Any]:
    """The dp_sgd section of one arm: σ calibrated to a finite ε, the unclipped ε = ∞ arm, none for BatchNorm."""
    if arm == BATCHNORM:
        return {}
    if math.isinf(float(arm)):
        return {**UNCLIPPED, "delta": DELTA}
    return {"noise_multiplier": noise_for(float(arm), rounds, steps), "max_grad_norm": MAX_GRAD_NORM, "delta": DELTA}


def run_config(arm: float | str, seed: int, rounds: int, steps: int) -> RunConfig:
    """One (arm, seed) cell: a target ε (inf = the DP-compatible cnn unclipped and unnoised) or ``batchnorm``."""
    # Poisson sampling gives N / batch batches an epoch; enough epochs that every round takes its ``steps``
    epochs = math.ceil(steps * BATCH / (TRAIN_IMAGES // CLIENTS))
    name = arm if arm == BATCHNORM else f"eps{float(arm):g}"
    return RunConfig(
        method="fedavg", model="cnn", clients=CLIENTS, rounds=rounds, seed=seed, name=f"dp-{name}-s{seed}",
        data={"source": f"medmnist:{PNEUMONIA}", "partition": "iid"},
        train={**RECIPE, "max_steps": steps, "local_epochs": epochs}, dp_sgd=dp_settings(arm, rounds, steps),
        tracking="off",
    )


def spent_epsilon(summary: dict[str, Any]) -> float | None:
    """The largest ε any site reported after its last round (None without DP-SGD)."""
    last = [facts["dp_epsilon"][-1] for facts in summary["clients"].values() if facts.get("dp_epsilon")]
    return max(last) if last else None


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def arm_label(arm: float | str) -> str:
    """The table's first column for one arm."""
    if arm == BATCHNORM:
        return "∞, plain cnn (BatchNorm), no DP-SGD"
    if math.isinf(float(arm)):
        return f"∞, DP-compatible cnn, C = {UNCLIPPED['max_grad_norm']:g}, σ = {UNCLIPPED['noise_multiplier']:g}"
    return f"{float(arm):g}"


def table(cells: list[dict[str, Any]]) -> str:
    """One markdown row per arm: σ, C, the ε reached, accuracy and balanced accuracy (mean ± std over seeds)."""
    lines = ["| target ε | σ | C | ε reached (max over sites) | seeds | test accuracy | test balanced accuracy |",
             "|---|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(cell["arm"] for cell in cells):
        runs = [cell for cell in cells if cell["arm"] == arm]
        acc, bacc = (mean_std([run[key] for run in runs]) for key in ("accuracy", "balanced_accuracy"))
        sigma, clip = runs[0]["noise_multiplier"], runs[0]["max_grad_norm"]
        finite = [run["epsilon"] for run in runs if run["epsilon"] is not None and arm_label(arm)[0] != "∞"]
        lines.append(f"| {arm_label(arm)} | {f'{sigma:.3g}' if sigma else '-'} | {f'{clip:g}' if clip else '-'} | "
                     f"{f'{max(finite):.2f}' if finite else '-'} | {len(runs)} | {acc[0]:.4f} ± {acc[1]:.4f} | "
                     f"{bacc[0]:.4f} ± {bacc[1]:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[math.inf, 8.0, 3.0, 1.0])
    parser.add_argument("--no-batchnorm", action="store_true", help="leave out the plain cnn without DP-SGD")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15, help="optimizer steps per round at each site")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-dp"))
    args = parser.parse_args()
    if not PNEUMONIA.is_file():
        raise SystemExit(f"skipped: {PNEUMONIA} is absent (../shared/data, see its README)")
    verify_medmnist_file(PNEUMONIA)
    cells = []
    arms: list[float | str] = ([] if args.no_batchnorm else [BATCHNORM]) + list(args.epsilons)
    for arm in arms:
        for seed in args.seeds:
            config = run_config(arm, seed, args.rounds, args.steps)
            started = time.time()
            summary = run_simulation(resolve(config, "byoc"), args.out / config.job_name, echo=lambda line: None, overwrite=True)
            cells.append({"arm": arm, "seed": seed, "noise_multiplier": config.dp_sgd.get("noise_multiplier"),
                          "max_grad_norm": config.dp_sgd.get("max_grad_norm"), "epsilon": spent_epsilon(summary),
                          "accuracy": summary["final"]["accuracy"],
                          "balanced_accuracy": summary["final"]["balanced_accuracy"],
                          "wall_seconds": time.time() - started})
            print(json.dumps(cells[-1]), flush=True)
    (args.out / "results.json").write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "cells": cells},
                                                      indent=1, default=str))
    print(table(cells))


if __name__ == "__main__":
    main()
