"""FedLSM server: FedAvg by n_k for the feature extractor, per-class classifier rows by q^k (AWPA), and the
multi-label set-up phase that turns the sites' label counts into the global pos_weight."""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from medflare import contracts
from medflare.errors import PayloadError
from medflare.methods.base import PerSite, RoundContext, ServerRule, SiteUpdate
from medflare.methods.fedlsm.pseudo import global_pos_weight
from medflare.ops.influence import Weighting, bound

LABEL_COUNTS = "label_counts"  # the set-up phase's task name
POSITIVES, NEGATIVES = "positives", "negatives"  # its arrays: per-class counts of one site
POS_WEIGHT = "pos_weight"  # server -> site with every multi-label train task
Q_KEY = "q"  # per-class labels + pseudo-labels drawn this round (AWPA's q^k)
IDENTIFIED_KEY = "identified"  # 0/1 per class: the classes the site annotates (masked aggregation)
CLASSIFIER_KEYS = r"^head\."  # every registered network's classifier (models.Classifier)
PAYLOAD = contracts.Payload(
    arrays={POSITIVES: contracts.counts(phase=LABEL_COUNTS), NEGATIVES: contracts.counts(phase=LABEL_COUNTS)},
    receives=(POS_WEIGHT,),
    meta={Q_KEY: contracts.class_counts(Q_KEY), IDENTIFIED_KEY: contracts.class_mask(IDENTIFIED_KEY)},
)


def classifier_row_weights(updates: list[SiteUpdate], classifier_keys: str,
                           vectors: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    r"""key -> site -> per-class weights (``vectors``: site -> length-K weights; AWPA: q^k, masked: n_k · 1[c ∈ I_k])
    for every classifier array (weight rows and bias entries alike) whose key matches ``classifier_keys``.
    ``ops.weighted_average`` normalises each row over sites and falls back to the scalar (n_k) shares for a row whose
    weights sum to zero at every site."""
    keys = [k for k in updates[0].arrays if re.search(classifier_keys, k)] if updates else []
    if updates and not keys:
        raise PayloadError(f"no classifier array matches '{classifier_keys}'; set method.classifier_keys")
    return {key: {u.site: np.asarray(vectors[u.site], dtype=np.float64) for u in updates} for key in keys}


def label_count_images(update: SiteUpdate) -> float:
    """The image count a site's label counts describe (positives + negatives of any class)."""
    positives, negatives = update.arrays[POSITIVES], update.arrays[NEGATIVES]
    return float(positives[0] + negatives[0]) if len(positives) else 0.0


def masked_vectors(updates: list[SiteUpdate]) -> dict[str, np.ndarray]:
    """site -> n_k · 1[c ∈ I_k]: each class's row is averaged over the sites that annotate it, by n_k."""
    return {u.site: float(u.meta[contracts.N_SAMPLES]) * np.asarray(u.meta[IDENTIFIED_KEY]) for u in updates}


class FedLsmRule(ServerRule):
    """θ ← Σ_k (n_k/n) θ_k for every key; classifier row c ← Σ_k (q_c^k / Σ_j q_c^j) ψ_{k,c} (``"awpa"``).
    ``aggregation="masked"`` averages row c over the sites that annotate c, by n_k (FPSL's task-dependent aggregation as
    spec §5(e)8 infers it); ``"samples"`` is plain FedAvg. A row nobody has a count for falls back to n_k, the site's
    whole training set (every image trains through labels, pseudo-labels or MixUp). Multi-label jobs run a
    ``label_counts`` phase before the first train phase (and again whenever the rule has no pos_weight, e.g. after a
    server restart): every site sends its per-class positive and negative counts, the server keeps pos_weight_c = Σ
    neg_c / Σ pos_c for the job and sends it with every train task."""

    def __init__(self, method_cfg: Any, total_rounds: int, payload: contracts.Payload = contracts.Payload()) -> None:
        super().__init__(method_cfg, total_rounds, payload)
        self.pos_weight: np.ndarray | None = None
        self.images: dict[str, float] = {}  # site -> the image count its label counts describe (multi-label)

    def phases(self, ctx: RoundContext) -> list[str]:
        if self.multi_label and (ctx.round == 0 or self.pos_weight is None):
            return [LABEL_COUNTS, contracts.TRAIN_PHASE]
        return [contracts.TRAIN_PHASE]

    def phase_arrays(self, phase: str, ctx: RoundContext, global_params: Mapping[str, np.ndarray],
                     earlier: Mapping[str, list[SiteUpdate]]) -> dict[str, np.ndarray] | PerSite:
        arrays = super().phase_arrays(phase, ctx, global_params, earlier)
        if phase != contracts.TRAIN_PHASE or not self.multi_label:
            return arrays
        if earlier.get(LABEL_COUNTS):
            counts = earlier[LABEL_COUNTS]
            positives, negatives = ([u.arrays[key] for u in counts] for key in (POSITIVES, NEGATIVES))
            sizes = {u.site: float(label_count_images(u)) for u in counts}
            shares = bound(Weighting(sizes), self.share_cap).sites  # each site's say in pos_weight, capped
            self.pos_weight = global_pos_weight(positives, negatives, np.array([shares[u.site] for u in counts]))
        if self.pos_weight is None:
            raise PayloadError("no site answered the label_counts phase, so there is no pos_weight to send")
        return {**arrays, POS_WEIGHT: self.pos_weight.astype(np.float32)}

    def row_weights(self, updates: list[SiteUpdate]) -> dict[str, dict[str, np.ndarray]] | None:
        if self.cfg.aggregation == "samples":
            return None
        if self.cfg.aggregation == "masked":
            vectors = masked_vectors(updates)
        else:
            vectors = {u.site: np.asarray(u.meta[Q_KEY]) for u in updates}
        return classifier_row_weights(updates, self.cfg.classifier_keys, vectors)

    def check_update(self, phase: str, update: SiteUpdate, ctx: RoundContext) -> None:
        """A site's label counts describe one set of images: positives_c + negatives_c is its image count for every
        class c (the site counts unknown entries as negatives), and its later ``n_samples`` (the whole training set)
        is that count."""
        if phase == LABEL_COUNTS:
            images = np.asarray(update.arrays[POSITIVES], np.float64) + np.asarray(update.arrays[NEGATIVES], np.float64)
            if images.size and not np.all(images == images[0]):
                raise PayloadError(f"label counts are inconsistent: positives + negatives differ between classes "
                                   f"({images.min():g} to {images.max():g}); each class counts the same images")
            self.images[update.site] = float(images[0]) if images.size else 0.0
        elif phase == contracts.TRAIN_PHASE and update.site in self.images:
            reported = float(update.meta.get(contracts.N_SAMPLES, -1))
            if reported != self.images[update.site]:
                raise PayloadError(f"n_samples={reported:g} differs from the {self.images[update.site]:g} images this "
                                   "site's label counts describe")

    def site_weight(self, update: SiteUpdate, ctx: RoundContext) -> float:
        key = {"awpa": Q_KEY, "masked": IDENTIFIED_KEY}.get(self.cfg.aggregation)
        if key is not None and key not in update.meta:
            raise PayloadError(f"aggregation '{self.cfg.aggregation}' needs '{key}' in every update")
        return super().site_weight(update, ctx)

    def round_info(self, updates: list[SiteUpdate], ctx: RoundContext) -> dict[str, Any]:
        info: dict[str, Any] = {Q_KEY: {u.site: u.meta[Q_KEY] for u in updates if Q_KEY in u.meta}}
        if self.pos_weight is not None and ctx.round == 0:
            info[POS_WEIGHT] = self.pos_weight.tolist()
        return info
