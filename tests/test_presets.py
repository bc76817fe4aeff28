"""``--preset paper``: each seed method's preset resolves to a valid run, sits under every other layer, is shared
with a compared baseline without the method's own options, and the CLI says what still differs before a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medflare.console.cli import main, make_parser
from medflare.console.run_options import build_run_config
from medflare.errors import ConfigError
from medflare.methods.presets import PAPER, PRESET_KEYS, Preset
from medflare.plan import preset_layer, validated
from medflare.registry import get_method, list_methods
from medflare.run_config import merge_run_config

SEED_METHODS = ("fedmas", "mdhfl", "fed-mae", "fed-beit", "fedlsm", "fca")
# What a simulation must add that a preset leaves to the data (MDH-FL's public set)
DATA_NEEDS = {"mdhfl": {"data": {"public_fraction": 0.2}}}


def test_every_seed_method_and_only_those_have_a_paper_preset() -> None:
    assert {m for m in list_methods() if PAPER in get_method(m).presets} == set(SEED_METHODS)


@pytest.mark.parametrize("method", SEED_METHODS)
def test_the_paper_preset_resolves_to_a_valid_run(method: str) -> None:
    preset = get_method(method).presets[PAPER]
    assert set(preset.overrides) <= set(PRESET_KEYS) and preset.differs and "§" in preset.source
    run = merge_run_config(preset_layer(PAPER, method), {"method": method}, DATA_NEEDS.get(method, {}))
    run = validated(run)  # the one typed validation every command runs, the method's own checks included
    for key, value in preset.overrides.items():  # every value arrives, typed (tuples and lists compare as JSON)
        got = getattr(run, key)
        if isinstance(value, dict):
            got = {k: got[k] for k in value}
        assert json.loads(json.dumps(got)) == json.loads(json.dumps(value)), key


def test_the_preset_is_the_lowest_layer(tmp_path: Path) -> None:
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"rounds": 7, "train": {"batch_size": 32}}))
    args = make_parser().parse_args(["run", "fca", "--preset", "paper", "--config", str(config), "--clients", "3",
                                     "--set", "train.lr=0.01"])
    run = build_run_config(args)
    assert (run.rounds, run.clients, run.train["batch_size"], run.train["lr"]) == (7, 3, 32, "0.01")
    assert run.model == "efficientnet_b0" and run.train["milestones"] == [60, 70]  # the rest stays the preset's
    assert run.data["image_size"] == 224 and run.method_args["lambda_personal"] == 3.0
    run = validated(run)
    assert run.train["lr"] == 0.01


def test_a_compared_baseline_takes_the_shared_settings_not_the_method_options() -> None:
    args = make_parser().parse_args(["compare", "fedmas", "bsm-fl", "--preset", "paper"])
    args.preset_lead = "fedmas"
    run = build_run_config(args, "bsm-fl")
    assert (run.model, run.rounds, run.clients, run.train["optimizer"]) == ("resnet18", 200, 8, "sgd")
    assert run.method_args == {}
    run = validated(run)


def test_a_preset_declares_its_source_and_differences() -> None:
    with pytest.raises(ValueError, match="not preset options"):
        Preset({"out": "x"}, ("a",), "spec")
    with pytest.raises(ValueError, match="what still differs"):
        Preset({"rounds": 3}, (), "spec")


@pytest.mark.parametrize("argv, message", [
    (["run", "fedavg", "--preset", "paper"], "method 'fedavg' has no preset 'paper'; methods with a 'paper' preset: "),
    (["run", "fca", "--preset", "best"], "method 'fca' has no preset 'best'; known presets: paper"),
    (["compare", "fedavg", "fedprox", "--preset", "paper"], "method 'fedavg' has no preset 'paper'"),
])
def test_an_unknown_preset_is_one_line_and_exit_2(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_methods_lists_the_presets(capsys) -> None:
    assert main(["methods"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert all("[--preset paper]" in lines[m] for m in SEED_METHODS)
    assert "--preset" not in lines["fedavg"]


def test_run_prints_what_differs_before_it_starts(monkeypatch, tmp_path: Path, capsys) -> None:
    import medflare.console.cli as cli

    def stop(*args, **kwargs):
        raise ConfigError("stopped before the run")

    monkeypatch.setattr(cli, "run_in_env", stop)
    code = main(["run", "fca", "--preset", "paper", "--rounds", "1", "--clients", "2", "--set", "data.image_size=32",
                 "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 2
    preset = get_method("fca").presets[PAPER]
    assert out.index("preset 'paper' of fca") < out.index("medflare: running fca")
    assert all(f"  - {line}" in out for line in preset.differs)
