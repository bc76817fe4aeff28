"""``config.from_dict`` types every field by its annotation: typed values and command-line text alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from medflare.config import from_dict
from medflare.data import DataConfig
from medflare.errors import ConfigError
from medflare.methods.base import TrainConfig
from medflare.registry import get_method, list_methods
from medflare.run_config import RunConfig
from medflare.site_config import TaskSpec

from ._plans import run_plan


@dataclass
class Inner:
    depth: int = 1


@dataclass
class Everything:
    """One field per kind of annotation the config dataclasses use (or may use)."""

    count: int = 1
    rate: float = 0.5
    flag: bool = False
    label: str = "a"
    size: int | None = None
    steps: list[int] = field(default_factory=list)
    table: dict[str, float] = field(default_factory=dict)
    per_site: dict[str, dict[str, Any]] = field(default_factory=dict)
    pair: tuple[int, int] = (1, 2)
    mode: Literal["fast", "slow"] = "fast"
    rate_or_rates: float | list[float] = 0.0
    inner: Inner = field(default_factory=Inner)
    anything: Any = None


GOOD = [  # (field, given, typed value)
    ("count", 3, 3), ("count", "3", 3), ("count", " 7 ", 7),
    ("rate", 1, 1.0), ("rate", "1e-3", 0.001), ("rate", 0.25, 0.25),
    ("flag", True, True), ("flag", "true", True), ("flag", "off", False), ("flag", 0, False),
    ("label", "b", "b"), ("label", "3", "3"),
    ("size", None, None), ("size", "null", None), ("size", "32", 32), ("size", 64, 64),
    ("steps", [1, 2], [1, 2]), ("steps", "[10, 100]", [10, 100]),
    ("table", {"a": 1}, {"a": 1.0}), ("table", '{"a": 0.5}', {"a": 0.5}),
    ("per_site", '{"site-2": {"batch_size": 16}}', {"site-2": {"batch_size": 16}}),
    ("pair", [3, 4], (3, 4)), ("pair", "[3, 4]", (3, 4)),
    ("mode", "slow", "slow"),
    ("rate_or_rates", "0.2", 0.2), ("rate_or_rates", [0.1, 0.2], [0.1, 0.2]),
    ("rate_or_rates", "[0.1, 0.3]", [0.1, 0.3]),
    ("inner", {"depth": 4}, Inner(4)), ("inner", '{"depth": "5"}', Inner(5)),
    ("anything", "text", "text"),
]
BAD = [  # (field, given, text the error names)
    ("count", "three", "count must be an integer, got 'three'"),
    ("count", 1.5, "count must be an integer, got 1.5"),
    ("count", True, "count must be an integer, got true"),
    ("count", "1.5", "count must be an integer"),
    ("rate", "abc", "rate must be a finite number, got 'abc'; e.g. rate=0.5"),
    ("rate", float("nan"), "rate must be a finite number"),
    ("rate", "inf", "rate must be a finite number"),
    ("rate", False, "rate must be a finite number"),
    ("flag", "maybe", "flag must be true or false"),
    ("flag", 2, "flag must be true or false"),
    ("label", 3, "label must be text, got 3"),
    ("size", "big", "size must be an integer or null"),
    ("steps", "[1, 'x']", "steps must be a JSON list of an integer"),
    ("steps", [1, "x"], "steps[1] must be"),
    ("steps", 5, "steps must be a JSON list"),
    ("table", {"a": "x"}, "table.a must be"),
    ("table", "a=1", "table must be a JSON object"),
    ("pair", [1, 2, 3], "pair must be"),
    ("mode", "medium", "mode must be one of 'fast', 'slow'"),
    ("rate_or_rates", "lots", "rate_or_rates must be a finite number or a JSON list of a finite number"),
    ("inner", {"depth": "deep"}, "inner.depth must be an integer"),
    ("inner", {"width": 1}, "inner: unknown option(s) width"),
]


@pytest.mark.parametrize("name, given, expected", GOOD)
def test_values_become_their_annotated_type(name: str, given: Any, expected: Any) -> None:
    value = getattr(from_dict(Everything, {name: given}, ""), name)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("name, given, message", BAD)
def test_values_that_do_not_fit_fail_in_one_line_naming_the_option(name: str, given: Any, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        from_dict(Everything, {name: given}, "")
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_where_prefixes_the_option_name() -> None:
    with pytest.raises(ConfigError, match=r"^train\.lr must be a finite number, got 'abc'; e.g\. train\.lr=0\.001$"):
        from_dict(TrainConfig, {"lr": "abc"}, "train")


def test_unknown_keys_list_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="train: unknown option.s. lr_max; valid options: .*batch_size"):
        from_dict(TrainConfig, {"lr_max": 1}, "train")


CONFIG_CLASSES = [RunConfig, TrainConfig, DataConfig, TaskSpec] + [get_method(m).config_cls for m in list_methods()]


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda cls: cls.__name__)
def test_every_numeric_field_of_every_config_refuses_text(cls: type) -> None:
    """No per-class code: a field added to any config dataclass is type-checked from its annotation."""
    from dataclasses import fields
    from typing import get_type_hints

    hints = get_type_hints(cls)
    numeric = [f.name for f in fields(cls) if hints[f.name] in (int, float, int | None, float | None, bool)]
    assert numeric or cls.__name__.endswith("Config") and not fields(cls)
    for name in numeric:
        with pytest.raises(ConfigError, match=rf"{name} must be"):
            from_dict(cls, {name: "not-a-number"}, "")


# ----- a method's own pre-launch checks (MethodSpec.check_run) run in RunConfig.validate (issue 27) -------------
def test_fedlsm_pool_rows_are_checked_per_site_before_anything_starts() -> None:
    """Each site's trainer refused batch_size <= mix_batch only at its first task."""
    short = {"site-2": {"batch_size": 4}}
    with pytest.raises(ConfigError, match="method 'fedlsm': train.batch_size at site-2 leaves no pseudo-pool rows"):
        run_plan(RunConfig(method="fedlsm", site_train=short))
    run_plan(RunConfig(method="fedlsm", site_train=short, method_args={"ude": False}))  # no MixUp rows taken


def test_fedmas_prior_cache_with_a_drawing_augmentation_is_refused_before_anything_starts() -> None:
    """Each site refused it only at its first task, after drawing views of its training images."""
    cached = {"cache_prior_features": True}
    for method in ("fedmas", "bsm-kd"):
        with pytest.raises(ConfigError, match=f"method '{method}': .*data.augment=basic"):
            run_plan(RunConfig(method=method, method_args=cached))
    run_plan(RunConfig(method="fedmas", method_args=cached, data={"source": "synthetic", "augment": "weak"}))
    site_task = {"num_classes": 2, "in_channels": 1, "image_size": 28}
    run_plan(RunConfig(method="fedmas", method_args=cached, data={"source": "site"}, task=site_task))  # its own check


# ----- absurd numbers in a site's file or a job: one line each (issue 49, item 7) ---------------------------------
@pytest.mark.parametrize("key, value, expected", [
    ("image_size", 10**400, ("data.image_size must be an integer", "of magnitude below 2**53", "(401 characters)")),
    ("label_noise", 10**400, ("data.label_noise must be a finite number", "within a float's range")),
    ("seed", 2**64, ("data.seed must be an integer of magnitude below 2**53, got 18446744073709551616",)),
    ("image_size", 100_000, ("data.image_size must be between 1 and 4096, got 100000",)),
], ids=["image_size-10^400", "label_noise-10^400", "seed-2^64", "image_size-100000"])
def test_a_huge_number_in_a_data_block_is_one_line(key: str, value: int, expected: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as refused:
        from_dict(DataConfig, {"source": "folder:/x", key: value}, "data")
    message = str(refused.value)
    assert all(part in message for part in expected) and "\n" not in message and len(message) < 300, message


def test_a_config_file_nested_thousands_deep_is_one_line(tmp_path) -> None:
    from medflare.config import load_config_file

    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError) as refused:
        load_config_file(deep)
    assert str(refused.value).startswith(f"config file {deep} nests deeper than") and "\n" not in str(refused.value)
