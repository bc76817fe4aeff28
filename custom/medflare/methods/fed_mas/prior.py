"""The frozen self-supervised prior f_ξ: identical at every site, never trained, never sent, always in eval mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from medflare.errors import ConfigError, DataError

IMAGENET_LITE0 = "imagenet-lite0"
MOCO_PREFIX = "module.encoder_q."
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# medflare's transforms map pixels to [-1, 1] (mean 0.5, std 0.5 per channel); priors expect their own scaling.
DATA_MEAN, DATA_STD = 0.5, 0.5


class FrozenPrior(nn.Module):
    """Wraps an encoder ([B, 3, S, S] images, normalised by its own ``mean``/``std``, to [B, D]) into the teacher:
    resizes the input to ``input_size``, returns pooled features, never trains. The authors' code computed the first
    global divergence with the teacher still in train mode, so its BatchNorm statistics drifted to each site's data
    and the "shared" teacher became site-specific (spec §2(e)5); here ``train()`` is a no-op."""

    def __init__(self, encoder: nn.Module, feature_dim: int, input_size: int, mean, std) -> None:
        super().__init__()
        self.encoder, self.feature_dim, self.input_size = encoder, feature_dim, input_size
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)
        for parameter in self.encoder.parameters():
            parameter.requires_grad_(False)
        super().train(False)

    def train(self, mode: bool = True) -> "FrozenPrior":
        """Ignored: the prior is always in eval mode."""
        return super().train(False)

    def force_train_mode_for_repo_compat(self) -> None:
        """Reproduce the authors' round-0 bug (BN in train mode for one pass); only for ``repo_compat_teacher_bn``."""
        nn.Module.train(self.encoder, True)

    def restore_eval_mode(self) -> None:
        nn.Module.train(self.encoder, False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pixels = images * DATA_STD + DATA_MEAN  # back to [0, 1]
        if pixels.shape[1] == 1:
            pixels = pixels.expand(-1, 3, -1, -1)
        elif pixels.shape[1] != 3:
            raise DataError(f"the prior takes 1- or 3-channel images, got {pixels.shape[1]} channels")
        if pixels.shape[-1] != self.input_size or pixels.shape[-2] != self.input_size:
            pixels = F.interpolate(pixels, size=(self.input_size, self.input_size), mode="bilinear", align_corners=False)
        return self.encoder((pixels - self.mean) / self.std).float()


class PriorFeatureCache:
    """The prior's features per distinct input image, computed once by ``compute`` (``cache_prior_features``). Keyed by
    the image's bytes as the model sees it, so a cached feature is only ever reused for the identical input: exact by
    construction, whatever the batch. It pays off when every image has few views (no training augmentation, or a flip
    only: at most two entries per image); :func:`check_finite_views` refuses the rest. A feature may differ from a fresh
    forward of another batch in the last float bits (the kernels depend on the batch size and thread count, measured up
    to 2.3e-5); the tests bound that at 1e-4."""

    def __init__(self, compute: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.compute = compute
        self.features: dict[bytes, torch.Tensor] = {}
        self.hits = self.misses = 0

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        keys = [row.tobytes() for row in images.detach().cpu().numpy()]
        missing = sorted({keys.index(key) for key in keys if key not in self.features})
        if missing:
            for index, feature in zip(missing, self.compute(images[missing]).detach().cpu()):
                self.features[keys[index]] = feature.clone()
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        return torch.stack([self.features[key] for key in keys]).to(images.device)


def check_finite_views(dataset: Any, samples: int = 8, draws: int = 6) -> None:
    """Refuse (ConfigError) a training set whose augmentation draws a new image every time (a feature cache would
    never hit): more than two distinct views of one image in a few draws (the random state is restored after) means
    continuous augmentation (affine, jitter, blur); none or a horizontal flip give one or two."""
    with torch.random.fork_rng(devices=[]):
        for index in range(min(samples, len(dataset))):
            views = {dataset[index][0].numpy().tobytes() for _ in range(draws)}
            if len(views) > 2:
                raise ConfigError("fedmas method.cache_prior_features=true needs training images with a fixed set of "
                                  f"views, but this site's augmentation drew {len(views)} different images from one in "
                                  f"{draws} draws; set data.augment=none (or weak, a flip only), or turn the cache off")


def prior_feature_dim(prior: str, declared_dim: int) -> int:
    """D for a prior spec, known without loading any weights (the server needs it to build the projector)."""
    if prior == IMAGENET_LITE0:
        return 1280
    if prior.startswith("moco:"):
        return 2048
    if prior.startswith(("torchscript:", "state_dict:", "fed-mae:")):
        if declared_dim <= 0:
            raise ConfigError(f"prior '{prior}' needs method.prior_dim (its feature dimension)")
        return declared_dim
    raise ConfigError(f"unknown prior '{prior}'; use '{IMAGENET_LITE0}', 'moco:PATH', 'torchscript:PATH' or "
                      "'state_dict:PATH' (a medflare model checkpoint; set method.prior_model and method.prior_dim) or "
                      "'fed-mae:PATH' (an SSL-FL encoder file; set method.prior_dim)")


def build_prior(prior: str, declared_dim: int, input_size: int, prior_model: str = "resnet50") -> FrozenPrior:
    """Load the frozen prior from the installed wheel or a local file (nothing is downloaded)."""
    dim = prior_feature_dim(prior, declared_dim)
    if prior == IMAGENET_LITE0:
        from medflare.models import IMAGENET_LITE0_MEAN, IMAGENET_LITE0_STD, create_model

        encoder = create_model("efficientnet_lite0", 1000, 3, pretrained="imagenet", image_size=input_size).backbone
        return FrozenPrior(encoder, dim, input_size, IMAGENET_LITE0_MEAN, IMAGENET_LITE0_STD)
    kind, _, path = prior.partition(":")
    file = _existing(path)
    if kind == "moco":
        return FrozenPrior(load_moco_resnet50(file), dim, input_size, IMAGENET_MEAN, IMAGENET_STD)
    if kind == "fed-mae":  # a federated MAE/BEiT encoder (methods/ssl_fl/export.py), used at its own input size
        from medflare.methods.ssl_fl.export import load_encoder

        encoder, info = load_encoder(file)
        if info.num_features != dim:
            raise ConfigError(f"prior '{prior}' has {info.num_features} features; set method.prior_dim={info.num_features}")
        return FrozenPrior(encoder, dim, info.image_size, (DATA_MEAN,) * 3, (DATA_STD,) * 3)
    if kind == "torchscript":
        return FrozenPrior(torch.jit.load(str(file), map_location="cpu"), dim, input_size, IMAGENET_MEAN, IMAGENET_STD)
    from medflare.models import create_model, load_weights

    classifier = create_model(prior_model, 1, 3, image_size=input_size)
    load_weights(classifier, str(file))
    return FrozenPrior(classifier.backbone, dim, input_size, (DATA_MEAN,) * 3, (DATA_STD,) * 3)


def load_moco_resnet50(path: Path) -> nn.Module:
    """ResNet-50 from an official MoCo v2 checkpoint (``module.encoder_q.*``), head removed: 2048-d pooled features."""
    import torchvision

    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise DataError(f"{path} is not a MoCo checkpoint (no state_dict)")
    backbone = {k.removeprefix(MOCO_PREFIX): v for k, v in state.items() if k.startswith(MOCO_PREFIX) and ".fc." not in k}
    if not backbone:
        raise DataError(f"{path} has no '{MOCO_PREFIX}*' keys: not an official MoCo v2 checkpoint")
    network = torchvision.models.resnet50(weights=None)
    network.fc = nn.Identity()
    missing, unexpected = network.load_state_dict(backbone, strict=False)
    if missing or unexpected:
        raise DataError(f"{path}: MoCo weights do not fit ResNet-50 (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return network


def _existing(path: str) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"prior weights file not found: {file}. Every site must hold the same file at this path")
    return file
