"""Models from installed packages (the ``medflare.models`` entry point): listed without being imported, built by
name, and refused in one line when they clash with medflare's own, fail to import, or are not a Classifier."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from medflare.errors import ConfigError
from medflare.models import (
    ENTRY_POINT_GROUP,
    Classifier,
    _registry,
    create_model,
    get_model_info,
    is_model,
    list_models,
)
from tests._packages import installed_package

USER_NET = '''
from torch import nn
from medflare.models import Classifier

def user_net(*, num_classes, in_channels, image_size):
    backbone = nn.Sequential(nn.Conv2d(in_channels, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(1))
    return Classifier(backbone, nn.Linear(4, num_classes))

def bare_net(*, num_classes, in_channels, image_size):
    return nn.Linear(in_channels, num_classes)
'''


@pytest.fixture(autouse=True)
def own_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Models registered by a test stay in that test."""
    monkeypatch.setattr(_registry, "_MODELS", dict(_registry._MODELS))
    yield


def test_an_installed_model_is_listed_unimported_and_built_by_name(tmp_path: Path) -> None:
    entries = {ENTRY_POINT_GROUP: {"user_net": "user_models_listed:user_net"}}
    with installed_package(tmp_path, "user-models", entries, {"user_models_listed": USER_NET}):
        assert "user_net" in list_models() and is_model("user_net")
        assert "user_models_listed" not in sys.modules  # listing imports nothing
        model = create_model("user_net", num_classes=3, in_channels=1)
        assert isinstance(model, Classifier) and get_model_info("user_net").module == "user_models_listed"
        assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 3)


def test_an_entry_point_with_a_name_medflare_has_is_refused(tmp_path: Path) -> None:
    entries = {ENTRY_POINT_GROUP: {"cnn": "user_models_clash:user_net"}}
    with installed_package(tmp_path, "user-clash", entries, {"user_models_clash": USER_NET}):
        with pytest.raises(ConfigError, match=r"model 'cnn' is medflare's own .*package 'user-clash' 0.1"):
            get_model_info("cnn")


def test_a_package_that_fails_to_import_is_named_in_one_line(tmp_path: Path) -> None:
    entries = {ENTRY_POINT_GROUP: {"broken_net": "user_models_broken:user_net"}}
    source = "import a_module_nobody_installed\n"
    with installed_package(tmp_path, "user-broken", entries, {"user_models_broken": source}):
        with pytest.raises(ConfigError) as error:
            create_model("broken_net", num_classes=2)
    message = str(error.value)
    assert "\n" not in message and "package 'user-broken' 0.1" in message
    assert "ModuleNotFoundError" in message and "a_module_nobody_installed" in message


def test_an_entry_function_that_returns_no_classifier_is_refused(tmp_path: Path) -> None:
    entries = {ENTRY_POINT_GROUP: {"bare_net": "user_models_bare:bare_net"}}
    with installed_package(tmp_path, "user-bare", entries, {"user_models_bare": USER_NET}):
        with pytest.raises(ConfigError, match=r"model 'bare_net' \(user_models_bare\) returned a Linear, not a "
                                              r"medflare Classifier"):
            create_model("bare_net", num_classes=2)
