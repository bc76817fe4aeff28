"""SSL-FL site update: masked-image pre-training on every local image, then supervised fine-tuning on the labels.
The stage of each round (sent by the server) decides what a step does; the loop, the optimizer kept within a stage
and the per-step schedule come from :class:`~medflare.methods.base.LocalTrainer` and ``train.stages``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Subset

from medflare.data import ImageDataset, build_transform
from medflare.errors import ConfigError
from medflare.methods.base import LocalTrainer, RoundContext
from medflare.methods.ssl_fl.masking import BlockMaskGenerator, beit_mask_count
from medflare.methods.ssl_fl.model import FINETUNE, TOKENIZER, UNLABELLED_STAGES, set_drop_path
from medflare.methods.ssl_fl.tokenizer import DalleTokenizer, code_usage

if TYPE_CHECKING:
    from timm.data import Mixup

N_IMAGES = "n_images"  # every local training image, labelled or not: the FedAvg weight of pre-training
# Fed-BEiT: the visual tokens of the round's images (tokenizer and pre-training stages): how many codes of the
# vocabulary occur, and the perplexity (exp of the entropy) of their histogram
CODES_USED, CODE_PERPLEXITY = "codes_used", "code_perplexity"


class SslFlTrainer(LocalTrainer):
    """What Fed-MAE and Fed-BEiT sites share: stage switching, the data each stage learns from, fine-tuning.
    Pre-training stages train on all local images (labels ignored); fine-tuning on the labelled images only, with
    label smoothing and, when configured, Mixup/CutMix."""

    uses_unlabelled_samples = True  # pre-training batches need no label

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from timm.loss import SoftTargetCrossEntropy  # timm (with torchvision) is slow to import: only when used

        super().__init__(*args, **kwargs)
        labels = np.asarray(self.data.train.labels)
        self.pretrain_images = self.augmented(self.cfg.pretrain_augment)
        self.labelled = Subset(self.augmented(self.cfg.finetune_augment), np.flatnonzero(labels >= 0).tolist())
        self.mixup = _mixup(self.cfg, int(self.data.num_classes))
        self.soft_target_loss = SoftTargetCrossEntropy()
        self.rng = np.random.default_rng(int(torch.randint(2**31 - 1, ()).item()))  # seeded by the site runtime
        if self.mixup is not None:  # timm's Mixup draws from numpy's global generator: seed it from the site's seed
            np.random.seed(int(torch.randint(2**31 - 1, ()).item()))

    # ----- stages ---------------------------------------------------------------------------------
    def on_stage_start(self, ctx: RoundContext) -> None:
        self.enter_stage(ctx.stage)

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("stage"):
            self.enter_stage(state["stage"])  # the restored optimizer covers the parameters that stage trains
        super().load_state(state)

    def enter_stage(self, stage: str) -> None:
        """Freeze what ``stage`` does not train and set its stochastic depth."""
        self.model.train_only(stage)
        rate = self.cfg.drop_path if stage == FINETUNE else self.cfg.pretrain_drop_path
        set_drop_path(self.model.backbone, rate)

    def augmented(self, augment: str) -> ImageDataset:
        """The site's training images (same order and labels as ``data.train``) under one stage's augmentation."""
        data = self.data
        return ImageDataset(data.train.images, build_transform(data.channels, data.image_size, True, augment))

    def train_dataset(self) -> Any:
        return self.labelled if self.stage == FINETUNE else self.pretrain_images

    # ----- losses ---------------------------------------------------------------------------------
    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.finetune_loss(images, labels) if self.stage == FINETUNE else self.pretext_loss(images)

    def pretext_loss(self, images: torch.Tensor) -> torch.Tensor:
        """The masked-image-modelling loss of one batch (method-specific)."""
        raise NotImplementedError

    def finetune_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy with label smoothing; with Mixup/CutMix, soft-target cross-entropy on mixed pairs (the batch
        paired with its reverse, so an odd last sample is left out of a mixed batch)."""
        even = len(images) - len(images) % 2
        if self.mixup is None or even < 2:
            return F.cross_entropy(self.model(images), labels, label_smoothing=self.cfg.label_smoothing)
        mixed, targets = self.mixup(images[:even], labels[:even])
        return self.soft_target_loss(self.model(mixed), targets)

    def round_meta(self, ctx: RoundContext) -> dict[str, Any]:
        return {N_IMAGES: len(self.data.train)}


def _mixup(cfg: Any, num_classes: int) -> Mixup | None:
    """timm's batch-wise Mixup/CutMix with label smoothing, or None when both are off."""
    from timm.data import Mixup

    if cfg.mixup <= 0 and cfg.cutmix <= 0:
        return None
    return Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, switch_prob=cfg.mixup_switch_prob, mode="batch",
                 label_smoothing=cfg.label_smoothing, num_classes=num_classes)


class FedMaeTrainer(SslFlTrainer):
    """Fed-MAE: reconstruct the pixels of randomly masked patches."""

    def pretext_loss(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.pretext_loss(images)


class FedBeitTrainer(SslFlTrainer):
    """Fed-BEiT: train the federated tokenizer (its own stage), then predict the visual tokens of block-masked patches.
    With ``tokenizer=dall-e:PATH`` the frozen DALL-E encoder lives here, never in the model, so it never travels."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        grid = self.model.grid
        self.masks = BlockMaskGenerator(grid, beit_mask_count(grid * grid, self.cfg.mask_ratio), self.cfg.block_min_patches)
        path = self.cfg.dalle_path
        self.dalle = DalleTokenizer(path, grid).to(self.device) if path else None
        self.code_counts = torch.zeros(self.cfg.vocab_size, dtype=torch.int64)  # this round's visual tokens
        if self.dalle is not None and self.dalle.vocab != self.cfg.vocab_size:
            raise ConfigError(f"the DALL-E encoder {path} has {self.dalle.vocab} codes; set method.vocab_size="
                              f"{self.dalle.vocab}")

    def on_round_start(self, ctx: RoundContext) -> None:
        self.code_counts = torch.zeros(self.cfg.vocab_size, dtype=torch.int64)
        if ctx.stage == TOKENIZER:
            self.model.tokenizer.temperature = self.cfg.temperature(ctx.stage_round, ctx.stage_rounds)

    def count_codes(self, codes: torch.Tensor) -> None:
        """Add a batch's token ids to the round's code histogram (reported in :meth:`round_meta`)."""
        self.code_counts += torch.bincount(codes.flatten().cpu(), minlength=self.cfg.vocab_size)

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.stage == TOKENIZER:
            loss, codes = self.model.tokenizer.loss_and_codes(images, self.cfg.dvae_kl_weight, self.cfg.dvae_usage_weight)
            self.count_codes(codes)
            return loss
        return super().compute_loss(images, labels)

    def pretext_loss(self, images: torch.Tensor) -> torch.Tensor:
        tokenizer = self.dalle if self.dalle is not None else self.model.tokenizer
        masked = self.masks.batch(len(images), self.rng).to(self.device)
        tokens = tokenizer.tokens(images)
        self.count_codes(tokens)
        return self.model.pretext_loss(images, tokens, masked)

    def round_meta(self, ctx: RoundContext) -> dict[str, Any]:
        """Also the code statistics of the round's visual tokens: in the tokenizer stage those of the dVAE being
        trained, in pre-training the targets of the frozen final tokenizer (the server checks the floor)."""
        meta = super().round_meta(ctx)
        if ctx.stage in UNLABELLED_STAGES and self.code_counts.sum() > 0:
            used, perplexity = code_usage(self.code_counts)
            meta.update({CODES_USED: used, CODE_PERPLEXITY: perplexity})
        return meta
