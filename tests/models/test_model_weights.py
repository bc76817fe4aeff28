"""Loading weights: local files in several layouts, and the offline ImageNet EfficientNet-Lite0."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import timm
import torch

from medflare.errors import ConfigError, DataError
from medflare.models import (
    create_model,
    get_model_info,
    imagenet_lite0_weights_path,
    load_imagenet_lite0_state_dict,
    load_weights,
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    state_b = b.state_dict()
    for key, value in a.state_dict().items():
        torch.testing.assert_close(value, state_b[key], msg=key)


# ----- local files ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "wrap",
    [
        lambda sd: sd,
        lambda sd: {"model": sd, "epoch": 3},
        lambda sd: {"state_dict": {f"module.{k}": v for k, v in sd.items()}},
    ],
    ids=["state_dict", "checkpoint_model", "checkpoint_state_dict_dataparallel"],
)
@pytest.mark.parametrize("name", ["cnn", "vit_tiny"])
def test_local_file_round_trip(tmp_path: Path, name: str, wrap) -> None:
    saved = create_model(name, 4, in_channels=1)
    path = tmp_path / "weights.pt"
    torch.save(wrap(saved.state_dict()), path)
    loaded = create_model(name, 4, in_channels=1, pretrained=str(path))
    _assert_same_state(saved, loaded)


def test_bare_backbone_file_loads_backbone_and_reports_head(tmp_path: Path) -> None:
    saved = create_model("cnn", 4)
    path = tmp_path / "backbone.pth"
    torch.save(saved.backbone.state_dict(), path)
    target = create_model("cnn", 4)
    report = load_weights(target, path)
    _assert_same_state(saved.backbone, target.backbone)
    assert sorted(report.missing) == ["head.bias", "head.weight"] and not report.unexpected


def test_other_head_width_keeps_backbone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved = create_model("cnn", 4)
    path = tmp_path / "four_classes.pt"
    torch.save(saved.state_dict(), path)
    target = create_model("cnn", 9)
    with caplog.at_level(logging.WARNING, logger="medflare.models.weights"):
        report = load_weights(target, path)
    _assert_same_state(saved.backbone, target.backbone)
    assert {entry.split(":")[0] for entry in report.shape_mismatched} == {"head.weight", "head.bias"}
    assert "shape mismatch" in caplog.text


def test_rgb_file_adapts_to_greyscale_model(tmp_path: Path) -> None:
    rgb = create_model("cnn", 4, in_channels=3)
    path = tmp_path / "rgb.pt"
    torch.save(rgb.state_dict(), path)
    grey = create_model("cnn", 4, in_channels=1)
    report = load_weights(grey, path)
    assert report.adapted == ["backbone.0.0.weight"]
    torch.testing.assert_close(grey.backbone[0][0].weight, rgb.backbone[0][0].weight.sum(dim=1, keepdim=True))


def test_missing_file_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        create_model("cnn", 4, pretrained=str(tmp_path / "absent.pt"))


def test_weights_of_another_architecture_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "resnet.pt"
    torch.save(create_model("resnet18", 4).state_dict(), path)
    with pytest.raises(DataError, match="do not fit"):
        create_model("cnn", 4, pretrained=str(path))


def test_nan_weights_are_refused_as_pretrained_weights(tmp_path: Path) -> None:
    """Before: --pretrained loaded them, and training went on from NaN without a word."""
    state = create_model("cnn", 4).state_dict()
    key = next(k for k, v in state.items() if v.is_floating_point())
    state[key].view(-1)[0] = float("nan")
    path = tmp_path / "nan.pt"
    torch.save(state, path)
    with pytest.raises(DataError) as error:
        create_model("cnn", 4, pretrained=str(path))
    assert str(path) in str(error.value) and f"'{key}'" in str(error.value) and "NaN" in str(error.value)


def test_a_pickled_weights_file_is_named_as_such_never_how_to_unpickle_it(tmp_path: Path) -> None:
    path = tmp_path / "whole.pt"
    torch.save(create_model("cnn", 4), path)  # the whole module, pickled
    with pytest.raises(DataError) as error:
        create_model("cnn", 4, pretrained=str(path))
    text = str(error.value)
    assert "pickled" in text and "can run code" in text and "weights_only" not in text and "\n" not in text


def test_file_without_tensors_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "meta.pt"
    torch.save({"epoch": 3}, path)
    with pytest.raises(DataError, match="not tensors"):
        create_model("cnn", 4, pretrained=str(path))


# ----- offline ImageNet EfficientNet-Lite0 -------------------------------------------------------------------------
def test_lite0_file_maps_one_to_one_onto_timm() -> None:
    source = torch.load(imagenet_lite0_weights_path(), map_location="cpu", weights_only=True)
    mapped = load_imagenet_lite0_state_dict()
    reference = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    assert len(mapped) == len(source) == 296
    assert set(mapped) == set(reference.state_dict())
    result = reference.load_state_dict(mapped, strict=True)
    assert not result.missing_keys and not result.unexpected_keys


def test_lite0_imagenet_loads_every_key_into_classifier() -> None:
    model = create_model("efficientnet_lite0", 1000)
    report = load_weights(model, get_model_info("efficientnet_lite0").imagenet_weights())
    assert report.is_complete and len(report.loaded) == 296


def test_lite0_matches_reference_implementation() -> None:
    reference_package = pytest.importorskip("efficientnet_lite_pytorch")
    reference = reference_package.EfficientNet.from_name("efficientnet-lite0")
    reference.load_state_dict(torch.load(imagenet_lite0_weights_path(), weights_only=True), strict=True)
    model = create_model("efficientnet_lite0", 1000, pretrained="imagenet").eval()
    images = torch.randn(2, 3, 224, 224)  # the reference's static "same" padding is computed for 224 px
    with torch.no_grad():
        torch.testing.assert_close(model(images), reference.eval()(images), atol=1e-4, rtol=1e-4)


def test_lite0_imagenet_for_new_task_keeps_backbone_only() -> None:
    model = create_model("efficientnet_lite0", 5, pretrained="imagenet")
    mapped = load_imagenet_lite0_state_dict()
    torch.testing.assert_close(model.backbone.conv_stem.weight, mapped["conv_stem.weight"])
    assert model.head.weight.shape == (5, 1280)


def test_lite0_imagenet_greyscale_equals_rgb_on_grey_images() -> None:
    rgb = create_model("efficientnet_lite0", 5, in_channels=3, pretrained="imagenet").eval()
    grey = create_model("efficientnet_lite0", 5, in_channels=1, pretrained="imagenet").eval()
    images = torch.rand(2, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            grey.forward_features(images), rgb.forward_features(images.repeat(1, 3, 1, 1)), atol=1e-4, rtol=1e-4
        )


def test_lite0_imagenet_with_four_channels() -> None:
    model = create_model("efficientnet_lite0", 5, in_channels=4, pretrained="imagenet")
    assert model(torch.rand(2, 4, 28, 28)).shape == (2, 5)


def test_imagenet_without_offline_weights_suggests_a_file() -> None:
    with pytest.raises(ConfigError, match="local weights file"):
        create_model("resnet18", 5, pretrained="imagenet")
