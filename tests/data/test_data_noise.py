"""Label noise (spec §1.3): transition matrices and empirical flip behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from medflare.data import inject_label_noise, noise_transition_matrix
from medflare.errors import ConfigError, DataError


@pytest.mark.parametrize("kind", ["symmetric", "pairflip"])
@pytest.mark.parametrize("num_classes, rate", [(2, 0.2), (5, 0.3), (13, 0.1), (4, 0.0)])
def test_transition_matrix_is_row_stochastic_with_diagonal_one_minus_rate(kind: str, num_classes: int,
                                                                           rate: float) -> None:
    """Rows sum to 1, the diagonal is 1 - μ, and off-diagonal mass sits where the kind says."""
    # Execute
    matrix = noise_transition_matrix(num_classes, rate, kind)

    # Assert
    assert matrix.shape == (num_classes, num_classes)
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0)
    np.testing.assert_allclose(np.diag(matrix), 1.0 - rate)
    off = matrix - np.diag(np.diag(matrix))
    if kind == "symmetric":
        expected = np.full_like(off, rate / (num_classes - 1))
        np.fill_diagonal(expected, 0.0)
    else:
        expected = np.zeros_like(off)
        expected[np.arange(num_classes), (np.arange(num_classes) + 1) % num_classes] = rate
    np.testing.assert_allclose(off, expected)


@pytest.mark.parametrize("kind", ["symmetric", "pairflip"])
@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_empirical_flip_rate_matches_rate(kind: str, rate: float) -> None:
    """On 20k samples the share of changed labels is μ within 1.5 points."""
    # Prepare
    labels = np.random.default_rng(0).integers(0, 6, 20_000)

    # Execute
    noisy = inject_label_noise(labels, 6, rate, kind, seed=0)

    # Assert
    assert np.mean(noisy != labels) == pytest.approx(rate, abs=0.015)


def test_pairflip_only_moves_to_next_class() -> None:
    """Pair-flip noise sends y only to (y + 1) mod K."""
    # Prepare
    labels = np.random.default_rng(1).integers(0, 5, 5000)

    # Execute
    noisy = inject_label_noise(labels, 5, 0.4, "pairflip", seed=3)

    # Assert
    flipped = noisy != labels
    assert flipped.any()
    assert np.array_equal(noisy[flipped], (labels[flipped] + 1) % 5)


def test_symmetric_spreads_flips_evenly_over_other_classes() -> None:
    """Symmetric noise from class 0 lands on each of the K-1 other classes about equally."""
    # Prepare
    labels = np.zeros(20_000, dtype=np.int64)

    # Execute
    noisy = inject_label_noise(labels, 5, 0.4, "symmetric", seed=0)

    # Assert
    shares = np.bincount(noisy[noisy != 0], minlength=5)[1:] / np.sum(noisy != 0)
    np.testing.assert_allclose(shares, 0.25, atol=0.02)


def test_noise_is_seeded_keeps_unlabeled_and_rate_zero_is_identity() -> None:
    """Same seed → same noise; -1 stays -1; μ = 0 changes nothing; the input is not modified."""
    # Prepare
    labels = np.random.default_rng(2).integers(-1, 4, 3000)
    original = labels.copy()

    # Execute
    first = inject_label_noise(labels, 4, 0.3, "symmetric", seed=5)
    again = inject_label_noise(labels, 4, 0.3, "symmetric", seed=5)
    other = inject_label_noise(labels, 4, 0.3, "symmetric", seed=6)
    clean = inject_label_noise(labels, 4, 0.0, "pairflip", seed=5)

    # Assert
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    assert np.array_equal(first == -1, labels == -1)
    assert np.array_equal(clean, labels) and np.array_equal(labels, original)


def test_rhfl_convention_one_multinomial_draw_per_sample_with_random_state() -> None:
    """The draws are RHFL's: RandomState(seed).multinomial(1, P[y]) once per sample, in array order."""
    # Prepare
    labels = np.array([0, 1, 2, 2, 1, 0, 3, 3])
    matrix = noise_transition_matrix(4, 0.5, "symmetric")
    state = np.random.RandomState(0)

    # Execute
    expected = [int(np.argmax(state.multinomial(1, matrix[y]))) for y in labels]

    # Assert
    assert inject_label_noise(labels, 4, 0.5, "symmetric", seed=0).tolist() == expected


@pytest.mark.parametrize("args, error, message", [
    ((5, 0.2, "uniform"), ConfigError, "symmetric, pairflip"),
    ((1, 0.2, "symmetric"), ConfigError, "at least 2 classes"),
    ((5, 1.5, "pairflip"), ConfigError, r"\[0, 1\]"),
])
def test_bad_noise_settings_raise(args: tuple, error: type, message: str) -> None:
    """Unknown kind, too few classes or a rate outside [0, 1] are config errors."""
    with pytest.raises(error, match=message):
        noise_transition_matrix(*args)


def test_label_outside_classes_is_a_data_error() -> None:
    """A label >= K cannot be noised and is reported with its row."""
    with pytest.raises(DataError, match="row 2"):
        inject_label_noise(np.array([0, 1, 7]), 3, 0.1, "symmetric")
