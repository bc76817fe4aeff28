"""FedLSM site update (spec §5(a)): UE pools, EMA-teacher pseudo-labels on weak views, student on strong views,
UDE MixUp between the uncertain and the confident pool, and the class counts q^k for AWPA."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, default_collate

from medflare import contracts
from medflare.data import MultiViewDataset, build_transform
from medflare.errors import ConfigError, PayloadError
from medflare.losses import weighted_bce
from medflare.methods.base import LocalTrainer, RoundContext, small_classes
from medflare.methods.fedlsm.pseudo import (
    element_weights,
    mixup,
    multi_label_targets,
    pool_size,
    sample_uncertainty,
    single_label_targets,
    soft_cross_entropy,
    split_pools,
)
from medflare.methods.fedlsm.server import IDENTIFIED_KEY, LABEL_COUNTS, NEGATIVES, POS_WEIGHT, POSITIVES, Q_KEY
from medflare.models import EmaTeacher

__all__ = ["FedLsmTrainer", "identified_classes"]


def identified_classes(data: Any) -> np.ndarray:
    """bool ``[K]`` of the classes a site annotates: its declared set, else the classes it has labels of
    (multi-label: the classes with any known entry)."""
    if getattr(data, "identified", None) is not None:
        return np.asarray(data.identified, dtype=bool)
    labels = np.asarray(data.train.labels)
    if labels.ndim == 2:
        return (labels >= 0).any(axis=0)
    return np.asarray(data.class_counts) > 0


class _Stream:
    """An endless stream of indices, reshuffled after every pass (the authors' infinite shuffled loaders)."""

    def __init__(self, indices: np.ndarray, rng: np.random.Generator) -> None:
        if len(indices) == 0:
            raise ConfigError("a FedLSM pool is empty; the site needs more training images than the pools take")
        self.indices, self.rng, self.queue = np.asarray(indices), rng, np.empty(0, dtype=np.int64)

    def take(self, n: int) -> np.ndarray:
        while len(self.queue) < n:
            self.queue = np.concatenate([self.queue, self.rng.permutation(self.indices)])
        taken, self.queue = self.queue[:n], self.queue[n:]
        return taken


@dataclass
class _Split:
    """One batch taken apart: strong views of the pool, D^h and D^l images, and per part (pool, D^h, D^l) labels and
    teacher logits (of the pool's weak view, the partners' plain one)."""

    strong: torch.Tensor
    x_h: torch.Tensor
    x_l: torch.Tensor
    labels: list[torch.Tensor]
    teacher: list[torch.Tensor]
    lam: float


class _Batches:
    """T batches of ``[B, 2, C, H, W]`` images: rows 0..P-1 are (weak, strong) views from the pseudo pool, then
    M rows of D^h and M rows of D^l (their plain view, twice), with their labels."""

    def __init__(self, trainer: FedLsmTrainer, steps: int) -> None:
        self.trainer, self.steps = trainer, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.trainer.draw_batch() for _ in range(self.steps))


class FedLsmTrainer(LocalTrainer):
    """The site side of FedLSM (single- and multi-label; the data decides). Per round: the received model scores every
    training image (eval mode, no augmentation) and the most and least uncertain samples form D^h and D^l; a fresh EMA
    teacher pseudo-labels weak views of the pseudo pool (all but D^h) and the student learns from strong views; UDE
    mixes D^l with D^h rows, their targets labels or pseudo-labels at the looser thresholds. q^k counts labels and
    positive pseudo-labels per draw and travels in the meta; teacher, pools and pseudo-labels stay here."""

    uses_unlabelled_samples = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg, data = self.cfg, self.data
        self.mix_rows = cfg.mix_batch if cfg.ude else 0
        self.pool_rows = self.train_cfg.batch_size - self.mix_rows
        if self.pool_rows < 1:
            raise ConfigError(f"fedlsm: train.batch_size={self.train_cfg.batch_size} leaves no pseudo-pool rows after "
                              f"mix_batch={self.mix_rows}; raise the batch size")
        weak, strong = (build_transform(data.channels, data.image_size, train=True, augment=augment)
                        for augment in (cfg.weak_augment, cfg.strong_augment))
        self.two_views = MultiViewDataset(data.train, [weak, strong])
        self.plain = MultiViewDataset(data.train, [build_transform(data.channels, data.image_size, train=False)])
        self.identified = torch.as_tensor(identified_classes(data), device=self.device)
        unknown = ~self.identified
        self.pseudo_classes = unknown if unknown.any() and not cfg.repo_compat else torch.ones_like(unknown)
        self.rng = np.random.default_rng(int(torch.randint(2**31 - 1, ()).item()))  # seeded by the site's torch seed
        self.q = torch.zeros(int(data.num_classes), dtype=torch.float64, device=self.device)
        self.teacher: EmaTeacher | None = None
        self.pos_weight: torch.Tensor | None = None

    # ----- round set-up ------------------------------------------------------------------------------
    def on_round_start(self, ctx: RoundContext) -> None:
        if self.multi_label:
            if POS_WEIGHT not in self.received:
                raise PayloadError("multi-label FedLSM needs the server's pos_weight with the train task")
            self.pos_weight = torch.as_tensor(self.received[POS_WEIGHT], dtype=torch.float32, device=self.device)
        self.uncertain, self.confident, pseudo = self.pools()
        self.streams = {name: _Stream(indices, self.rng) for name, indices in
                        (("pseudo", pseudo), ("uncertain", self.uncertain), ("confident", self.confident))}
        steps = self.cfg.local_iterations or math.ceil(len(pseudo) / self.pool_rows)
        self.batches = _Batches(self, steps)
        self.teacher = EmaTeacher(self.model, self.cfg.ema_decay)  # fresh from the received model
        self.q.zero_()

    def pools(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(D^h, D^l, pseudo pool) for this round, by uncertainty (UE) or at random (``ue=False``)."""
        n = len(self.data.train)
        n_uncertain, n_confident = pool_size(self.cfg.uncertain_pool, n), pool_size(self.cfg.confident_pool, n)
        if n_uncertain + n_confident > n:
            raise ConfigError(f"fedlsm pools take {n_uncertain} + {n_confident} of the site's {n} training images; "
                              "lower uncertain_pool or confident_pool")
        if not self.cfg.ue:  # ablation: no uncertainty, random D^h and D^l, pseudo-labels on every sample
            order = self.rng.permutation(n)
            return np.sort(order[:n_uncertain]), np.sort(order[n_uncertain:n_uncertain + n_confident]), np.arange(n)
        return split_pools(self.uncertainty(), n_uncertain, n_confident)

    @torch.no_grad()
    def uncertainty(self) -> torch.Tensor:
        """Each training image's uncertainty under the received model: eval mode, non-augmented view."""
        self.model.eval()
        logits, labels = [], []
        for images, batch_labels in DataLoader(self.plain, batch_size=self.train_cfg.eval_batch_size):
            logits.append(self.model(images[:, 0].to(self.device)).float().cpu())
            labels.append(batch_labels)
        return sample_uncertainty(torch.cat(logits), torch.cat(labels), self.multi_label, self.cfg.repo_compat)

    def train_loader(self) -> _Batches:
        """This round's T batches (drawn lazily from the pools set up in :meth:`on_round_start`)."""
        return self.batches

    def draw_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: pseudo-pool rows (weak, strong), then D^h rows and D^l rows (plain view, twice)."""
        items = [self.two_views[i] for i in self.streams["pseudo"].take(self.pool_rows)]
        for pool in ("uncertain", "confident"):
            for i in self.streams[pool].take(self.mix_rows):
                image, label = self.plain[i]
                items.append((image.expand(2, -1, -1, -1), label))
        return tuple(default_collate(items))

    # ----- the loss ----------------------------------------------------------------------------------
    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rows, mix = self.pool_rows, self.mix_rows
        parts = (slice(0, rows), slice(rows, rows + mix), slice(rows + mix, None))  # pseudo pool, D^h, D^l
        teacher_logits = self.teacher(torch.cat([images[:rows, 0], images[rows:, 0]])).float()
        batch = _Split(
            strong=images[:rows, 1], x_h=images[parts[1], 0], x_l=images[parts[2], 0],
            labels=[labels[part] for part in parts], teacher=[teacher_logits[part] for part in parts],
            lam=self.mixup_lambda() if mix else 0.0,
        )
        return self._multi_label_loss(batch) if self.multi_label else self._single_label_loss(batch)

    def mixup_lambda(self) -> float:
        """UDE's λ ~ Beta(α, α), drawn once per batch."""
        return float(self.rng.beta(self.cfg.mixup_alpha, self.cfg.mixup_alpha))

    def _single_label_loss(self, batch: _Split) -> torch.Tensor:
        cfg = self.cfg
        probs = [torch.softmax(z, dim=1) for z in batch.teacher]
        targets = single_label_targets(batch.labels[0], probs[0], cfg.tau, self.pseudo_classes)
        self.q += targets.sum(dim=0).double()
        # spec §5(e)1: the authors' test never fires, so their partners keep ground truth only (repo_compat)
        tau_h, tau_l = (math.inf, math.inf) if cfg.repo_compat else (cfg.tau_uncertain, cfg.tau)
        y_h = single_label_targets(batch.labels[1], probs[1], tau_h, self.pseudo_classes)
        y_l = single_label_targets(batch.labels[2], probs[2], tau_l, self.pseudo_classes)
        valid = (y_h.sum(dim=1) > 0) & (y_l.sum(dim=1) > 0)
        mixed_x, mixed_y, _ = mixup(batch.x_l, batch.x_h, y_l, y_h, valid, batch.lam)
        logits = self.model(torch.cat([batch.strong, mixed_x])).float()
        loss = soft_cross_entropy(logits[: len(batch.strong)], targets)
        if self.mix_rows:
            loss = loss + cfg.lambda_ude * soft_cross_entropy(logits[len(batch.strong):], mixed_y)
        return loss

    def _multi_label_loss(self, batch: _Split) -> torch.Tensor:
        cfg = self.cfg
        probs = [torch.sigmoid(z) for z in batch.teacher]
        targets, valid = multi_label_targets(batch.labels[0], probs[0], cfg.tau_pos, cfg.tau_neg)
        weights = element_weights(targets, valid, self.pos_weight, cfg.pos_weight_mode)
        self.q += (targets * valid).sum(dim=0).double()  # known positives + positive pseudo-labels
        y_h, valid_h = multi_label_targets(batch.labels[1], probs[1], cfg.tau_uncertain_pos, cfg.tau_uncertain_neg)
        y_l, valid_l = multi_label_targets(batch.labels[2], probs[2], cfg.tau_pos, cfg.tau_neg)
        mixed_x, mixed_y, mixed_valid = mixup(batch.x_l, batch.x_h, y_l, y_h, valid_h & valid_l, batch.lam)
        logits = self.model(torch.cat([batch.strong, mixed_x])).float()
        pool_logits, mix_logits = logits[: len(batch.strong)], logits[len(batch.strong):]
        if cfg.repo_compat:  # spec §5(e)2: mean BCE first, then the weights (they collapse to their mean)
            soft = torch.where(valid, targets, probs[0])
            loss = F.binary_cross_entropy_with_logits(pool_logits, soft) * weights.mean()
            mix_loss = F.binary_cross_entropy_with_logits(mix_logits, mixed_y) * mixed_valid.float().mean()
        else:
            loss = weighted_bce(pool_logits, targets, weights)
            mix_loss = weighted_bce(mix_logits, mixed_y, mixed_valid)
        return loss + cfg.lambda_ude * mix_loss if self.mix_rows else loss

    def after_step(self) -> None:
        self.teacher.update(self.model)

    # ----- what leaves the site --------------------------------------------------------------------------
    def round_meta(self, ctx: RoundContext) -> dict[str, Any]:
        # a class the site's policy counts too small to report is reported as one it has none of
        q = self.q.cpu().numpy()
        shown = ~small_classes(q, self.min_class_samples)
        meta: dict[str, Any] = {contracts.N_SAMPLES: len(self.data.train), Q_KEY: (q * shown).tolist()}
        if self.cfg.aggregation == "masked":
            meta[IDENTIFIED_KEY] = (self.identified.double().cpu().numpy() * shown).tolist()
        self.record_locally(round=ctx.round, q=self.q.tolist(), uncertain=len(self.uncertain),
                            confident=len(self.confident), steps=len(self.batches))
        return meta

    def run_phase(self, phase: str, arrays: Mapping[str, np.ndarray],
                  ctx: RoundContext) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The multi-label set-up: per-class positives and negatives (unknown entries count as negatives, as the
        authors count them) of the site's training labels."""
        if phase != LABEL_COUNTS or not self.multi_label:
            return super().run_phase(phase, arrays, ctx)
        labels = np.asarray(self.data.train.labels)
        positives = (labels == 1).sum(axis=0).astype(np.int64)
        # under the site policy's floor a class is counted as if the site had no positive of it
        hidden = small_classes(positives, self.min_class_samples) | small_classes(len(labels) - positives,
                                                                                  self.min_class_samples)
        positives[hidden] = 0
        return {POSITIVES: positives, NEGATIVES: len(labels) - positives}, {}
