"""The pre-trained SSL-FL encoder as a file: a documented format that Fed-MAS loads as its frozen prior
(``method.prior=fed-mae:PATH``) and any ``vit_*`` job loads as ``--pretrained PATH``.

Format (``torch.save`` of a dict, readable with ``torch.load(..., weights_only=True)``):

    {"format": "medflare.ssl_fl.encoder/2",
     "method": "fed-mae",                # the method that pre-trained it
     "model": "vit_tiny",                # medflare model name (ViT size)
     "in_channels": 1, "image_size": 28, "patch_size": 4,
     "num_features": 192,                # width of the pooled features
     "layer_scale": False,               # whether blocks carry layer-scale parameters (Fed-BEiT)
     "state_dict": {"backbone.<name>": tensor, ...},   # the encoder only: no decoder, lm_head or head
     "encoder_norm": {"weight": tensor, "bias": tensor}}  # the encoder's final LayerNorm as pre-training trained it

The features are the mean over patch tokens of that trained final norm (MAE's ``decoder.encoder_norm``, BEiT's
``lm_head.norm``): what the pre-training head saw. ``backbone.fc_norm`` (never trained in pre-training) stays in
``state_dict`` for ``--pretrained`` only. Format ``/1`` pooled through that untrained norm and is refused.
Usage on a finished pre-training-only run (``method.finetune_rounds=0``)::

    python -m medflare.methods.ssl_fl.export RUN_DIR [-o RUN_DIR/encoder.pt]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from medflare.errors import ConfigError, DataError
from medflare.models.vit import VitClassifier, build_vit, vit_size

ENCODER_FORMAT = "medflare.ssl_fl.encoder/2"
OLD_FORMATS = ("medflare.ssl_fl.encoder/1",)
LN_EPS = 1e-6  # the ViT's LayerNorm epsilon (model.LN_EPS)
ENCODER_PREFIX = "backbone."
DEFAULT_FILE = "encoder.pt"


@dataclass(frozen=True)
class EncoderInfo:
    """What an encoder file says about its network (everything needed to rebuild it)."""

    method: str
    model: str
    in_channels: int
    image_size: int
    patch_size: int
    num_features: int
    layer_scale: bool


def save_encoder(network: VitClassifier, path: str | Path, method: str, model: str) -> Path:
    """Write ``network``'s encoder (``backbone.*``) and its trained final norm in the documented format."""
    if not hasattr(network, "encoder_norm"):
        raise ConfigError(f"{type(network).__name__} is not an SSL-FL network: it has no pre-trained encoder norm")
    vit = network.backbone
    info = EncoderInfo(method=method, model=model, in_channels=int(vit.patch_embed.proj.in_channels),
                       image_size=int(vit.patch_embed.img_size[0]), patch_size=int(vit.patch_embed.patch_size[0]),
                       num_features=int(vit.embed_dim),
                       layer_scale=any(".ls1." in name for name, _ in vit.named_parameters()))
    state = {k: v.detach().cpu().clone() for k, v in network.state_dict().items() if k.startswith(ENCODER_PREFIX)}
    norm = {k: v.detach().cpu().clone() for k, v in network.encoder_norm().state_dict().items()}
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": ENCODER_FORMAT, **info.__dict__, "state_dict": state, "encoder_norm": norm}, file)
    return file


class EncoderFeatures(nn.Module):
    """A loaded encoder as a feature extractor: ``[B, C, S, S]`` medflare-normalised images -> ``[B, D]``, the
    mean over the patch tokens of the trained final norm. A 1-channel encoder takes the first channel of 3-channel
    input (Fed-MAS's prior copies grey images to RGB)."""

    def __init__(self, network: VitClassifier, info: EncoderInfo) -> None:
        super().__init__()
        self.network = network
        self.in_channels = info.in_channels

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[1] != self.in_channels and self.in_channels == 1:
            images = images[:, :1]
        return self.network.forward_features(images)


def load_encoder(path: str | Path) -> tuple[EncoderFeatures, EncoderInfo]:
    """Rebuild the encoder of a file in :data:`ENCODER_FORMAT` (DataError: missing, another format, or unfit)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"encoder file not found: {file}. Every site must hold the same file at this path")
    try:
        content = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types for unreadable files
        raise DataError(f"cannot read encoder file {file}: {exc}") from exc
    if isinstance(content, dict) and content.get("format") in OLD_FORMATS:
        raise DataError(
            f"{file} is an SSL-FL encoder file of format '{content['format']}', which dropped the trained encoder "
            "norm; export it again from its run with `python -m medflare.methods.ssl_fl.export RUN_DIR`"
        )
    if not isinstance(content, dict) or content.get("format") != ENCODER_FORMAT:
        raise DataError(
            f"{file} is not an SSL-FL encoder file (format '{ENCODER_FORMAT}'); write one with "
            "`python -m medflare.methods.ssl_fl.export RUN_DIR` from a pre-training run"
        )
    info = EncoderInfo(**{k: content[k] for k in EncoderInfo.__dataclass_fields__})
    network = build_vit(
        vit_size(info.model), num_classes=1, in_channels=info.in_channels, image_size=info.image_size,
        patch_size=info.patch_size, layer_scale=1.0 if info.layer_scale else None,
    )
    encoder_keys = {k for k in network.state_dict() if k.startswith(ENCODER_PREFIX)}
    state = content["state_dict"]
    if set(state) != encoder_keys:
        raise DataError(f"{file}: encoder keys do not fit {info.model} (differing: {sorted(set(state) ^ encoder_keys)[:3]})")
    vit = network.backbone
    vit.norm, vit.fc_norm = nn.LayerNorm(info.num_features, eps=LN_EPS), nn.Identity()  # pool the trained norm
    try:
        network.load_state_dict(state, strict=False)
        vit.norm.load_state_dict(content["encoder_norm"])
    except (RuntimeError, KeyError, TypeError) as exc:
        raise DataError(f"{file}: encoder weights do not fit {info.model}: {exc}") from exc
    return EncoderFeatures(network, info).eval(), info


def export_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the encoder of a finished pre-training-only run (its ``FL_global_model.pt``) to ``out``; a run that
    ended with fine-tuning no longer has the self-supervised encoder and is refused."""
    from medflare.methods.ssl_fl import FED_BEIT, FED_MAE

    run = Path(run_dir)
    config = json.loads((run / "summary.json").read_text())["config"]
    spec = {FED_MAE.name: FED_MAE, FED_BEIT.name: FED_BEIT}.get(config["method"])
    if spec is None:
        raise ConfigError(f"{run} is a '{config['method']}' run; only fed-mae and fed-beit runs have an SSL encoder")
    method_cfg = spec.config_cls(**config["method_args"])  # every argument, typed: the summary holds the job's plan's
    last = method_cfg.stage_plan(int(config["rounds"]))[-1].name
    if last != "pretrain":
        raise ConfigError(
            f"{run} ends with stage '{last}', so its encoder is fine-tuned; export from a pre-training-only run "
            "(--set method.finetune_rounds=0)"
        )
    network = spec.build_model(config["model"], config["task"]["num_classes"], config["task"]["in_channels"],
                               config["task"]["image_size"], None, method_cfg)
    return export_global_model(network, spec.name, config["model"], run / "FL_global_model.pt", out or run / DEFAULT_FILE)


def export_global_model(network: VitClassifier, method: str, model: str, model_file: str | Path,
                        out: str | Path) -> Path:
    """Write the encoder of a saved global model (FLARE's ``FL_global_model.pt``) into which ``network`` (built
    with the job's task and method configuration) loads."""
    from medflare.models import read_state_dict_file

    network.load_state_dict(read_state_dict_file(model_file))
    return save_encoder(network, out, method, model)


def main(argv: list[str] | None = None) -> Any:
    """``python -m medflare.methods.ssl_fl.export``: the pre-trained encoder of an SSL-FL run, as a file."""
    parser = argparse.ArgumentParser(description="Export the pre-trained encoder of an SSL-FL pre-training run.")
    parser.add_argument("run_dir", help="the run folder of a fed-mae/fed-beit job with method.finetune_rounds=0")
    parser.add_argument("-o", "--out", help=f"output file (default RUN_DIR/{DEFAULT_FILE})")
    args = parser.parse_args(argv)
    print(export_run(args.run_dir, args.out))


if __name__ == "__main__":
    main()
