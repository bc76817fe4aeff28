"""Every registered method keeps the same folder contract, so adding one needs no new test code."""

from pathlib import Path

import pytest

import medflare.methods
from medflare.errors import ConfigError
from medflare.methods.base import LocalTrainer, MethodSpec, ServerRule
from medflare.registry import get_method, list_methods

METHODS_DIR = Path(medflare.methods.__file__).parent


def test_baselines_are_registered() -> None:
    assert {"fedavg", "bsm-fl", "fedprox"} <= set(list_methods())


def test_unknown_method_names_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match="fedavg"):
        get_method("no-such-method")


@pytest.mark.parametrize("name", list_methods())
def test_method_folder_layout(name: str) -> None:
    spec = get_method(name)
    folder = Path(__import__(spec.trainer_cls.__module__, fromlist=["x"]).__file__).parent
    assert folder.parent == METHODS_DIR
    for required in ("__init__.py", "client.py", "README.md"):
        assert (folder / required).is_file(), f"{name}: missing {required}"
    if spec.server_rule_cls is not ServerRule:
        assert (folder / "server.py").is_file(), f"{name}: a custom server rule lives in server.py"


@pytest.mark.parametrize("name", list_methods())
def test_spec_is_complete(name: str) -> None:
    spec = get_method(name)
    assert isinstance(spec, MethodSpec) and spec.summary and spec.reference
    assert issubclass(spec.trainer_cls, LocalTrainer) and issubclass(spec.server_rule_cls, ServerRule)
    spec.config_cls()  # defaults must be valid
