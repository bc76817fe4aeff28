"""The site side of the exchange: probabilities on public rows, KL steps toward T_p, local SCE (or CE) epochs.
The local epochs run in the shared loop (the local-only trainer's loss); the distillation steps on public rows are
this method's own loop, built on the trainer's ``optimizer_step``."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from medflare.contracts import ArraySpec, ContractContext
from medflare.data.public import public_digest
from medflare.errors import DataError, PayloadError
from medflare.losses import symmetric_cross_entropy
from medflare.methods.base import RoundContext
from medflare.methods.local_only.client import LocalOnlyTrainer
from medflare.methods.mdhfl.protocol import (
    DISTILL_PHASE,
    KL_LOSS,
    PRIVATE_LOSS,
    PROBS,
    PROBS_PHASE,
    PUBLIC_DIGEST,
    PUBLIC_ROWS,
    PUBLIC_SIZE,
    SETUP_PHASE,
    TARGET,
)
from medflare.methods.mdhfl.targets import mixed_target_loss
from medflare.optim import build_optimizer


class MdhflTrainer(LocalOnlyTrainer):
    """A site of MDH-FL (or FedMD): its own architecture, its own data; only probabilities and scalars leave it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # E_l goes into the job's settings, which train_round starts every round from (set on train_cfg, it was lost)
        self.job_train_cfg = dataclasses.replace(self.job_train_cfg, local_epochs=self._local_epochs())
        self.train_cfg = self.job_train_cfg
        self.kl_optimizer: torch.optim.Optimizer | None = None  # kept only with method.kl_optimizer=persistent
        self.rows: tuple[int, int] | None = None  # (first row, count) of the chunk the last probabilities covered
        self.loss_round = -1  # the round whose private loss was last sent (once per round, first chunk)
        self.kl_loss: float | None = None  # of the current train task's KL steps

    # ----- the exchange's tasks -------------------------------------------------------------------
    def run_phase(self, phase: str, arrays: Mapping[str, np.ndarray],
                  ctx: RoundContext) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if phase == SETUP_PHASE:
            public = self._public()
            parameters = sum(p.numel() for p in self.model.parameters())
            self.record_locally(round=ctx.round, public_size=len(public), parameters=parameters)  # stays here
            self._pretrain(ctx)
            return {}, {PUBLIC_DIGEST: public_digest(public.images), PUBLIC_SIZE: len(public)}
        if phase == PROBS_PHASE:
            return self._share_probabilities(arrays, ctx)
        if phase == DISTILL_PHASE:
            return {}, {KL_LOSS: self._distill(arrays.get(TARGET))}
        return super().run_phase(phase, arrays, ctx)

    def on_round_start(self, ctx: RoundContext) -> None:
        """The last chunk's KL steps, before the local epochs (a site missing from the chunk gets no target)."""
        self.kl_loss = self._distill(self.received[TARGET]) if TARGET in self.received else None

    def round_meta(self, ctx: RoundContext) -> dict[str, Any]:
        return {} if self.kl_loss is None else {KL_LOSS: self.kl_loss}

    def extra_state(self) -> dict[str, Any]:
        return {"rows": self.rows, "loss_round": self.loss_round,
                "kl_optimizer": None if self.kl_optimizer is None else self.kl_optimizer.state_dict()}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.rows = None if state.get("rows") is None else tuple(state["rows"])
        self.loss_round = int(state.get("loss_round", -1))
        if state.get("kl_optimizer") is not None:
            self.kl_optimizer = build_optimizer(self.model, self.train_cfg, self.parameters_to_train())
            self.kl_optimizer.load_state_dict(state["kl_optimizer"])

    # ----- internals ------------------------------------------------------------------------------
    def _share_probabilities(self, arrays: Mapping[str, np.ndarray],
                             ctx: RoundContext) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Softmax of the current model on the chunk's rows (eval mode), plus the private loss once a round."""
        self.rows = self._chunk_rows(arrays.get(PUBLIC_ROWS))
        self.model.eval()
        chunks = []
        with torch.no_grad():
            for images, _ in self._public_loader(drop_last=False):
                chunks.append(torch.softmax(self.predict_logits(images.to(self.device)).float(), dim=1).cpu())
        meta: dict[str, Any] = {}
        if self.cfg.weighting == "ccr" and ctx.round != self.loss_round:
            meta[PRIVATE_LOSS] = self._private_loss()
            self.loss_round = ctx.round
            self.record_locally(round=ctx.round, private_loss=meta[PRIVATE_LOSS])
        return {PROBS: torch.cat(chunks).numpy().astype(self.cfg.probs_dtype)}, meta

    def _distill(self, target: np.ndarray) -> float:
        """KL steps toward T_p over the chunk's rows in fixed order (train mode, spec §3(a) step 3)."""
        if self.rows is None:
            raise PayloadError("received a distillation target before any public probabilities were sent")
        target = self._checked_target(target)
        self.model.train()
        losses, start = [], 0
        for images, _ in self._public_loader(drop_last=self.rows[1] > self.train_cfg.batch_size):
            rows = torch.as_tensor(target[start:start + len(images)], dtype=torch.float32, device=self.device)
            start += len(images)
            if len(images) < 2:
                continue  # batch norm cannot train on a single image
            images = images.to(self.device)
            loss = self.optimizer_step(self._kl_step_optimizer(),  # the closure runs within this iteration
                                       lambda: mixed_target_loss(self.model(images), rows))  # noqa: B023
            losses.append(loss)
        mean = float(np.mean(losses)) if losses else 0.0
        self.record_locally(kl_loss=mean, kl_steps=len(losses))
        return mean

    def _kl_step_optimizer(self) -> torch.optim.Optimizer:
        """A brand-new Adam for every KL step (the authors' code, ≈ signSGD at lr), or one kept for the job."""
        if self.cfg.kl_optimizer == "step" or self.kl_optimizer is None:
            optimizer = build_optimizer(self.model, self.train_cfg, self.parameters_to_train())
            if self.cfg.kl_optimizer == "step":
                return optimizer
            self.kl_optimizer = optimizer
        return self.kl_optimizer

    def _private_loss(self) -> float:
        """Mean SCE of the current model over the private training set (eval mode, no gradient): CCR's L_p."""
        loader = DataLoader(self.data.train, batch_size=self.train_cfg.eval_batch_size, shuffle=False)
        total, count = 0.0, 0
        self.model.eval()
        with torch.no_grad():
            for images, labels in loader:
                labelled = labels >= 0
                if not bool(labelled.any()):
                    continue
                logits = self.predict_logits(images[labelled].to(self.device)).float()
                targets = labels[labelled].to(self.device)
                loss = symmetric_cross_entropy(logits, targets, self.cfg.sce_alpha, self.cfg.sce_beta)
                total, count = total + float(loss) * len(targets), count + len(targets)
        return total / max(count, 1)

    def _public_loader(self, drop_last: bool) -> DataLoader:
        first, count = self.rows
        indices = ((first + np.arange(count)) % len(self._public())).tolist()
        return DataLoader(Subset(self._public(), indices), batch_size=self.train_cfg.batch_size, shuffle=False,
                          drop_last=drop_last)

    def _chunk_rows(self, value: Any) -> tuple[int, int]:
        """The server's [first row, count], checked against this site's public set."""
        size = len(self._public())
        rows = np.asarray(value) if value is not None else np.zeros(0)
        if rows.shape != (2,) or rows.dtype.kind not in "iu" or not (0 <= rows[0] < size and 1 <= rows[1] <= size):
            raise PayloadError(f"'{PUBLIC_ROWS}' must be [first row, count] within this site's {size} public images")
        return int(rows[0]), int(rows[1])

    def _checked_target(self, target: Any) -> np.ndarray:
        """T_p must be a finite (chunk rows x K) float16/float32 array in [0, 1]: a site trusts no server blindly."""
        spec = ArraySpec(shape=(self.rows[1], "num_classes"), dtypes=("float16", "float32"), low=0.0, high=1.0 + 1e-3)
        return spec.check(TARGET, target, ContractContext(int(self.data.num_classes))).astype(np.float32)

    def _public(self) -> Any:
        if self.data.public is None:
            raise DataError(f"{self.data.site_name}: this method needs the unlabelled public set; set "
                            "data.public_fraction (simulation) or data.public_source (a site's local copy, in its "
                            "medflare_site.json)")
        return self.data.public

    def _local_epochs(self) -> int:
        """E_l: method.local_epochs; else train.local_epochs when it is not 1; else the authors' rule
        max(N_public // N_private, 1) with N_public the public rows used per round (1 without a public set)."""
        if self.cfg.local_epochs > 0:
            return self.cfg.local_epochs
        if self.train_cfg.local_epochs != 1:
            return self.train_cfg.local_epochs
        if not self.cfg.distill or self.data.public is None:
            return 1
        public = min(self.cfg.public_per_round or len(self.data.public), len(self.data.public))
        return max(public // max(len(self.data.train), 1), 1)

    def _pretrain(self, ctx: RoundContext) -> None:
        """RHFL's warm-up: ``pretrain_epochs`` of the local loss before the first exchange (0 in MDH-FL)."""
        if self.cfg.pretrain_epochs <= 0:
            return
        main = self.job_train_cfg
        self.job_train_cfg = dataclasses.replace(main, local_epochs=self.cfg.pretrain_epochs)
        try:
            self.train_round(dataclasses.replace(ctx, stage="pretrain"))
        finally:
            self.job_train_cfg = self.train_cfg = main
