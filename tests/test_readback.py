"""Files medflare reads back, tampered with: a global model for ``predict`` (NaN weights, implausible facts, a
pickled file), a site's ``medflare_site.json`` nested 5,000 deep, and the depth-limited loader and schemas behind
them. Each is refused in one line naming the file and the field, before a model is built or an image resized.
(``tests/test_resume.py`` and ``tests/test_report.py`` hold the run-folder and results-file cases.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from medflare.checkpoint import FACTS_KEY, read_checkpoint
from medflare.console.cli import main
from medflare.errors import ConfigError, DataError
from medflare.run_config import RunConfig
from medflare.site_config import read_site_data_config

from ._predicting import save_global_model, ten_synthetic_images


def deep_array(depth: int) -> str:
    return "[" * depth + "]" * depth


def one_line(error: pytest.ExceptionInfo, *parts: str) -> None:
    """The error is one line that holds every part."""
    text = str(error.value)
    assert "\n" not in text and all(part in text for part in parts), text


# ----- the loader and the schemas (imported in each test: the behaviour tests below run on any version) -------
@pytest.mark.parametrize("depth", [100_000, 5_000, 33])  # past Python's recursion limit, and MAX_DEPTH + 1
def test_json_nested_too_deep_is_one_line_not_a_recursion_error(tmp_path: Path, depth: int) -> None:
    from medflare import readback

    assert depth > readback.MAX_DEPTH
    path = tmp_path / "x.json"
    path.write_text(deep_array(depth))
    with pytest.raises(DataError) as error:
        readback.load_json(path, fix="restore it")
    one_line(error, str(path), f"deeper than {readback.MAX_DEPTH}", "restore it")


def test_json_as_deep_as_allowed_is_read(tmp_path: Path) -> None:
    from medflare import readback

    path = tmp_path / "x.json"
    path.write_text(deep_array(readback.MAX_DEPTH))
    assert readback.nesting_depth(readback.load_json(path)) == readback.MAX_DEPTH


@pytest.mark.parametrize("value,field", [
    ({"rounds": []}, "method is missing"),
    ({"method": "fedavg", "rounds": {}}, "rounds is dict, not a list"),
    ({"method": "fedavg", "rounds": [{"round": True, "started_at": 1, "wall_seconds": 1}]}, "rounds[0].round is bool"),
    ({"method": "fedavg", "rounds": [], "best": {"model_version": 1, "balanced_accuracy": "high"}},
     "best.balanced_accuracy is str, not a number"),
    ({"method": "fedavg", "rounds": [], "evaluations": {"2": {"test_by_attribute": {"0": []}}}},
     "evaluations.2.test_by_attribute.0 is list, not an object"),
])
def test_a_schema_names_the_first_bad_field(value: dict, field: str) -> None:
    from medflare import readback

    with pytest.raises(DataError) as error:
        readback.check(value, readback.RESULTS, "r.json", fix="rerun")
    one_line(error, "r.json: " + field, "rerun")


# ----- predict's global model ---------------------------------------------------------------------------------
@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    run = RunConfig(method="fedavg", data={"source": "synthetic:n=200"})
    return save_global_model(tmp_path / "FL_global_model.pt", run)


def tamper(path: Path, change) -> Path:
    """Load a global model file, let ``change`` edit its content in place, save it back."""
    content = torch.load(path, weights_only=True)
    change(content)
    torch.save(content, path)
    return path


def first_float_key(content: dict) -> str:
    return next(k for k, v in content["model"].items() if v.is_floating_point())


def poison(content: dict) -> None:
    content["model"][first_float_key(content)][0] = float("nan")


def test_a_nan_model_is_refused_by_predict_in_one_line(tmp_path: Path, model_file: Path, capsys) -> None:
    """Before: every row predicted=normal, p_normal=nan."""
    key = first_float_key(torch.load(model_file, weights_only=True))
    tamper(model_file, poison)
    npz, _ = ten_synthetic_images(tmp_path)
    code = main(["predict", str(model_file), str(npz), "-o", str(tmp_path / "p.csv")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "p.csv").exists()
    assert str(model_file) in err and f"'{key}'" in err and "NaN" in err


@pytest.mark.parametrize("field,value", [("image_size", 30_000), ("num_classes", 1), ("in_channels", 300),
                                         ("image_size", "28"), ("class_names", ["a", "b"])])
def test_implausible_task_facts_are_refused_before_anything_is_allocated(model_file: Path, field: str,
                                                                         value: object) -> None:
    """Before: image_size=30000 read fine, and predict then resized every image to 30000 x 30000 (3.6 GB for six)."""
    tamper(model_file, lambda content: content[FACTS_KEY]["task"].__setitem__(field, value))
    with pytest.raises(ConfigError) as error:
        read_checkpoint(model_file)
    one_line(error, str(model_file), f"task.{field}")


@pytest.mark.parametrize("field", ["method", "model", "task"])
def test_facts_missing_a_field_name_it(model_file: Path, field: str) -> None:
    tamper(model_file, lambda content: content[FACTS_KEY].pop(field))
    with pytest.raises(ConfigError) as error:
        read_checkpoint(model_file)
    one_line(error, str(model_file), f"{field} is missing")


class Pickled(torch.nn.Module):
    """A model saved whole (pickled), as ``torch.save(model)`` does: loading it imports and runs this code."""


def test_a_pickled_model_file_is_named_as_such_never_how_to_unpickle_it(tmp_path: Path) -> None:
    path = tmp_path / "whole_model.pt"
    torch.save(Pickled(), path)
    with pytest.raises(ConfigError) as error:
        read_checkpoint(path)
    one_line(error, str(path), "pickled", "can run code", "export")
    assert "weights_only" not in str(error.value)


def test_a_truncated_model_file_is_one_line(model_file: Path) -> None:
    model_file.write_bytes(model_file.read_bytes()[:300])
    with pytest.raises(ConfigError) as error:
        read_checkpoint(model_file)
    one_line(error, str(model_file), "not a readable PyTorch weights file")
    assert "weights_only" not in str(error.value)


# ----- a site's own file ----------------------------------------------------------------------------------------
def test_a_site_file_nested_5000_deep_is_one_line(tmp_path: Path) -> None:
    """Before: an uncaught RecursionError in _read_site_file."""
    (tmp_path / "medflare_site.json").write_text('{"data": ' + deep_array(5_000) + "}")
    with pytest.raises(DataError) as error:
        read_site_data_config(tmp_path, {"source": "site"})
    one_line(error, str(tmp_path / "medflare_site.json"), "deeper than")


def test_a_site_files_model_must_be_a_name(tmp_path: Path) -> None:
    (tmp_path / "medflare_site.json").write_text(json.dumps({"data": {"source": "folder:/x"}, "model": ["cnn"]}))
    with pytest.raises(DataError) as error:
        read_site_data_config(tmp_path, {"source": "site"})
    one_line(error, "medflare_site.json: model is list, not a string")
