"""The SSL-FL benchmark compares the arms on equal terms, never mixes budgets, and reads gaps as the docs do."""

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.benchmarks.conftest import BENCHMARKS


@pytest.fixture()
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("ssl_fl_benchmark", BENCHMARKS / "ssl_fl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # the grid's data config checks the real MedMNIST file; these tests only need the config to be built
    monkeypatch.setattr(module, "data_config", lambda dataset, alpha, fraction=1.0: {
        "source": "synthetic", "partition": f"dirichlet:{alpha:g}",
        **({"label_fraction": fraction} if fraction < 1.0 else {})})
    yield module
    del sys.modules[spec.name]


@pytest.fixture()
def runs(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the jobs the grid actually ran (run_job replaced by a recorder writing a fake model file)."""
    calls: list[str] = []

    def fake_run_job(run: Any, runner: str, out: Path, log: Any = print) -> dict[str, Any]:
        calls.append(run.name)
        out.mkdir(parents=True, exist_ok=True)
        return {"metrics": {"accuracy": 0.5, "balanced_accuracy": 0.5}, "seconds": 0.0, "model_file": str(out / "m.pt")}

    monkeypatch.setattr(bench, "run_job", fake_run_job)
    return calls


@pytest.mark.parametrize(("scratch_arm", "method"), [("scratch-mae", "fed-mae"), ("scratch-beit", "fed-beit")])
def test_each_pretraining_arm_and_its_scratch_arm_differ_only_in_pretraining(bench: ModuleType, scratch_arm: str,
                                                                            method: str) -> None:
    """Same network, initialisation and fine-tuning recipe (Fed-BEiT's: layer scale, drop-path 0.2, clipping 3.0,
    as its registered defaults give), and the tables read each pre-training arm against its own scratch arm."""
    from medflare.registry import get_method
    from medflare.site_config import resolve_train_config

    scratch = vars(bench.finetune_run(scratch_arm, "retina", 0.5, 1, 0.3, None))
    pretrained = vars(bench.finetune_run(method, "retina", 0.5, 1, 0.3, "encoder.pt"))
    differ = {k for k in scratch if scratch[k] != pretrained[k]}
    assert differ == {"name", "pretrained"}
    assert scratch["method"] == method and scratch["method_args"]["pretrain_rounds"] == 0
    assert scratch["data"]["label_fraction"] == 0.3
    spec = get_method(method)
    recipe = spec.config_cls(**scratch["method_args"])
    train = resolve_train_config(spec, scratch["train"])
    expected = {"fed-mae": (0.1, None, 0.0), "fed-beit": (0.2, 0.1, 3.0)}[method]
    assert (recipe.drop_path, getattr(recipe, "layer_scale", None), train.grad_clip) == expected
    assert bench.SCRATCH[method] == scratch_arm and scratch_arm in bench.METHODS


def test_the_beit_pretraining_job_uses_and_reports_the_fixed_tokenizer(bench: ModuleType) -> None:
    args = bench.pretrain_run("fed-beit", "pneumonia", 100.0, 0).method_args
    assert args["dvae_usage_weight"] > 0 and args["min_code_perplexity"] > 0
    per_round = [{"round": 1, "stage": "tokenizer", "code_perplexity_mean": 9.0},
                 {"round": 3, "stage": "pretrain", "codes_used": {"site-1": 300}, "code_perplexity": {"site-1": 90.0},
                  "code_perplexity_mean": 90.0}]
    assert bench.tokenizer_codes(per_round)["tokenizer"]["code_perplexity_mean"] == 90.0
    assert bench.tokenizer_codes([{"round": 1, "stage": "pretrain"}]) == {}


def test_a_cached_job_is_reused_only_with_the_same_configuration(bench: ModuleType, runs: list[str],
                                                                  tmp_path: Path) -> None:
    grid = bench.Grid(tmp_path, "inprocess")
    run = bench.finetune_run("scratch-mae", "retina", 100.0, 0, 1.0, None)
    grid.job(run)
    grid.job(run)
    assert runs == [run.name]
    recorded = json.loads((tmp_path / run.name / "result.json").read_text())["config"]
    assert recorded["train"]["max_steps"] == bench.FINETUNE["max_steps"]
    bench.FINETUNE["max_steps"] += 1  # another budget, same job name
    with pytest.raises(SystemExit, match="train differ"):
        grid.job(bench.finetune_run("scratch-mae", "retina", 100.0, 0, 1.0, None))
    assert runs == [run.name]


def test_a_scratch_job_finished_under_its_former_name_is_reused(bench: ModuleType, runs: list[str],
                                                                tmp_path: Path) -> None:
    run = bench.finetune_run("scratch-mae", "retina", 100.0, 0, 1.0, None)
    legacy = tmp_path / run.name.replace("scratch-mae-", "scratch-", 1)
    legacy.mkdir(parents=True)
    (legacy / "result.json").write_text(json.dumps({"config": bench.job_config(run), "metrics": {}, "seconds": 1}))
    assert bench.Grid(tmp_path, "inprocess").job(run)["seconds"] == 1 and runs == []


def test_a_fine_tuning_job_is_tied_to_its_encoders_weights(bench: ModuleType, tmp_path: Path) -> None:
    import torch

    file = tmp_path / "encoder.pt"
    torch.save({"format": "f", "state_dict": {"backbone.a": torch.zeros(2)}, "encoder_norm": {}}, file)
    first = bench.job_config(bench.finetune_run("fed-mae", "retina", 100.0, 0, 1.0, str(file)))
    torch.save({"format": "f", "state_dict": {"backbone.a": torch.ones(2)}, "encoder_norm": {}}, file)
    assert bench.job_config(bench.finetune_run("fed-mae", "retina", 100.0, 0, 1.0, str(file))) != first


def test_report_only_runs_nothing_and_names_what_is_missing(bench: ModuleType, runs: list[str], tmp_path: Path) -> None:
    grid = bench.Grid(tmp_path, "inprocess")
    grid.job(bench.finetune_run("scratch-mae", "retina", 100.0, 0, 1.0, None))
    reader = bench.Grid(tmp_path, "inprocess", run_missing=False)
    rows, missing = bench.gather(reader.finetune, [("scratch-mae", "retina", 100.0, 0),
                                                   ("scratch-mae", "retina", 100.0, 1), ("fed-mae", "retina", 100.0, 0)])
    assert [r["seed"] for r in rows] == [0]
    assert missing == ["scratch-mae-ft-retina-a100-f1-s1", "fed-mae-pt-retina-a100-s0"]
    assert len(runs) == 1


def rows(method: str, values: list[float], fraction: float = 1.0) -> list[dict[str, Any]]:
    return [{"method": method, "dataset": "retina", "alpha": 100.0, "label_fraction": fraction, "seed": seed,
             "balanced_accuracy": v} for seed, v in enumerate(values)]


def test_the_table_reads_gaps_to_scratch_within_one_std_as_no_difference(bench: ModuleType) -> None:
    lines = bench.table(rows("scratch-mae", [0.70, 0.72, 0.71]) + rows("fed-mae", [0.80, 0.81, 0.79])
                        + rows("scratch-beit", [0.80, 0.82, 0.81]) + rows("fed-beit", [0.66, 0.76, 0.71]),
                        ("dataset", "alpha"), "method", ("balanced_accuracy",), baseline=bench.SCRATCH)
    by_method = {line.split(" | ")[2]: line for line in lines[2:]}
    assert "vs its scratch arm" in lines[0]
    assert "0.8000 ± 0.0100 | 3 | +0.090 (above) |" in by_method["fed-mae"]  # against scratch-mae
    assert "0.7100 ± 0.0500 | 3 | -0.100 (below) |" in by_method["fed-beit"]  # against scratch-beit, not scratch-mae
    assert by_method["scratch-mae"].endswith("| 3 |  |") and by_method["scratch-beit"].endswith("| 3 |  |")


def test_the_label_efficiency_plot_has_one_curve_per_method_over_the_fractions(bench: ModuleType) -> None:
    data = [r for f in (0.1, 0.3, 1.0) for r in rows("scratch", [0.3, 0.4], f) + rows("fed-mae", [0.5, 0.5], f)]
    fig = bench.label_efficiency_figure(data)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["chance", "scratch", "fed-mae"]
    (chance,) = [line for line in ax.lines if line.get_label().startswith("chance")]
    assert chance.get_ydata()[0] == pytest.approx(1 / 5)  # RetinaMNIST: 5 grades
    assert list(ax.get_xticks()) == [10.0, 30.0, 100.0]
    assert "mean ± std over 2 seeds" in ax.get_title()
    bench.pyplot().close(fig)


def test_mae_options_reach_the_pretraining_job(bench: ModuleType) -> None:
    assert bench.parse_options(["norm_pix_loss=false", "mask_ratio=0.3"]) == {"norm_pix_loss": False, "mask_ratio": 0.3}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        bench.parse_options(["norm_pix_loss"])
    bench.MAE_ARGS.update(bench.parse_options(["norm_pix_loss=false"]))
    assert bench.pretrain_run("fed-mae", "pneumonia", 100.0, 0).method_args["norm_pix_loss"] is False
    assert "norm_pix_loss" not in bench.pretrain_run("fed-beit", "pneumonia", 100.0, 0).method_args
