"""What a user reads after a run: report.md (per site, per class, best round, every plot), rounds.csv, the
figures (legends clear of the curves, coinciding sites visible, the confusion matrix) and the seeded comparison."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from medflare import plotting
from medflare.console import report as report_module
from medflare.console.launch import results_text
from medflare.console.report import build_summary, comparison_table, startup_text, verdicts, write_outputs

SITES = ("site-1", "site-2")


def metrics(bacc: float, **extra: float) -> dict:
    return {"accuracy": bacc, "balanced_accuracy": bacc, "macro_f1": bacc - 0.1, "auc_macro_ovr": bacc + 0.1,
            "per_class_recall": [bacc, 1 - bacc, 0.5], "per_class_auc": [0.7, 0.6, 0.8], **extra}


def evaluation(bacc: float) -> dict:
    """One model version as the controller records it: pooled, per site, per attribute, an extra evaluation."""
    by_site = {"site-1": metrics(bacc + 0.05, head_accuracy=0.9), "site-2": metrics(bacc - 0.05, head_accuracy=0.7)}
    block = {"by_site": by_site, "site_mean": {"accuracy": bacc, "balanced_accuracy": bacc, "head_accuracy": 0.8}}
    return {"test": metrics(bacc, head_accuracy=0.8, medium_accuracy=0.4, tail_accuracy=0.1, hmt_mean=0.43),
            "val": metrics(bacc), "test_by_attribute": {"0": {"balanced_accuracy": 0.6}, "1": {"balanced_accuracy": 0.4}},
            "test_stats": {"confusion": [[5, 1, 0], [2, 3, 1], [0, 0, 6]]}, **block,
            "extra": {"own": {"test": metrics(bacc + 0.2), **block}}}


def results(best_version: int = 2, shares: tuple[float, float] = (0.5, 0.5)) -> dict:
    records = [{"round": r, "started_at": 10.0 * r, "wall_seconds": 1.0, "share": dict(zip(SITES, shares)),
                "rf": {"site-1": 1.0, "site-2": 1.0}, "sites": {s: {"train_loss": 1.0 - 0.1 * r} for s in SITES},
                "payload": {}} for r in range(2)]
    evaluations = {str(v): evaluation(0.5 + 0.1 * v) for v in range(3)}
    return {"method": "fedmas", "rounds": records, "evaluations": evaluations, "final": evaluations["2"],
            "best": {"model_version": best_version, "balanced_accuracy": 0.7}, "finished_at": 30.0}


def config(**changes) -> dict:
    task = {"num_classes": 3, "in_channels": 3, "image_size": 28, "class_names": ["nevus", "melanoma", "bcc"]}
    return {"method": "fedmas", "clients": 2, "seed": 0, "data": {"source": "synthetic"}, "task": task,
            "shot_thresholds": [50, 10], **changes}


CLIENTS = {"site-1": {"n_train": 80, "n_test": 30, "class_counts": [60, 15, 5]},
           "site-2": {"n_train": 40, "n_test": 30, "class_counts": [30, 5, 5]}}


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, dict]:
    (tmp_path / "sites" / "site-1").mkdir(parents=True)
    (tmp_path / "sites" / "site-1" / "diagnostics.png").write_bytes(b"png")  # the method's site-local picture
    summary = build_summary(results(), config(), CLIENTS)
    write_outputs(summary, tmp_path)
    return tmp_path, summary


def test_report_has_per_site_extra_and_per_class_tables(written) -> None:
    out, _ = written
    report = (out / "report.md").read_text()
    assert "## Per site" in report and "| site | test images | balanced_accuracy | accuracy |" in report
    assert "| site-1 | 30 | 0.7500 | 0.7500 |" in report and "| site-2 | 30 | 0.6500 | 0.6500 |" in report
    assert "| **mean over sites** | - | 0.7000 | 0.7000 |" in report
    assert "## Evaluation 'own' (declared by fedmas)" in report and "| **pooled** | - | 0.9000 | 0.9000 |" in report
    assert "- classes: nevus, melanoma, bcc" in report
    assert "| 1 | melanoma | 20 | medium | 0.3000 | 0.6000 |" in report  # 20 training images: 10 <= 20 <= 50
    assert "| 2 | bcc | 10 | medium |" in report and "| 0 | nevus | 90 | head |" in report


def test_report_names_the_best_round_and_shows_every_plot(written) -> None:
    out, _ = written
    report = (out / "report.md").read_text()
    assert "best model by validation balanced_accuracy: round 2 (balanced_accuracy 0.7000)" in report
    assert "warning" not in report
    images = [line.split("](")[1].rstrip(")") for line in report.splitlines() if line.startswith("![")]
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png"))
    assert sorted(images) == on_disk
    assert {"learning_curves.png", "shares.png", "rf.png", "per_site.png", "confusion.png",
            "sites/site-1/diagnostics.png"} <= set(images)


def test_timings_keyed_by_span_are_not_drawn_as_an_empty_per_site_plot(tmp_path: Path) -> None:
    run = results()
    for record in run["rounds"]:
        record["server_seconds"] = {"aggregate": 0.01, "persist": 0.002}  # keyed by span, not by site
    summary = build_summary(run, config(), CLIENTS)
    write_outputs(summary, tmp_path)
    assert not (tmp_path / "server_seconds.png").exists()
    assert "server_seconds" not in (tmp_path / "report.md").read_text()
    assert (tmp_path / "rf.png").exists()  # a value keyed by site is still drawn


def test_untrained_best_model_is_warned_about(tmp_path: Path) -> None:
    summary = build_summary(results(best_version=0), config(), CLIENTS)
    write_outputs(summary, tmp_path)
    assert "**warning:** the best model by validation is the untrained initial model (round 0)" in (
        tmp_path / "report.md").read_text()
    assert "medflare: warning: fedmas (seed 0): the best model by validation is the untrained" in results_text(
        [summary], tmp_path)


def test_a_method_without_a_server_model_is_reported_as_the_sites_own_models(tmp_path: Path) -> None:
    run = config(method="local-only", model="cnn", site_model={"site-2": "resnet10"}, server_model=False)
    summary = build_summary({**results(best_version=0), "method": "local-only"}, run, CLIENTS)
    write_outputs(summary, tmp_path)

    report = (tmp_path / "report.md").read_text()
    assert "2 sites, models site-2 `resnet10` (other sites `cnn`), 2 rounds" in report
    assert "metrics are of each site's own model (the server holds none)" in report
    assert "round 0 (balanced_accuracy 0.7000), the sites' models of that round" in report
    assert "carry no weights" in report and "saved as `best_FL_global_model.pt`" not in report
    assert "**warning:** the best validation score is that of the sites' untrained initial models" in report
    assert "best_FL_global_model.pt holds the initial weights" not in report
    assert "Each site's own final model on its own test split" in report
    assert "the global model" not in report.lower()


def test_a_staged_runs_rounds_name_their_stage(tmp_path: Path) -> None:
    staged = results(best_version=1)
    for record, stage in zip(staged["rounds"], ("pretrain", "finetune")):
        record["stage"] = stage
    write_outputs(build_summary(staged, config(), CLIENTS), tmp_path)

    assert [(r["round"], r["stage"]) for r in csv.DictReader((tmp_path / "rounds.csv").open())] == [
        ("0", ""), ("1", "pretrain"), ("2", "finetune")]  # round 0: the initial model, before any stage trained
    assert "best model by validation balanced_accuracy: round 1, stage pretrain (" in (tmp_path / "report.md").read_text()


def test_rounds_csv_has_long_tail_and_attribute_columns(written) -> None:
    out, _ = written
    rows = list(csv.DictReader((out / "rounds.csv").open()))
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    for column in ("test_head_accuracy", "test_medium_accuracy", "test_tail_accuracy", "test_hmt_mean",
                   "test_bacc_attr_0", "test_bacc_attr_1", "test_bacc_attr_mean"):
        assert column in rows[0], column
    assert rows[2]["test_tail_accuracy"] == "0.1" and rows[2]["test_bacc_attr_mean"] == "0.5"


def test_rounds_csv_has_the_initial_model_and_the_site_means_the_readme_promises(written) -> None:
    out, _ = written
    rows = list(csv.DictReader((out / "rounds.csv").open()))
    # round r is the model after r rounds: evaluation(0.5 + 0.1 r) in results(), round 0 without training
    assert [(r["round"], r["test_balanced_accuracy"]) for r in rows] == [("0", "0.5"), ("1", "0.6"), ("2", "0.7")]
    assert rows[0]["wall_seconds"] == rows[0]["share_site-1"] == rows[0]["train_loss_site-1"] == ""
    assert rows[1]["wall_seconds"] == "1" and rows[1]["train_loss_site-1"] == "1"
    assert [r["test_site_mean_balanced_accuracy"] for r in rows] == ["0.5", "0.6", "0.7"]
    assert rows[2]["test_site_mean_head_accuracy"] == "0.8" and "test_site_mean_tail_accuracy" not in rows[0]
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "`rounds.csv` (one row per round r = the model after r rounds, round 0 the initial model" in readme
    assert "`test_site_mean_*`" in readme


def test_every_curve_and_row_shows_round_0_when_the_report_names_it_best(tmp_path: Path) -> None:
    summary = build_summary(results(best_version=0), config(), CLIENTS)
    write_outputs(summary, tmp_path)
    assert "best model by validation balanced_accuracy: round 0" in (tmp_path / "report.md").read_text()
    assert next(csv.DictReader((tmp_path / "rounds.csv").open()))["round"] == "0"
    fig = plotting.learning_curves_figure(summary)
    scores, losses = fig.axes
    assert all(list(line.get_xdata())[0] == 0 for line in scores.lines)  # every score curve starts at round 0
    assert all(list(line.get_xdata()) == [1, 2] for line in losses.lines)  # no training before round 1
    plotting.pyplot().close(fig)
    curves = report_module.per_round_curves({"fedmas": [summary]}, "balanced_accuracy")["fedmas"]
    assert curves["rounds"] == [0, 1, 2] and curves["mean"] == pytest.approx([0.5, 0.6, 0.7])


def multi_label_results() -> dict:
    """A multi-label run as the controller records it: selected by AUROC, its balanced accuracy stuck at 0.5."""
    run = results(best_version=1)
    for version, evaluation_of in run["evaluations"].items():
        for split in ("test", "val"):
            evaluation_of[split] = {**evaluation_of[split], "balanced_accuracy": 0.5,
                                    "auc_macro_ovr": 0.6 + 0.05 * int(version)}
        for by_site in evaluation_of["by_site"].values():
            by_site.update(balanced_accuracy=0.5, auc_macro_ovr=0.66)
    run["final"] = run["evaluations"]["2"]
    return {**run, "key_metric": "auc_macro_ovr", "best": {"model_version": 1, "auc_macro_ovr": 0.65}}


def multi_label_config() -> dict:
    task = {"num_classes": 3, "in_channels": 1, "image_size": 28, "multi_label": True}
    return config(task=task)


def test_a_multi_label_run_is_headlined_and_selected_by_auroc_everywhere(tmp_path: Path) -> None:
    summary = build_summary(multi_label_results(), multi_label_config(), CLIENTS)
    assert summary["headline_metric"] == "auc_macro_ovr"
    write_outputs(summary, tmp_path)

    report = (tmp_path / "report.md").read_text()
    assert "the headline metric is macro AUROC (`auc_macro_ovr`), and the best model is chosen by its value" in report
    assert "best model by validation auc_macro_ovr: round 1 (auc_macro_ovr 0.6500)" in report
    fig = plotting.learning_curves_figure(summary)
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels[0] == "test auc_macro_ovr" and "val auc_macro_ovr (selects the best model)" in labels
    assert "val balanced_accuracy (selects the best model)" not in labels
    assert list(fig.axes[0].lines[0].get_ydata()) == pytest.approx([0.6, 0.65, 0.7])
    plotting.pyplot().close(fig)
    rows = list(csv.DictReader((tmp_path / "rounds.csv").open()))
    assert [r["test_auc_macro_ovr"] for r in rows] == ["0.6", "0.65", "0.7"]
    assert [r["val_auc_macro_ovr"] for r in rows] == ["0.6", "0.65", "0.7"]
    assert comparison_table([summary]).splitlines()[0].endswith("| vs best (auc_macro_ovr) |")
    # issue 61 minors: the headline leads report.md's tables (it was their last column)
    assert "| method | rounds | auc_macro_ovr |" in report and "| site | test images | auc_macro_ovr |" in report


def test_a_multi_label_run_without_a_recorded_metric_is_headlined_by_its_task(tmp_path: Path) -> None:
    run = multi_label_results()
    del run["key_metric"], run["best"]  # an earlier results file, nothing scored on validation
    assert build_summary(run, multi_label_config(), CLIENTS)["headline_metric"] == "auc_macro_ovr"
    assert build_summary(run, config(), CLIENTS)["headline_metric"] == "balanced_accuracy"


def test_the_per_site_plot_shows_the_headline_metric() -> None:
    summary = build_summary(multi_label_results(), multi_label_config(), CLIENTS)
    assert report_module.per_site_scores(summary) == {"global model": {"site-1": 0.66, "site-2": 0.66},
                                                      "own": {"site-1": 0.66, "site-2": 0.66}}


def test_no_plot_without_data_is_drawn_or_embedded(tmp_path: Path) -> None:
    run = results()
    run["evaluations"], run["final"] = {}, {}  # the sites sent no evaluation (site_evaluation off)
    for record in run["rounds"]:
        record["sites"] = {}  # and no training loss
    write_outputs(build_summary(run, config(), CLIENTS), tmp_path)

    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["rf.png", "shares.png"]
    report = (tmp_path / "report.md").read_text()
    assert "learning_curves" not in report and "per_site.png" not in report
    assert "round,wall_seconds,val_accuracy" in (tmp_path / "rounds.csv").read_text()  # the rows are still there


def test_a_learning_curves_panel_without_data_is_left_out() -> None:
    run = results()
    for record in run["rounds"]:
        record["sites"] = {}  # no site reported a training loss
    fig = plotting.learning_curves_figure(build_summary(run, config(), CLIENTS))
    assert [ax.get_ylabel() for ax in fig.axes] == ["score"]
    plotting.pyplot().close(fig)


def test_a_figure_without_data_is_not_written(tmp_path: Path) -> None:
    fig, ax = plotting.pyplot().subplots()
    ax.plot([1, 2], [None, None])  # what a per-site value of no site, or a metric never scored, draws
    assert plotting.save(fig, tmp_path / "empty.png") is None and not (tmp_path / "empty.png").exists()
    fig, ax = plotting.pyplot().subplots()
    ax.plot([1, 2], [None, 0.5])
    assert plotting.save(fig, tmp_path / "one_point.png") == tmp_path / "one_point.png"


def test_start_up_counts_from_the_launch_and_says_when_the_launch_is_unknown() -> None:
    run = {**results(), "controller_started_at": -5.0}  # round 1 starts at 0.0
    launched = build_summary(run, config(), CLIENTS, launched_at=-17.0)["timing"]
    assert (launched["startup_seconds"], launched["startup_from"], launched["launched_at"]) == (17.0, "launch", -17.0)
    assert startup_text(launched) == "start-up 17.0 s"
    elsewhere = build_summary(run, config(), CLIENTS)["timing"]
    assert startup_text(elsewhere) == "start-up 5.0 s (from the server app's start: the job was launched elsewhere)"
    resumed = {**run, "resumed": [{"start_round": 1}]}  # this job ran round 2 only, which started at 10.0
    assert build_summary(resumed, config(), CLIENTS, launched_at=8.0)["timing"]["startup_seconds"] == 2.0
    assert startup_text({"startup_from": "server"}) == "start-up n/a"


def test_confusion_figure_shows_the_pooled_counts_with_class_names(written) -> None:
    _, summary = written
    fig = plotting.confusion_figure(summary["final_confusion"], ["nevus", "melanoma", "bcc"])
    ax = fig.axes[0]
    np.testing.assert_array_equal(ax.images[0].get_array(), [[5, 1, 0], [2, 3, 1], [0, 0, 6]])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["nevus", "melanoma", "bcc"]
    plotting.pyplot().close(fig)


def test_multi_label_confusion_is_one_absent_present_panel_per_finding() -> None:
    per_finding = [[[8, 2], [1, 4]], [[5, 0], [3, 7]], [[9, 1], [0, 2]]]
    fig = plotting.confusion_figure(per_finding, ["effusion", "nodule", "mass"])

    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == ["effusion", "nodule", "mass"]
    for ax, matrix in zip(panels, per_finding):
        np.testing.assert_array_equal(ax.images[0].get_array(), matrix)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["absent", "present"]
    plotting.pyplot().close(fig)


def overlaps_its_axes(fig) -> list[str]:
    fig.canvas.draw()
    return [ax.get_title() for ax in fig.axes
            if ax.get_legend() and ax.get_legend().get_window_extent().overlaps(ax.get_window_extent())]


def test_legends_never_cover_the_curves(written) -> None:
    _, summary = written
    figures = [plotting.learning_curves_figure(summary), plotting.shares_figure(summary),
               plotting.per_site_value_figure(summary, "rf"),
               plotting.per_site_metrics_figure({"global": {"site-1": 0.7}}, "balanced_accuracy", 0.7)]
    for fig in figures:
        assert overlaps_its_axes(fig) == []
        plotting.pyplot().close(fig)


def test_sites_with_equal_shares_each_keep_a_visible_band(written) -> None:
    _, summary = written
    fig = plotting.shares_figure(summary)
    bands = fig.axes[0].collections
    assert len(bands) == 2
    for band in bands:  # each band spans its share of the height, so no site hides behind another
        heights = np.ptp(band.get_paths()[0].vertices[:, 1])
        assert heights == pytest.approx(0.5, abs=1e-9) or heights == pytest.approx(1.0, abs=1e-9)
    tops = sorted(band.get_paths()[0].vertices[:, 1].max() for band in bands)
    assert tops == pytest.approx([0.5, 1.0])
    plotting.pyplot().close(fig)


def seeded(method: str, baccs: list[float]) -> list[dict]:
    return [{"method": method, "rounds_completed": 3, "config": {"seed": seed}, "per_round": [],
             "final": {"accuracy": b, "balanced_accuracy": b}} for seed, b in enumerate(baccs)]


def test_comparison_reports_mean_std_and_no_difference_within_one_std() -> None:
    runs = seeded("fedavg", [0.60, 0.64, 0.62]) + seeded("fedprox", [0.59, 0.63, 0.61]) + seeded("moon", [0.40, 0.41, 0.42])
    table = comparison_table(runs)
    assert "| fedavg | 3 | 3 | 0.6200 ± 0.0200 | 0.6200 ± 0.0200 | best |" in table
    assert "| fedprox | 3 | 3 | 0.6100 ± 0.0200 | 0.6100 ± 0.0200 | no difference (gap 0.0100 ≤ 1 std 0.0200) |" in table
    assert "| moon | 3 | 3 | 0.4100 ± 0.0100 | 0.4100 ± 0.0100 | worse by 0.2100 (> 1 std 0.0200) |" in table


def test_a_one_seed_comparison_gives_the_gap_and_says_the_spread_is_unknown() -> None:
    """Issue 61 minors: with one seed each std is 0, so an equal pair read "no difference (... ≤ 1 std 0.0000)" and
    any gap "worse by"; one seed measures no spread."""
    table = comparison_table(seeded("fedavg", [0.62]) + seeded("fedprox", [0.62]) + seeded("moon", [0.41]))
    assert "| fedprox | 1 | 3 | 0.6200 ± 0.0000 | 0.6200 ± 0.0000 | gap 0.0000; spread unknown with one seed" in table
    assert "| moon | 1 | 3 | 0.4100 ± 0.0000 | 0.4100 ± 0.0000 | gap 0.2100; spread unknown with one seed" in table
    assert "no difference" not in table and "worse by" not in table


def test_verdict_uses_the_larger_of_the_two_spreads() -> None:
    stats = {"a": {"balanced_accuracy": (0.70, 0.01)}, "b": {"balanced_accuracy": (0.66, 0.05)}}
    assert verdicts(stats, "balanced_accuracy")["b"].startswith("no difference")  # 0.04 is within b's own 0.05
    stats["b"]["balanced_accuracy"] = (0.66, 0.03)
    assert verdicts(stats, "balanced_accuracy")["b"].startswith("worse by 0.0400")


# ----- medflare report on a tampered results file: one line naming the file and the field ----------------------
@pytest.mark.parametrize("change,field", [
    (lambda r: "[" * 100_000 + "]" * 100_000, "nests deeper than 32 levels"),  # before: RecursionError
    (lambda r: r["rounds"][0].pop("started_at"), "rounds[0].started_at is missing"),  # before: KeyError
    (lambda r: r["rounds"][1].update(sites=[]), "rounds[1].sites is list, not an object"),  # before: AttributeError
    (lambda r: r["rounds"][0].update(wall_seconds="9"), "rounds[0].wall_seconds is str, not a number"),  # TypeError
    (lambda r: r["evaluations"]["2"]["test"].update(per_class_recall=5), "per_class_recall is int"),
    (lambda r: r.update(final=[]), "final is list, not an object"),
])
def test_report_on_a_tampered_results_file_is_one_line(tmp_path: Path, capsys, change, field: str) -> None:
    from medflare.console.cli import main
    from medflare.run_config import RunConfig

    from .test_cli import downloaded_job

    app_server = downloaded_job(tmp_path, RunConfig(method="fedavg", rounds=2, data={"source": "synthetic:n=200"}))
    path = app_server / "medflare_results.json"
    results = json.loads(path.read_text())
    results["final"] = results["evaluations"]["2"]
    replaced = change(results)
    path.write_text(replaced if isinstance(replaced, str) else json.dumps(results))

    code = main(["report", str(path)])

    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{path}: " in err or f"{path} " in err
    assert field in err and not (app_server / "report.md").exists()


def test_class_names_from_the_data_are_escaped_in_report_md(tmp_path: Path) -> None:
    """Issue 49, item 5: a class folder named like Markdown or HTML cannot break a table or inject a link."""
    task = {"num_classes": 3, "in_channels": 3, "image_size": 28,
            "class_names": ["a|b", "<img src=x onerror=alert(1)>", "[click](http://x)"]}
    write_outputs(build_summary(results(), config(task=task), CLIENTS), tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "| 0 | a\\|b |" in text and "\\<img src=x onerror=alert(1)\\>" in text and "\\[click\\](http://x)" in text
    assert "<img" not in text.replace("\\<img", "")


def test_a_right_to_left_override_in_a_class_name_reaches_report_md_escaped(tmp_path: Path) -> None:
    """Issue 60, item 8: U+202E (right-to-left override) in a class name of a run's results reached report.md raw,
    where it shows the text after it reversed ("lamron" read as "normal"); it is written as its escape."""
    task = {"num_classes": 3, "in_channels": 3, "image_size": 28,
            "class_names": ["nevus", "\u202elamron", "bcc\u2066x\u2069"]}
    write_outputs(build_summary(results(), config(task=task), CLIENTS), tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert not {"\u202e", "\u2066", "\u2069"} & set(text)
    assert "| 1 | \\\\u202elamron |" in text and "bcc\\\\u2066x\\\\u2069" in text
