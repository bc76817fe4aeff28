"""`data.imbalance`: a long-tailed training split cut from any source (folder, CSV, MedMNIST, synthetic).

The classes keep their order of abundance: the class with the most training images is the head, the one with
the fewest the tail (ties by class id). Class counts follow the exponential profile of the synthetic source,
n_rank = n_head * IR^(-rank/(K-1)), with the largest n_head the data allows, so the ratio of the largest to the
smallest class is IR (up to rounding) and no class needs more images than it has. Which images are kept is
seeded. Only the training split is cut; validation and test stay as the source gives them, so metrics remain
comparable with a run on the full data.
"""

from __future__ import annotations

import numpy as np

from medflare.data.synthetic import long_tail_profile
from medflare.errors import DataError


def long_tail_indices(labels: np.ndarray, num_classes: int, imbalance: float, seed: int) -> np.ndarray:
    """Sorted indices of the training samples kept for an imbalance ratio `imbalance` (>= 1).

    Args:
        labels: int64 `[N]` training labels (-1 = unlabelled; never kept by the cut).
        num_classes: K.
        imbalance: ratio of the largest to the smallest kept class; 1 keeps every sample.
        seed: seed of the choice of images within each class.

    Raises:
        DataError: a class would keep no image (too few images in the tail for this ratio).
    """
    labels = np.asarray(labels)
    if imbalance == 1.0:
        return np.arange(len(labels))
    available = np.bincount(labels[labels >= 0], minlength=num_classes)
    present = [k for k in sorted(range(num_classes), key=lambda k: (-available[k], k)) if available[k] > 0]
    profile = long_tail_profile(len(present), imbalance)
    head = min(available[k] / profile[rank] for rank, k in enumerate(present))
    targets = {k: int(np.floor(head * profile[rank] + 1e-9)) for rank, k in enumerate(present)}
    empty = [k for k, n in targets.items() if n == 0]
    if empty:
        raise DataError(f"data.imbalance={imbalance:g} would leave class {empty[0]} without training images (the "
                        f"data has {available[present[0]]} in its largest class); choose a smaller imbalance.")
    rng = np.random.default_rng([seed, 11])
    kept = [rng.choice(np.flatnonzero(labels == k), size=n, replace=False) for k, n in targets.items()]
    return np.sort(np.concatenate(kept)).astype(np.int64)
