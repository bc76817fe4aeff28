"""``medflare predict`` on the global model of a real simulator run of the demo's set-up (Fed-MAS, the
``hyperkvasir-like`` scenario, shrunk to 2 sites x 1 round), and the report that run wrote."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from medflare.console.cli import main
from medflare.console.scenarios import load_scenario
from medflare.console.simulate import run_simulation
from medflare.data import load_source
from medflare.plan import resolve
from medflare.run_config import merge_run_config

from .._predicting import read_probabilities, site_probabilities, write_images_npz

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

SOURCE = "synthetic:n=400,classes=8,imbalance=10"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, dict, object]:
    # no site shift: every site scores untouched slices of the source's test split, so the sites' pooled
    # confusion matrix can be rebuilt from the saved model alone
    run = merge_run_config(load_scenario("hyperkvasir-like"), {
        "method": "fedmas", "clients": 2, "rounds": 1, "shot_thresholds": None, "train": {"max_steps": 3},
        "data": {"source": SOURCE, "site_shift": 0.0}, "method_args": {"prior_input_size": 32}})
    out = tmp_path_factory.mktemp("runs") / "demo"
    summary = run_simulation(resolve(run, "byoc"), out, echo=lambda line: None)
    return out, summary, run


def test_predict_on_ten_new_images_matches_the_in_process_model(demo_run, tmp_path: Path, capsys) -> None:
    out, _, run = demo_run
    test = load_source(SOURCE).test
    npz = write_images_npz(tmp_path / "new.npz", np.asarray(test.images[:10]), np.asarray(test.labels[:10]))

    assert main(["predict", str(out / "FL_global_model.pt"), str(npz), "-o", str(tmp_path / "p.csv")]) == 0

    header, probabilities = read_probabilities(tmp_path / "p.csv")
    assert probabilities.shape == (10, 8) and header[3:] == [f"p_lesion_type_{k}" for k in range(8)]
    np.testing.assert_allclose(probabilities, site_probabilities(run, npz, out / "FL_global_model.pt"), atol=1e-6)
    assert "wrote 10 predictions of fedmas" in capsys.readouterr().out


def test_predictions_on_the_test_split_rebuild_the_sites_confusion_matrix(demo_run, tmp_path: Path, capsys) -> None:
    """The sites scored FL_global_model.pt in the final validation task; predict scores it alone, from the file,
    and prints the metrics the sites' pooled test counts give."""
    out, summary, _ = demo_run
    test = load_source(SOURCE).test
    npz = write_images_npz(tmp_path / "test.npz", np.asarray(test.images), np.asarray(test.labels))

    assert main(["predict", str(out / "FL_global_model.pt"), str(npz), "-o", str(tmp_path / "all.csv")]) == 0

    final = summary["final"]
    assert (f"on {len(test.labels)} labelled images: balanced accuracy {final['balanced_accuracy']:.4f}, "
            f"accuracy {final['accuracy']:.4f}, macro AUROC ") in capsys.readouterr().out

    names = [f"lesion_type_{k}" for k in range(8)]
    confusion = np.zeros((8, 8), dtype=np.int64)
    for row in csv.DictReader((tmp_path / "all.csv").open()):
        confusion[names.index(row["label"]), names.index(row["predicted"])] += 1
    np.testing.assert_array_equal(confusion, summary["final_confusion"])


def test_the_demo_report_shows_every_plot_and_names_the_best_round(demo_run) -> None:
    out, summary, _ = demo_run
    report = (out / "report.md").read_text()
    for plot in ("learning_curves.png", "shares.png", "rf.png", "per_site.png", "confusion.png",
                 "sites/site-1/diagnostics.png", "sites/site-2/diagnostics.png"):
        assert (out / plot).is_file() and f"]({plot})" in report, plot
    version = summary["best"]["model_version"]
    assert f"best model by validation balanced_accuracy: round {version} " in report
    assert ("the best model by validation is the untrained initial model" in report) == (version == 0)
    assert "## Per site" in report and "| site-1 |" in report and "| 7 | lesion_type_7 |" in report
