"""FedLSM's per-batch math (spec §5(a)), pure torch: uncertainty, pools, pseudo-labels, UDE MixUp, losses, q^k. Label
conventions: single-label ``labels`` are class ids with -1 = unlabelled; multi-label ``labels`` are ``[B, K]`` rows of
1/0/-1 (unknown entry). Targets are float ``[B, K]``: one-hot (or all-zero = no target) for single-label, hard 0/1 per
entry for multi-label, with a separate bool ``valid`` mask of entries that carry one."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from medflare.errors import PayloadError

__all__ = ["binary_entropy", "element_weights", "global_pos_weight", "mixup", "multi_label_targets", "pool_size",
           "sample_uncertainty", "single_label_targets", "soft_cross_entropy", "split_pools"]


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    """−p·log p − (1−p)·log(1−p) in nats, 0 at p ∈ {0, 1}."""
    return torch.special.entr(p) + torch.special.entr(1 - p)


def sample_uncertainty(logits: torch.Tensor, labels: torch.Tensor, multi_label: bool,
                       repo_compat: bool = False) -> torch.Tensor:
    """Each sample's uncertainty (UE, paper Eq. 3) from the received model's ``[N, K]`` logits (eval mode,
    non-augmented images). Single-label: the entropy of the softmax over all K classes (natural log), labelled or not.
    Multi-label: the binary entropy of each *unknown* entry (known entries are certain), divided by log 2 and averaged
    over the sample's unknown entries, so it lies in [0, 1] (the paper's "only U_k, normalised to [0, 1]"); 0 for a
    fully labelled sample. ``repo_compat`` (multi-label only) gives the authors' code instead: the mean over all K
    entries of −p·log p with p zeroed on known entries."""
    if not multi_label:
        return torch.special.entr(torch.softmax(logits, dim=1)).sum(dim=1)
    p, unknown = torch.sigmoid(logits), labels < 0
    if repo_compat:
        return torch.special.entr(p * unknown).mean(dim=1)
    per_entry = binary_entropy(p) / math.log(2.0) * unknown
    return per_entry.sum(dim=1) / unknown.sum(dim=1).clamp(min=1)


def pool_size(size: float, n: int) -> int:
    """A pool size given as a count (>= 1) or as a fraction of the ``n`` training samples (< 1), at least 1."""
    return max(1, min(n, int(size) if size >= 1 else int(round(size * n))))


def split_pools(uncertainty: torch.Tensor, n_uncertain: int,
                n_confident: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(D^h, D^l, pseudo pool) sample indices: the n^h most and n^l least uncertain samples, and every sample
    except D^h (which includes D^l, i.e. D^l ∪ D^m). Ties keep dataset order (stable sort)."""
    order = np.argsort(uncertainty.detach().cpu().numpy(), kind="stable")
    uncertain, confident = order[len(order) - n_uncertain:], order[:n_confident]
    pseudo = np.setdiff1d(np.arange(len(order)), uncertain)
    return np.sort(uncertain), np.sort(confident), pseudo


def single_label_targets(labels: torch.Tensor, teacher_probs: torch.Tensor, tau: float,
                         pseudo_classes: torch.Tensor) -> torch.Tensor:
    """One-hot targets ``[B, K]``: the label where there is one, else a pseudo-label (Eq. 4's ŷ). An unlabelled sample
    gets a one-hot at the teacher's argmax when that class is one the site does not annotate (``pseudo_classes``) and
    its probability is at least ``tau``; otherwise its row stays all-zero (no target, but it still counts in the loss's
    mean)."""
    num_classes = teacher_probs.shape[1]
    confidence, guess = teacher_probs.max(dim=1)
    pseudo = (labels < 0) & (confidence >= tau) & pseudo_classes[guess]
    chosen = torch.where(labels >= 0, labels, guess)
    keep = (labels >= 0) | pseudo
    return F.one_hot(chosen, num_classes).to(teacher_probs.dtype) * keep[:, None]


def multi_label_targets(labels: torch.Tensor, teacher_probs: torch.Tensor, tau_pos: float,
                        tau_neg: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, valid), both ``[B, K]``: known entries keep their label; an unknown entry becomes 1 when the
    teacher's sigmoid is >= ``tau_pos``, 0 when <= ``tau_neg``, and stays invalid (uncertain) in between."""
    known = labels >= 0
    positive, negative = teacher_probs >= tau_pos, teacher_probs <= tau_neg
    targets = torch.where(known, labels.to(teacher_probs.dtype), positive.to(teacher_probs.dtype))
    return targets, known | positive | negative


def element_weights(targets: torch.Tensor, valid: torch.Tensor, pos_weight: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-element weights of the multi-label BCE: 0 on invalid (uncertain) entries; on valid ones the class's
    global pos_weight for every entry (``mode="element"``, as the authors construct it) or only for positives,
    1 for negatives (``mode="positive"``, BCE's usual pos_weight)."""
    weights = pos_weight.to(targets.dtype).expand_as(targets)
    if mode == "positive":
        weights = torch.where(targets > 0.5, weights, torch.ones_like(weights))
    return weights * valid


def mixup(x_confident: torch.Tensor, x_uncertain: torch.Tensor, y_confident: torch.Tensor, y_uncertain: torch.Tensor,
          valid: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """UDE (paper Eq. 6): x̃ = λ·x_l + (1−λ)·x_h and ỹ = λ·y_l + (1−λ)·y_h, pairing row i with row i. ``valid`` is the
    mixed target's mask: for single-label a ``[B]`` (both partners have a label or a pseudo-label), for multi-label a
    ``[B, K]`` (both entries confident). Invalid targets are zeroed."""
    mixed_x = lam * x_confident + (1.0 - lam) * x_uncertain
    mixed_y = (lam * y_confident + (1.0 - lam) * y_uncertain) * (valid if valid.dim() == 2 else valid[:, None])
    return mixed_x, mixed_y, valid


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``mean over rows of −Σ_k t_k · log softmax(z)_k``; an all-zero target row adds 0 but counts in the mean."""
    return -(targets * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def global_pos_weight(positives: np.ndarray, negatives: np.ndarray, shares: np.ndarray | None = None) -> np.ndarray:
    """pos_weight_c = Σ_k negatives_c / Σ_k positives_c over the sites' counts ``[S, K]``; 1 for a class no site has a
    positive of (the authors divide by zero there). With ``shares`` (one per site, e.g. bounded by the job's share cap)
    the sums weigh each site's own fractions: Σ_k s_k·neg_c^k/n_k / Σ_k s_k·pos_c^k/n_k with n_k = pos_c^k + neg_c^k its
    image count. With s_k = n_k/Σ_j n_j that is the plain ratio; a capped s_k keeps one site's counts from setting every
    site's pos_weight. Counts are validated whole numbers in [0, MAX_SAMPLES], so the ratio is finite; a non-finite
    result (counts that bypassed validation) is refused rather than sent to every site as a NaN loss."""
    pos, neg = np.asarray(positives, np.float64), np.asarray(negatives, np.float64)
    if shares is None:
        numerator, denominator = neg.sum(axis=0), pos.sum(axis=0)
    else:
        images = pos + neg
        fraction = lambda counts: np.divide(counts, images, out=np.zeros_like(counts), where=images > 0)  # noqa: E731
        weights = np.asarray(shares, np.float64)[:, None]
        numerator, denominator = (weights * fraction(neg)).sum(axis=0), (weights * fraction(pos)).sum(axis=0)
    weight = np.divide(numerator, denominator, out=np.ones_like(denominator), where=denominator > 0)
    if not np.all(np.isfinite(weight)) or not np.all(np.isfinite(weight.astype(np.float32))):
        raise PayloadError(f"pos_weight would not be finite ({weight.tolist()[:8]}); the sites' label counts are "
                           "broken")
    return weight
