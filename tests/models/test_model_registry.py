"""Every registered model, through the registry: no per-model test code (timm's tests/test_models.py pattern)."""

from __future__ import annotations

import pytest
import torch
import torchvision

from medflare.errors import ConfigError
from medflare.models import (
    Classifier,
    CosineLinear,
    create_model,
    get_device,
    get_model_info,
    is_model,
    list_models,
    place_model,
    register_model,
)
from medflare.models.vit import VIT_SIZES, vit_patch_size

NUM_CLASSES = 7
EXPECTED_MODELS = {
    "cnn",
    "resnet10",
    "resnet12",
    "resnet18",
    "resnet50",
    "efficientnet_b0",
    "efficientnet_lite0",
    "mobilenet_v2",
    "shufflenet",
    "densenet121",
    "vit_tiny",
    "vit_small",
    "vit_base",
}
#: Same code as vit_tiny, only wider (seconds per test on CPU): they run with the slow tests.
WIDE_MODELS = {"vit_small", "vit_base"}


def _all_models() -> list:
    return [pytest.param(name, marks=[pytest.mark.slow, pytest.mark.heavy]) if name in WIDE_MODELS else name for name in list_models()]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_expected_models_are_registered() -> None:
    assert EXPECTED_MODELS <= set(list_models())
    assert list_models("resnet*") == ["resnet10", "resnet12", "resnet18", "resnet50"]
    assert is_model("cnn") and not is_model("resnet19")


@pytest.mark.parametrize("in_channels", [1, 3])
@pytest.mark.parametrize("name", _all_models())
def test_forward_small_input(name: str, in_channels: int) -> None:
    model = create_model(name, NUM_CLASSES, in_channels).eval()
    images = torch.randn(2, in_channels, 28, 28)
    with torch.no_grad():
        features = model.forward_features(images)
        logits = model(images)
    assert isinstance(model, Classifier)
    assert features.shape == (2, model.num_features)
    assert logits.shape == (2, NUM_CLASSES) and model.num_classes == NUM_CLASSES
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(model.forward_head(features), logits)


@pytest.mark.parametrize("name", _all_models())
def test_backward_reaches_every_parameter(name: str) -> None:
    model = create_model(name, NUM_CLASSES, in_channels=1).train()
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    without_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert not without_grad
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", _all_models())
def test_state_dict_is_backbone_and_head(name: str) -> None:
    model = create_model(name, NUM_CLASSES)
    keys = list(model.state_dict())
    assert all(k.startswith(("backbone.", "head.")) for k in keys)
    assert model.head.weight.shape == (NUM_CLASSES, model.num_features)


def test_reset_classifier_replaces_head_only() -> None:
    model = create_model("cnn", NUM_CLASSES).eval()
    backbone_before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    model.reset_classifier(3)
    assert model.num_classes == 3 and model(torch.randn(2, 3, 28, 28)).shape == (2, 3)
    for key, value in model.backbone.state_dict().items():
        torch.testing.assert_close(value, backbone_before[key])


def test_classifier_composes_with_sibling_modules() -> None:
    class WithPersonalHead(Classifier):
        def __init__(self, base: Classifier) -> None:
            super().__init__(base.backbone, base.head)
            self.personal_head = torch.nn.Linear(base.num_features, base.num_classes)

    model = WithPersonalHead(create_model("cnn", NUM_CLASSES))
    prefixes = {k.split(".")[0] for k in model.state_dict()}
    assert prefixes == {"backbone", "head", "personal_head"}


def test_cosine_head_gives_bounded_logits() -> None:
    model = create_model("cnn", NUM_CLASSES)
    model.head = CosineLinear(model.num_features, NUM_CLASSES)
    logits = model(torch.randn(4, 3, 28, 28))
    assert logits.abs().max() <= 1.0 + 1e-6 and list(model.state_dict()).count("head.weight") == 1


def test_unknown_model_lists_registered_names() -> None:
    with pytest.raises(ConfigError, match="resnet18"):
        create_model("resnet19", NUM_CLASSES)


def test_duplicate_registration_is_rejected() -> None:
    with pytest.raises(ConfigError, match="twice"):
        register_model("cnn")(get_model_info("cnn").entrypoint)


@pytest.mark.parametrize("name", sorted(EXPECTED_MODELS - {"efficientnet_lite0"} - WIDE_MODELS))
def test_imagenet_only_for_lite0(name: str) -> None:
    with pytest.raises(ConfigError, match="efficientnet_lite0"):
        create_model(name, NUM_CLASSES, pretrained="imagenet")


@pytest.mark.parametrize("bad", [{"num_classes": 0}, {"in_channels": 0}, {"image_size": -1}])
def test_non_positive_sizes_are_rejected(bad: dict[str, int]) -> None:
    args = {"num_classes": NUM_CLASSES, "in_channels": 3, "image_size": 28} | bad
    with pytest.raises(ConfigError):
        create_model("cnn", args.pop("num_classes"), **args)


@pytest.mark.parametrize(("image_size", "patch"), [(28, 4), (32, 4), (64, 8), (224, 16)])
def test_vit_patch_size_follows_image_size(image_size: int, patch: int) -> None:
    assert vit_patch_size(image_size) == patch


def test_vit_rejects_unfit_image_size() -> None:
    with pytest.raises(ConfigError, match="patch"):
        create_model("vit_tiny", NUM_CLASSES, image_size=27)


@pytest.mark.parametrize("name", ["resnet10", "resnet12", "shufflenet", "mobilenet_v2"])
@pytest.mark.parametrize("image_size", [28, 64])
def test_mdhfl_architectures_run_at_28_and_64_px(name: str, image_size: int) -> None:
    """MDH-FL's four heterogeneous networks pool adaptively, so any of its input sizes reaches the head."""
    model = create_model(name, NUM_CLASSES, in_channels=3, image_size=image_size).eval()
    with torch.no_grad():
        logits = model(torch.randn(2, 3, image_size, image_size))
    assert logits.shape == (2, NUM_CLASSES) and torch.isfinite(logits).all()


@pytest.mark.parametrize(("name", "blocks"), [("resnet10", [1, 1, 1, 1]), ("resnet12", [2, 1, 1, 1])])
def test_cifar_resnets_have_the_mdhfl_layout(name: str, blocks: list[int]) -> None:
    """BasicBlocks per stage as named, a 3x3 stride-1 stem without max-pool, 4x4 pooled 512-channel features."""
    model = create_model(name, NUM_CLASSES, in_channels=1)
    net = model.backbone
    stages = [net.layer1, net.layer2, net.layer3, net.layer4]
    assert [len(stage) for stage in stages] == blocks
    assert all(isinstance(b, torchvision.models.resnet.BasicBlock) for stage in stages for b in stage)
    assert (net.conv1.in_channels, net.conv1.kernel_size, net.conv1.stride) == (1, (3, 3), (1, 1))
    assert isinstance(net.maxpool, torch.nn.Identity)
    assert model.num_features == 512 * 4 * 4


@pytest.mark.parametrize(("image_size", "tokens"), [(28, 49), (64, 64)])
def test_vit_pools_the_mean_patch_token_through_fc_norm(image_size: int, tokens: int) -> None:
    """Features = fc_norm(mean of the patch tokens), the class token left out (MAE/BEiT fine-tuning)."""
    model = create_model("vit_tiny", NUM_CLASSES, in_channels=3, image_size=image_size).eval()
    images = torch.randn(2, 3, image_size, image_size)
    with torch.no_grad():
        all_tokens = model.backbone.forward_features(images)  # [B, 1 + patches, D], class token first
        expected = model.backbone.fc_norm(all_tokens[:, 1:].mean(dim=1))
        features = model.forward_features(images)
    assert all_tokens.shape[1] == 1 + tokens
    torch.testing.assert_close(features, expected)
    assert not isinstance(model.backbone.fc_norm, torch.nn.Identity)


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
@pytest.mark.parametrize(("name", "image_size", "patch"), [("vit_small", 64, 8), ("vit_base", 224, 16)])
def test_wide_vits_have_their_standard_sizes(name: str, image_size: int, patch: int) -> None:
    """vit_small and vit_base come from the same builder with the ViT/DeiT widths; ViT-B/16 at 224 px."""
    model = create_model(name, NUM_CLASSES, image_size=image_size).eval()
    width, depth, heads = VIT_SIZES[name.removeprefix("vit_")]
    assert model.num_features == width and len(model.backbone.blocks) == depth
    assert model.backbone.blocks[0].attn.num_heads == heads
    assert model.backbone.patch_embed.patch_size == (patch, patch)
    with torch.no_grad():
        assert model(torch.randn(1, 3, image_size, image_size)).shape == (1, NUM_CLASSES)


def test_densenet_matches_torchvision_on_even_feature_maps() -> None:
    model = create_model("densenet121", NUM_CLASSES).eval()
    reference = torchvision.models.densenet121(weights=None).eval()
    reference.classifier = torch.nn.Identity()
    reference.load_state_dict({k.removeprefix("backbone."): v for k, v in model.backbone.state_dict().items()})
    images = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(images), reference(images))


def test_get_device() -> None:
    device = get_device()
    assert isinstance(device, torch.device) and device.type in {"cpu", "cuda"}


def _conv_weight(model: torch.nn.Module) -> torch.Tensor:
    return next(m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d))


def test_place_model_keeps_the_cpu_layout() -> None:
    """channels_last only pays on CUDA under autocast; on the CPU the layout stays as built."""
    model = place_model(create_model("resnet18", NUM_CLASSES, 3, image_size=28), "cpu")
    assert _conv_weight(model).device.type == "cpu" and _conv_weight(model).is_contiguous()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_place_model_puts_cuda_models_in_channels_last() -> None:
    weight = _conv_weight(place_model(create_model("resnet18", NUM_CLASSES, 3, image_size=28), "cuda"))
    assert weight.is_cuda and weight.is_contiguous(memory_format=torch.channels_last)


def test_vit_size_names_and_layer_scale() -> None:
    """vit_micro is the CPU benchmark size; layer scale (BEiT) adds per-block scales initialised to its value."""
    from medflare.models.vit import build_vit, vit_size

    assert vit_size("vit_micro") == "micro" and VIT_SIZES["micro"] == (96, 6, 3)
    with pytest.raises(ConfigError, match="'cnn' is not a ViT"):
        vit_size("cnn")
    scaled = build_vit("micro", num_classes=2, in_channels=1, image_size=28, layer_scale=0.1)
    assert torch.all(scaled.backbone.blocks[0].ls1.gamma == 0.1)
    assert not any(".ls1." in name for name, _ in create_model("vit_micro", 2, image_size=28).named_parameters())
