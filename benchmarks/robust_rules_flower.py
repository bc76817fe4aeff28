"""Flower 1.42's robust aggregation functions on fixed inputs, for medflare's rules to be checked against (issue 49).

Runs in Flower's own environment (``make flower-robust-reference``: flwr 1.42 and numpy only, no medflare import):
it draws each case's site updates from a seeded generator, hosts a hostile site in each, applies Flower's
``aggregate_median`` (FedMedian), ``aggregate_trimmed_avg`` (FedTrimmedAvg), ``aggregate_krum`` (Krum, MultiKrum)
and ``aggregate_bulyan`` (Bulyan over Krum), and writes the inputs and Flower's outputs as JSON.
``tests/ops/test_robust_rules_vs_flower.py`` feeds the same inputs through medflare's server aggregation core with
FedAvg's weighting and compares; it also reruns this script when Flower's environment is present.

    python benchmarks/robust_rules_flower.py --out benchmarks/results/robust_rules_flower.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from flwr.server.strategy.aggregate import aggregate_bulyan, aggregate_krum, aggregate_median, aggregate_trimmed_avg

SHAPES = ((3, 4), (4,))  # a small layer and its bias
# name, sites, equal example counts?, Flower's call, medflare's robust settings
CASES = (
    ("median", 7, True, lambda r: aggregate_median(r), {"rule": "median", "max_share": 0.45}),
    ("median_even", 8, True, lambda r: aggregate_median(r), {"rule": "median", "max_share": 0.45}),
    ("trimmed_mean", 10, True, lambda r: aggregate_trimmed_avg(r, 0.2),
     {"rule": "trimmed_mean", "trim_fraction": 0.2, "max_share": 0.2}),
    ("krum", 7, False, lambda r: aggregate_krum(r, 2, 0), {"rule": "krum", "hostile_sites": 2}),
    ("multi_krum", 7, False, lambda r: aggregate_krum(r, 1, 4),
     {"rule": "multi_krum", "hostile_sites": 1, "krum_keep": 4}),
    ("bulyan", 7, True, lambda r: aggregate_bulyan(list(r), 1, aggregate_krum, to_keep=0),
     {"rule": "bulyan", "hostile_sites": 1}),
    ("bulyan_f2", 11, True, lambda r: aggregate_bulyan(list(r), 2, aggregate_krum, to_keep=0),
     {"rule": "bulyan", "hostile_sites": 2}),
)


def case_inputs(seed: int, sites: int, equal: bool) -> tuple[list[list[np.ndarray]], list[int]]:
    """Honest updates around one point, the last site far off; example counts equal or drawn."""
    rng = np.random.default_rng(seed)
    centre = [rng.normal(size=shape) for shape in SHAPES]
    updates = [[(c + 0.1 * rng.normal(size=c.shape)).astype(np.float32) for c in centre] for _ in range(sites)]
    updates[-1] = [(c + 25.0 * rng.normal(size=c.shape)).astype(np.float32) for c in centre]
    counts = [50] * sites if equal else rng.integers(10, 200, size=sites).tolist()
    return updates, [int(c) for c in counts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import flwr

    cases = []
    for seed, (name, sites, equal, flower, robust) in enumerate(CASES):
        updates, counts = case_inputs(seed, sites, equal)
        result = flower(list(zip(updates, counts)))
        cases.append({"name": name, "robust": robust, "counts": counts,
                      "updates": [[layer.tolist() for layer in update] for update in updates],
                      "flower": [np.asarray(layer, dtype=np.float64).tolist() for layer in result]})
    args.out.write_text(json.dumps({"flwr": flwr.__version__, "shapes": SHAPES, "cases": cases}) + "\n")
    print(f"wrote {args.out}: {len(cases)} cases, flwr {flwr.__version__}")


if __name__ == "__main__":
    main()
