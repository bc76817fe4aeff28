"""``medflare config METHOD [options]``: the configuration ``run`` would use, as a TOML file that loads back, every
option with its type, default and the layer that set it (issue 30, item 6)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import tomllib

from medflare.console.cli import main, make_parser
from medflare.console.run_options import build_run_config
from medflare.methods.base import TrainConfig
from medflare.plan import validated
from medflare.run_config import RunConfig

LINE = re.compile(r"^(?:# )?(\w+) = (.*?)  # (.+); default (.+); from (.+)$")


def printed_config(argv: list[str], capsys) -> str:
    assert main(["config", *argv]) == 0
    return capsys.readouterr().out


def options_by_section(text: str) -> dict[str, dict[str, tuple[str, str, str, bool]]]:
    """section ("" = top level) -> option -> (value text, default, source, written as a value)."""
    sections: dict[str, dict[str, tuple[str, str, str, bool]]] = {"": {}}
    current = ""
    for line in text.splitlines():
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = {}
        elif match := LINE.match(line):
            key, value, _, default, source = match.groups()
            sections[current][key] = (value, default, source, not line.startswith("#"))
    return sections


def checked(argv: list[str]) -> RunConfig:
    return validated(build_run_config(make_parser().parse_args(["config", *argv])), check_files=False)


CASES = [
    ["fedprox", "--scenario", "hyperkvasir-like", "--rounds", "5", "--set", "method.mu=0.3", "--set", "train.lr=0.01"],
    ["fca", "--preset", "paper", "--set", "train.lr=0.002", "--set", "robust.max_share=0.5"],
    ["fedavg", "--partition", "dirichlet:0.3", "--set", 'site_train={"site-2": {"batch_size": 16}}',
     "--set", "task.class_names=[\"a\",\"b\",\"c\",\"d\",\"e\"]"],
]


@pytest.mark.parametrize("argv", CASES, ids=lambda argv: argv[0])
def test_the_printed_file_runs_the_same_configuration(argv: list[str], tmp_path: Path, capsys) -> None:
    text = printed_config(argv, capsys)
    (tmp_path / "run.toml").write_text(text)

    tomllib.loads(text)  # a valid TOML file
    reloaded = checked([argv[0], "--config", str(tmp_path / "run.toml")])

    assert dataclasses.asdict(reloaded) == dataclasses.asdict(checked(argv))


def test_each_option_names_its_default_and_the_layer_it_came_from(tmp_path: Path, capsys) -> None:
    (tmp_path / "mine.toml").write_text("rounds = 7\n[train]\nweight_decay = 1e-4\n")
    text = printed_config(["fedprox", "--scenario", "hyperkvasir-like", "--config", str(tmp_path / "mine.toml"),
                           "--clients", "3", "--set", "method.mu=0.3"], capsys)

    options = options_by_section(text)
    assert options[""]["method"] == ('"fedprox"', '"fedavg"', "flags", True)
    assert options[""]["clients"] == ("3", "2", "flags", True)  # the flag over the scenario's 8
    assert options[""]["rounds"] == ("7", "3", f"--config {tmp_path / 'mine.toml'}", True)
    assert options[""]["shot_thresholds"] == ("[500, 100]", "none", "--scenario hyperkvasir-like", True)
    assert options[""]["model"] == ('"cnn"', '"cnn"', "method default", True)
    assert options[""]["pretrained"] == ("none", "none", "default", False)  # TOML has no null: a comment
    assert options["method_args"]["mu"] == ("0.3", "0.01", "--set", True)
    assert options["train"]["weight_decay"] == ("0.0001", "0.0", f"--config {tmp_path / 'mine.toml'}", True)
    assert options["train"]["optimizer"] == ('"adam"', '"adam"', "default", False)
    assert options["data"]["partition"] == ('"dirichlet:0.5"', '"iid"', "--scenario hyperkvasir-like", True)
    assert options["data"]["num_sites"] == ("3", "3", "default", False)  # the run fills in its clients


def test_a_methods_own_defaults_are_named_as_such(capsys) -> None:
    options = options_by_section(printed_config(["fca"], capsys))

    assert options[""]["model"] == ('"efficientnet_lite0"', '"efficientnet_lite0"', "method default", True)
    assert options["train"]["lr_schedule"] == ('"multistep"', '"multistep"', "method default", False)
    assert options["data"]["eval_split"] == ('"like_train"', '"like_train"', "method default", True)


def test_every_option_is_listed_with_its_type(capsys) -> None:
    text = printed_config(["fedprox"], capsys)

    options = options_by_section(text)
    sections = {"method_args", "train", "data", "task", "robust", "dp_sgd", "server_optimizer"}
    assert set(options[""]) == {f.name for f in dataclasses.fields(RunConfig)} - sections
    assert set(options["train"]) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(options["robust"]) == {"max_norm_ratio", "max_share", "rule", "hostile_sites", "trim_fraction",
                                      "krum_keep", "off"}
    assert set(options["server_optimizer"]) == {"name", "lr", "beta1", "beta2", "tau", "momentum"}
    assert "# lr = 0.001  # a finite number; default 0.001; from default" in text
    assert "tracking = \"tensorboard\"  # one of 'tensorboard', 'mlflow', 'both', 'off';" in text
    assert "# num_classes =  # an integer; default from the data; from default" in text


def test_bad_options_are_one_line_and_print_no_configuration(capsys) -> None:
    assert main(["config", "fedavg", "--set", "train.lr=abc"]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == "medflare: error: train.lr must be a finite number, got 'abc'; e.g. train.lr=0.001"
