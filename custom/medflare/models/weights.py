"""Loading weights into a model from a local file or an in-memory state dict (never a download), with a report
of what matched."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from medflare.errors import DataError
from medflare.readback import check_finite, load_torch_weights

__all__ = ["WeightsReport", "load_weights", "read_state_dict_file"]

logger = logging.getLogger(__name__)

_CHECKPOINT_STATE_KEYS = ("model", "state_dict")
_CLASSIFIER_PREFIXES = ("backbone.", "head.")
_REQUIRED_PREFIX = "backbone."
# BatchNorm's step counter is absent from some older files and does not affect the forward pass.
_OPTIONAL_SUFFIX = "num_batches_tracked"
_MAX_KEYS_SHOWN = 8


@dataclass
class WeightsReport:
    """What happened to each key when weights were loaded: ``loaded``, ``missing`` (kept their initialisation),
    ``unexpected`` (ignored), ``shape_mismatched`` (``"key: source shape vs model shape"``, kept their
    initialisation) and ``adapted`` (the input convolution, to the model's input channels)."""

    source: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatched: list[str] = field(default_factory=list)
    adapted: list[str] = field(default_factory=list)

    @property
    def is_complete(self) -> bool:
        """True when every model key was loaded and every source key was used."""
        return not (self.missing or self.unexpected or self.shape_mismatched)

    def summary(self) -> str:
        """One human-readable paragraph listing the problem keys (abbreviated)."""
        parts = [f"loaded {len(self.loaded)} tensors from {self.source}"]
        for label, keys in (
            ("adapted input conv", self.adapted),
            ("missing (kept initialisation)", self.missing),
            ("unexpected (ignored)", self.unexpected),
            ("shape mismatch (kept initialisation)", self.shape_mismatched),
        ):
            if keys:
                shown = ", ".join(keys[:_MAX_KEYS_SHOWN]) + (" ..." if len(keys) > _MAX_KEYS_SHOWN else "")
                parts.append(f"{label}: {len(keys)} [{shown}]")
        return "; ".join(parts)


def read_state_dict_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a state dict from a local ``.pt``/``.pth`` file (``weights_only``: it cannot execute code), unwrapping
    a checkpoint (under ``"model"`` or ``"state_dict"``) and a DataParallel ``module.`` prefix.

    Raises:
        DataError: if the file does not exist, is pickled or unreadable, holds no state dict, or holds NaN or
            infinite weights.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"weights file not found: '{file}' (pass an existing local .pt/.pth file)")
    content = load_torch_weights(file, DataError, "weights file ")
    if isinstance(content, Mapping):
        for key in _CHECKPOINT_STATE_KEYS:
            if isinstance(content.get(key), Mapping):
                content = content[key]
                break
    if not isinstance(content, Mapping) or not content:
        raise DataError(f"'{file}' holds no state dict (expected a dict of tensors, or one under 'model'/'state_dict')")
    not_tensors = [str(k) for k, v in content.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise DataError(f"'{file}': state dict entries that are not tensors: {not_tensors[:_MAX_KEYS_SHOWN]}")
    state = {str(k): v for k, v in content.items()}
    check_finite(state, f"weights file {file}", DataError)  # a NaN warm start would train to NaN, silently
    if all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state


def load_weights(
    model: nn.Module,
    weights: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    *,
    source: str | None = None,
) -> WeightsReport:
    """Load weights (a file or a state dict) into a Classifier-layout model in place; return (and log) the report.

    A bare backbone state dict in its library's own layout (a torchvision ``resnet18`` file) is prefixed with
    ``backbone.`` (its ``fc.*`` then unexpected). Keys outside ``backbone.*`` may be missing or of another shape
    (another class count): they keep their initialisation. A 3-channel input convolution is adapted to the model's
    channels by timm's ``adapt_input_conv`` (1 channel: the RGB kernels summed).

    Raises:
        DataError: if the file is unusable, nothing matches, or a backbone tensor is missing or has another shape
            (the weights belong to another architecture or configuration).
    """
    if isinstance(weights, Mapping):
        state = dict(weights)
        source = source or "in-memory state dict"
    else:
        state = read_state_dict_file(weights)
        source = source or str(weights)
    if not any(k.startswith(_CLASSIFIER_PREFIXES) for k in state):
        state = {_REQUIRED_PREFIX + k: v for k, v in state.items()}

    target = model.state_dict()
    input_conv_key = _input_conv_weight_key(model)
    report = WeightsReport(source=source)
    to_load: dict[str, torch.Tensor] = {}
    mismatched: list[str] = []
    for key, tensor in state.items():
        if key not in target:
            report.unexpected.append(key)
        elif tensor.shape == target[key].shape:
            to_load[key] = tensor
        elif key == input_conv_key and _is_adaptable_input_conv(tensor, target[key]):
            from timm.models import adapt_input_conv  # here: timm is slow to import

            to_load[key] = adapt_input_conv(target[key].shape[1], tensor)
            report.adapted.append(key)
        else:
            mismatched.append(key)
            report.shape_mismatched.append(f"{key}: {tuple(tensor.shape)} vs {tuple(target[key].shape)}")
    report.loaded = list(to_load)
    report.missing = [k for k in target if k not in to_load and k not in mismatched]

    required_failures = [
        k for k in report.missing + mismatched if k.startswith(_REQUIRED_PREFIX) and not k.endswith(_OPTIONAL_SUFFIX)
    ]
    if not to_load or required_failures:
        raise DataError(
            f"weights from {source} do not fit this model ({type(model).__name__}); {report.summary()}. "
            "Check the model name, in_channels and that the file was saved from the same architecture."
        )
    model.load_state_dict(to_load, strict=False)
    logger.log(logging.INFO if report.is_complete else logging.WARNING, report.summary())
    return report


def _input_conv_weight_key(model: nn.Module) -> str | None:
    """State-dict key of the first Conv2d's weight, i.e. the stem that sees the image channels."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            return f"{name}.weight"
    return None


def _is_adaptable_input_conv(source: torch.Tensor, target: torch.Tensor) -> bool:
    """An RGB stem kernel that differs from the model's only in the number of input channels."""
    return (
        source.ndim == 4
        and source.shape[1] == 3
        and source.shape[0] == target.shape[0]
        and source.shape[2:] == target.shape[2:]
    )
