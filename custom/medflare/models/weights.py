"""Loading weights into a model: local files or in-memory state dicts, with a report of what matched.

No function here downloads anything: weights come from a local file or from a locally installed package.
"""

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
    """What happened to each key when weights were loaded.

    Attributes:
        source: where the weights came from (a path or a description).
        loaded: model keys that received a tensor from the source.
        missing: model keys the source did not provide; they keep their initialisation.
        unexpected: source keys the model does not have; they are ignored.
        shape_mismatched: ``"key: source shape vs model shape"`` for keys present in both with different shapes;
            they keep their initialisation.
        adapted: keys loaded after adapting the input convolution to the model's input channels.
    """

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
    """Read a state dict from a local file, unwrapping a checkpoint and a DataParallel ``module.`` prefix.

    The file is read with ``torch.load(weights_only=True)`` on the CPU, so it cannot execute code.

    Args:
        path: a ``.pt``/``.pth`` file holding a state dict, or a checkpoint dict with the state dict under
            ``"model"`` or ``"state_dict"``.

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
    """Load weights into a Classifier-layout model and report what matched.

    Accepted layouts: a Classifier state dict (``backbone.*``, ``head.*``, and any sibling modules), or a bare
    backbone state dict in the underlying library's own layout (e.g. a torchvision ``resnet18`` file), whose
    keys are then prefixed with ``backbone.``; the library's own classifier keys (``fc.*``) are then reported
    as unexpected and the head keeps its initialisation.

    Keys outside ``backbone.*`` (the head, projectors) may be missing or have another shape, e.g. when the
    number of classes differs: they keep their initialisation and are reported. When the source's input
    convolution has 3 channels and the model another number, the weights are adapted with timm's
    ``adapt_input_conv``: for 1 channel the RGB kernels are summed (a grey image copied to RGB gives the same
    response); for other counts the RGB kernels are tiled and scaled by 3 / in_channels so activations keep
    their magnitude.

    Args:
        model: the model to load into (modified in place).
        weights: a local file path or an in-memory state dict.
        source: description for the report and log; defaults to the path.

    Returns:
        The report, also logged (at WARNING level when it is not complete).

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
