"""The math of the exchange: client-confidence weights, each site's mixed target T_p, and the site's loss on it. Server
side (numpy): site p's distillation loss is Σ_i w_i·KL(t_i ‖ softmax(z_p)) over the other sites i. Since KL(t ‖ p) = Σ_c
t_c log t_c − Σ_c t_c log p_c, that sum equals const − Σ_c T_p,c log p_c with the pre-mixed target T_p = Σ_i w_i t_i
(spec §3(b)). Its gradient in the logits, s_p·p − T_p with s_p = Σ_i w_i (the row sum of T_p), depends on T_p alone, so
the server sends each site T_p instead of every other site's probabilities.

Site side (torch): :func:`mixed_target_loss` is that −Σ_c T_p,c log p_c, averaged over the batch."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from medflare.methods.mdhfl.protocol import TARGET
from medflare.ops.influence import Mixture, mix


def ccr_weights(sites: list[str], previous: Mapping[str, float], current: Mapping[str, float], beta: float,
                eps: float = 1e-6) -> dict[str, float]:
    """RHFL's client-confidence re-weighting over the sites of one exchange (spec §3(a), step 2), guarded. ``q_p =
    (L_p^{e-1} − L_p^e) / L_p^e`` (a site's relative drop of its private SCE loss) and ``w = softmax(a)``. RHFL takes
    ``a_p = 1/(P−1) + β·q_p / Σ_j q_j``, which a site can steer: with Σ_j q_j just above zero the ratio is unbounded
    (one site's loss chosen so gives it all the weight), and when every loss rises Σ_j q_j < 0 and the ratio rewards the
    site whose loss rose most. The guard the spec asks for (a deviation from RHFL, stated in the method card): only
    drops count, ``a_p = 1/(P−1) + β·q_p⁺ / Σ_j q_j⁺`` with ``q⁺ = max(q, 0)``, so the β term lies in [0, β] and no site
    weighs more than e^β times another; when no site's loss fell (Σ_j q_j⁺ < ``eps``) the weights are uniform (1/P).
    When no site has a previous loss yet (the first round) every weight is 1/(P−1), as in the code's round 0. A site
    without both losses (``previous``: L^{e−1}, ``current``: L^e), or with a zero current loss, has q_p = 0. Returns
    site -> w_p, summing to 1 (P/(P−1) in the first round); {site: 1.0} for one."""
    if len(sites) < 2:
        return {site: 1.0 for site in sites}
    base = 1.0 / (len(sites) - 1)
    if not any(site in previous for site in sites):
        return {site: base for site in sites}
    drops = np.array([_relative_drop(previous.get(site), current.get(site)) for site in sites], dtype=np.float64)
    drops = np.where(np.isfinite(drops), np.maximum(drops, 0.0), 0.0)
    total = float(drops.sum())
    a = base + (beta * drops / total if total >= eps else np.zeros_like(drops))
    w = np.exp(a - a.max())
    return dict(zip(sites, (w / w.sum()).tolist()))


def mean_weights(sites: list[str], include_self: bool) -> dict[str, float]:
    """Equal weights that average what a site learns from: 1/P over all sites (FedMD's consensus, the site's own
    probabilities included) or 1/(P−1) over the others (the paper's Eq. 3 without CCR)."""
    if not sites:
        return {}
    count = len(sites) if include_self or len(sites) < 2 else len(sites) - 1
    return {site: 1.0 / count for site in sites}


def teacher_weights(weights: Mapping[str, float], include_self: bool = False) -> dict[str, dict[str, float]]:
    """receiver p -> the weights of the sites it learns from: every other site i with w_i (and itself when
    ``include_self``). A site with nobody else to learn from (a single participant) learns from no one."""
    if len(weights) < 2:
        return {site: {} for site in weights}
    return {p: {i: w for i, w in weights.items() if include_self or i != p} for p in weights}


def target_mixture(probs: Mapping[str, np.ndarray], weights: Mapping[str, float],
                   include_self: bool = False) -> Mixture:
    """Each site's T_p = Σ_i w_i·t_i as a :class:`Mixture` the server bounds (no teacher above the job's share cap)
    and builds, clipped to [0, 1] and in the dtype each site sent its probabilities in."""
    return Mixture(TARGET, dict(probs), teacher_weights(weights, include_self), low=0.0, high=1.0)


def mixed_targets(probs: Mapping[str, np.ndarray], weights: Mapping[str, float],
                  include_self: bool = False) -> dict[str, np.ndarray]:
    """Each site's T_p = Σ_i w_i·t_i (``probs``: site -> t_i, rows x K) over the other sites i (and itself when
    ``include_self``, FedMD's consensus), in float64, unbounded (what the server sends with no share cap). A site
    with nobody else to learn from gets no target."""
    exact = {site: np.asarray(p, dtype=np.float64) for site, p in probs.items()}
    mixture = Mixture(TARGET, exact, teacher_weights({s: weights[s] for s in probs}, include_self))
    return {site: arrays[TARGET] for site, arrays in mix(mixture).items() if arrays}


def mixed_target_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``−Σ_c T_c·log softmax(z)_c`` averaged over the batch of public rows ``[B, K]``: Σ_i w_i·KL(t_i ‖ softmax(z))
    up to a constant (T_p's rows sum to s_p)."""
    return -(target.to(logits.dtype) * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def _relative_drop(previous: float | None, current: float | None) -> float:
    if previous is None or current is None or current <= 0:
        return 0.0
    return (previous - current) / current
