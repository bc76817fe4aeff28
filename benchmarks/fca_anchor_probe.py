"""FCA's anchor, on and off (issue 51, item 2): FCA against FCA with ``consistency_weight=0`` (the personal head
no longer anchors the federated one) on the same strongly label-skewed job, per seed, through the in-process
engine. Prints each run's specialization (each site's personal head on its own test split, mean over sites) and
generalization (the global model on the pooled test splits) balanced accuracy, then mean ± std per arm.

    python benchmarks/fca_anchor_probe.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import inprocess  # noqa: E402
from benchmarking import mean_std, versus  # noqa: E402

from medflare.evaluation import summarize  # noqa: E402
from medflare.run_config import RunConfig  # noqa: E402


def one_run(seed: int, consistency_weight: float) -> tuple[float, float]:
    run = RunConfig(method="fca", model="cnn", clients=4, rounds=6, seed=seed,
                    data={"source": "synthetic", "partition": "dirichlet:0.1"},
                    train={"max_steps": 10, "batch_size": 32}, method_args={"consistency_weight": consistency_weight})
    _, evaluations = inprocess.run_rounds(run)
    summary = summarize(evaluations)
    specialization = summary["extra"]["specialization"]["site_mean"]["balanced_accuracy"]
    return float(specialization), float(summary["test"]["balanced_accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    arms = {"anchor (consistency 1)": 1.0, "no anchor (consistency 0)": 0.0}
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    for seed in args.seeds:
        for name, weight in arms.items():
            rows[name].append(one_run(seed, weight))
            print(f"seed {seed}, {name}: specialization {rows[name][-1][0]:.3f}, generalization {rows[name][-1][1]:.3f}",
                  flush=True)
    base = [r for r in rows["no anchor (consistency 0)"]]
    for name, values in rows.items():
        spec, gen = mean_std([v[0] for v in values]), mean_std([v[1] for v in values])
        reading = "" if name.startswith("no anchor") else (
            f"; vs no anchor: specialization {versus([v[0] for v in values], [b[0] for b in base])}, "
            f"generalization {versus([v[1] for v in values], [b[1] for b in base])}")
        print(f"{name}: specialization {spec[0]:.3f} ± {spec[1]:.3f}, generalization {gen[0]:.3f} ± {gen[1]:.3f}"
              f"{reading}")
    print(f"paired generalization gaps: {[round(a[1] - b[1], 3) for a, b in zip(rows['anchor (consistency 1)'], base)]}"
          f"; mean {statistics.mean(a[1] - b[1] for a, b in zip(rows['anchor (consistency 1)'], base)):.3f}")


if __name__ == "__main__":
    main()
