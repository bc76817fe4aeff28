"""The command line: listings; bad input fails early, in one line naming the option, and leaves nothing behind;
what the user sets reaches the job typed; flags merge with the defaults; ``report`` reads the job's config."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medflare.console.cli import main
from medflare.console.launch import report_from_results
from medflare.plan import PLAN_FILE, plan_from_job, task_of, validated
from medflare.run_config import RunConfig
from medflare.server_setup import DEPLOY_ROBUST, ROBUST_OFF

from ._plans import write_run_job
from .test_job_export import written_robust

TASK = ["--set", "task.num_classes=2", "--set", "task.in_channels=1", "--set", "task.image_size=28"]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``medflare ARGS`` (argparse errors exit through SystemExit)."""
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(autouse=True)
def nothing_may_start(monkeypatch) -> None:
    """Any child process started during these tests fails them: validation comes before launching."""
    # matplotlib runs `fc-list` once per machine to build its font cache; that is not medflare starting a process
    import matplotlib.font_manager  # noqa: F401

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_methods_lists_the_baselines(capsys) -> None:
    code, out, _ = run_cli(["methods"], capsys)
    assert code == 0
    for name in ("fedavg", "bsm-fl", "fedprox"):
        assert name in out


def write_png_dataset(root: Path, labels: list[int], corrupt: int | None = None) -> Path:
    rows = ["path,label"]
    for i, label in enumerate(labels):
        path = root / f"img{i}.png"
        if i == corrupt:
            path.write_bytes(b"not a png")
        else:
            Image.fromarray(np.full((8, 8), min(255, 30 * label), np.uint8)).save(path)
        rows.append(f"{path.name},{label}")
    manifest = root / "manifest.csv"
    manifest.write_text("\n".join(rows) + "\n")
    return manifest


# ----- one typed validation, shared by run, compare and export -----------------------------------------
# (options, text the one-line error must contain: the option it names)
BAD_INPUTS = [
    (["--set", "rounds=three"], "rounds must be an integer, got 'three'"),
    (["--set", "clients=1.5"], "clients must be an integer"),
    (["--set", "rounds=true"], "rounds must be an integer"),
    (["--rounds", "0"], "rounds must be between 1 and 100000, got 0"),
    (["--rounds", "100001"], "rounds must be between 1 and 100000, got 100001"),
    (["--rounds", "99999999999999999999"], "rounds must be an integer of magnitude below 2**53, got 99999999999999999999"),
    (["--set", "seed=18446744073709551616"], "seed must be an integer of magnitude below 2**53"),
    (["--set", "seed=4294967296"], "seed must be between 0 and 2147483647, got 4294967296"),
    (["--set", "task_timeout=99999999"], "task_timeout must be between 0 (no limit) and 604800"),
    (["--set", "task.image_size=100000"], "task.image_size must be between 8 and 4096, got 100000"),
    (["--clients", "1.5"], "argument --clients"),
    (["--lr", "nan"], "train.lr must be a finite number"),
    (["--lr", "inf"], "train.lr must be a finite number"),
    (["--lr", "-0.1"], "train.lr must be > 0"),
    (["--max-steps", "-1"], "train.max_steps must be between 0 (no cap) and 1000000000, got -1"),
    (["--batch-size", "0"], "batch_size"),
    (["--set", "train.lr=abc"], "train.lr must be a finite number, got 'abc'"),
    (["--set", "train.optimizer=lbfgs"], "train.optimizer"),
    (["--set", "train.nesterov=maybe"], "train.nesterov must be true or false"),
    (["--set", "train.nope=1"], "train: unknown option(s) nope"),
    (["--set", "method.mu=0.1"], "method 'fedavg': unknown option(s) mu"),
    (["--set", "nosuchkey=1"], "unknown key 'nosuchkey'"),
    (["--set", "rounds"], "--set expects key=value"),
    (["--set", "min_clients=5"], "min_clients must be between 0 and clients=2"),
    (["--set", "seed=-1"], "seed must be between 0 and 2147483647, got -1"),
    (["--set", "site_evaluation=sometimes"], "site_evaluation must be one of"),
    (["--set", "task_request_interval=0"], "task_request_interval must be between 0 (excluded) and 60, got 0"),
    (["--set", "shot_thresholds=[1]"], "shot_thresholds must be"),
    (["--set", "shot_thresholds=lots"], "shot_thresholds must be a JSON list"),
    (["--set", 'site_train={"site-9": {"lr": 0.1}}'], "site_train names 'site-9'"),
    (["--set", 'site_train={"site-2": {"lr": "fast"}}'], "site_train.site-2.lr must be a finite number"),
    (["--set", "name=a/b"], "name must be a plain job name"),
    (["--set", "name=../../x"], "name must be a plain job name"),
    (["--set", "name=."], "name must be a plain job name"),
    (["--set", "task.num_classes=1"], "task.num_classes must be between 2 and 100000, got 1"),
    (["--set", "task.num_classes=two"], "task.num_classes must be an integer"),
    (["--set", "task.depth=3"], "task: unknown option(s) depth"),
    (["--partition", "dirichlet:abc"], "dirichlet"),
    (["--set", "data.label_noise=2"], "label_noise"),
    (["--set", "data.label_noise=lots"], "data.label_noise must be a finite number"),
    (["--set", "data.noise_kind=weird"], "noise_kind"),
    (["--set", "data.nope=1"], "data: unknown option(s) nope"),
    (["--model", "no-such-net"], "unknown model 'no-such-net'"),
    (["--pretrained", "imagenet"], "pretrained=imagenet: model 'cnn' has no offline ImageNet weights"),
    (["--config", "/does/not/exist.toml"], "config file not found"),
    (["--scenario", "no-such-scenario"], "unknown scenario 'no-such-scenario'"),
    (["--set", "robust.off=true", "--set", "robust.max_share=0.4"], "robust.off=true turns every defence off"),
    (["--set", "robust.off=maybe"], "robust.off must be true or false"),
    (["--set", "robust.max_share=2"], "robust.max_share must be between 0 (off) and 1, got 2"),
    (["--set", "robust.nope=1"], "robust: unknown option(s) nope; valid options: max_norm_ratio, max_share, rule, hostile_sites, trim_fraction, krum_keep, off"),
]
COMMANDS = {
    "run": lambda options, out: ["run", "fedavg", *options, "--out", str(out)],
    "compare": lambda options, out: ["compare", "fedavg", "fedprox", *options, "--out", str(out)],
    "export": lambda options, out: ["export", "fedavg", *TASK, *options, "-o", str(out)],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("options, expected", BAD_INPUTS, ids=[" ".join(o) for o, _ in BAD_INPUTS])
def test_bad_input_is_one_line_naming_the_option_and_nothing_is_written(
    command: str, options: list[str], expected: str, tmp_path: Path, capsys
) -> None:
    code, out, err = run_cli(COMMANDS[command](options, tmp_path / "out"), capsys)
    assert code == 2
    assert expected in err
    assert len(err.strip().splitlines()) == 1, err
    assert out == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, expected", [
    (["run", "no-such-method"], "unknown method 'no-such-method'"),
    (["compare", "fedavg", "no-such-method"], "unknown method 'no-such-method'"),
    (["export", "no-such-method", *TASK], "unknown method 'no-such-method'"),
    (["run", "fedavgg"], "unknown method 'fedavgg' (did you mean 'fedavg'?); registered methods: "),  # issue 61
    (["run", "fedavg", "--pretrained", "/does/not/exist.pt"], "--pretrained: weights file '/does/not/exist.pt'"),
    (["compare", "fedavg", "fedprox", "--pretrained", "/does/not/exist.pt"], "not found"),
    (["compare", "fedprox", "fedavg", "--set", "method.mu=0.1"], "method 'fedavg': unknown option(s) mu"),
    (["run", "fedavg", "--data", "medmnist:/does/not/exist.npz"], "/does/not/exist.npz"),
    (["export", "fedavg", "--data", "medmnist:/does/not/exist.npz"], "/does/not/exist.npz"),
    (["run", "fedavg", "--data", "nonsense:x"], "synthetic"),
    (["run", "fedavg", "--data", "synthetic:classes=3", "--set", "task.num_classes=2"], "classes=3"),
    (["run", "fedavg", "--data", "synthetic:channels=3", "--set", "task.in_channels=1"], "task.in_channels=1"),
    (["run", "fedavg", "--data", "synthetic:n=100", "--clients", "40", "--partition", "dirichlet:0.01"], "site"),
    (["export", "fedavg"], "task.num_classes"),
])
def test_command_specific_bad_input(args: list[str], expected: str, tmp_path: Path, capsys) -> None:
    out_option = ["-o"] if args[0] == "export" else ["--out"]
    code, out, err = run_cli(args + out_option + [str(tmp_path / "out")], capsys)
    assert (code, out) == (2, "")
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_compare_checks_every_method_before_running_any(tmp_path: Path, monkeypatch, capsys) -> None:
    import medflare.console.simulate as simulate_module

    started = []
    monkeypatch.setattr(simulate_module, "run_simulation", lambda run, *a, **k: started.append(run.method))
    code, _, err = run_cli(["compare", "fedprox", "moon", "--set", "method.temperature=hot",
                            "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "method 'fedprox': unknown option(s) temperature" in err
    assert started == []


def test_npz_with_fractional_labels_is_refused(tmp_path: Path, capsys) -> None:
    images = np.zeros((10, 8, 8), np.uint8)
    labels = np.array([0, 1, 0.7, 1, 0, 1, 0, 1, 0, 1], np.float32).reshape(-1, 1)
    arrays = {f"{s}_{k}": v for s in ("train", "val", "test") for k, v in (("images", images), ("labels", labels))}
    np.savez(tmp_path / "float_labels.npz", **arrays)
    code, _, err = run_cli(["run", "fedavg", "--data", f"medmnist:{tmp_path / 'float_labels.npz'}",
                            "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "train_labels[2] is 0.7" in err
    assert not (tmp_path / "out").exists()


def test_label_out_of_range_names_the_file(tmp_path: Path, capsys) -> None:
    manifest = write_png_dataset(tmp_path, [0, 1, 0, 1, 7, 0, 1, 0, 1, 0])
    code, _, err = run_cli(["run", "fedavg", "--data", f"csv:{manifest}", "--set", "task.num_classes=2",
                            "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "7" in err and "manifest.csv" in err


def test_corrupt_image_names_the_file(tmp_path: Path, capsys) -> None:
    manifest = write_png_dataset(tmp_path, [0, 1] * 10, corrupt=3)
    code, _, err = run_cli(["run", "fedavg", "--data", f"csv:{manifest}", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "img3.png" in err


# ----- what the user sets reaches the job, typed --------------------------------------------------------


def test_set_values_reach_the_job_typed(tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(["export", "fedprox", *TASK, "--set", "train.lr=0.01", "--set", "train.nesterov=true",
                            "--set", "method.mu=0.1", "--set", "data.label_noise=0.2", "--set", "rounds=4",
                            "--set", "stream_aggregation=true",
                            "--data", "synthetic:classes=2,channels=1", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    plan = plan_from_job(tmp_path / "fedprox")
    assert all((site.train.lr, site.train.nesterov) == (0.01, True) for site in plan.sites)
    assert plan.method_args["mu"] == 0.1
    assert plan.data["label_noise"] == 0.2 and isinstance(plan.data["label_noise"], float)
    assert len(plan.rounds) == 4 and plan.stream_aggregation is True


def test_export_defaults_to_site_local_data(tmp_path: Path, capsys) -> None:
    code, out, _ = run_cli(["export", "fedavg", "-o", str(tmp_path), *TASK], capsys)
    assert code == 0 and "medflare_site.json" in out
    assert plan_from_job(tmp_path / "fedavg").data == {"source": "site"}


def test_partition_alone_keeps_the_default_data_source(tmp_path: Path, capsys) -> None:
    code, _, err = run_cli(["export", "fedavg", "--partition", "dirichlet:0.5", "--set", "data.seed=3",
                            "--set", "data.source=synthetic", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    data = plan_from_job(tmp_path / "fedavg").data
    assert (data["source"], data["partition"], data["seed"]) == ("synthetic", "dirichlet:0.5", 3)


# ----- robust aggregation: on wherever a real deployment is made (issue 26) ------------------------------
@pytest.mark.parametrize("options, expected", [
    ([], DEPLOY_ROBUST),
    (["--set", "robust.max_share=0.4"], {"max_norm_ratio": 10.0, "max_share": 0.4}),  # the user's value wins
    (["--set", "robust.off=true"], ROBUST_OFF),
    (["--set", 'robust={"max_norm_ratio": 0, "max_share": 0}'], ROBUST_OFF),
])
def test_a_preinstalled_export_carries_the_deployment_defences(
    options: list[str], expected: dict, tmp_path: Path, capsys
) -> None:
    code, out, err = run_cli(["export", "fedavg", "--mode", "preinstalled", *TASK, *options, "-o", str(tmp_path)],
                             capsys)
    assert code == 0, err
    on = expected != ROBUST_OFF
    assert written_robust(tmp_path / "fedavg") == (expected, {"on": on, **expected})
    assert f"robust aggregation: {'on' if on else 'off'}" in out


def test_a_byoc_export_with_simulated_data_is_a_simulator_job_without_defences(tmp_path: Path, capsys) -> None:
    code, out, err = run_cli(["export", "fedavg", "--data", "synthetic:n=200", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    assert written_robust(tmp_path / "fedavg") == ({}, {"on": False, **ROBUST_OFF})
    assert "robust aggregation: off" in out


class JobWritten(Exception):
    """Raised right after an environment wrote its job: the test reads the job and nothing is launched."""


def job_written_by(monkeypatch, export_function: str) -> dict:
    """Replace ``export_function`` (a module's name for job_export.write_job) by one that writes the job, records
    what its robust settings are, and stops the command."""
    from medflare.console import job_export

    written: dict = {}

    def export_then_stop(plan, out_dir, mode, *args, **kwargs):
        job = job_export.write_job(plan, out_dir, mode, *args, **kwargs)
        written["robust"], written["record"] = written_robust(job)
        raise JobWritten

    monkeypatch.setattr(export_function, export_then_stop)
    return written


@pytest.mark.parametrize("env, options, expected", [
    ("sim", [], {}),  # research runs aggregate as the papers do
    ("sim", ["--set", "robust.max_share=0.5"], {"max_share": 0.5}),
    ("sim", ["--set", "robust.off=true"], ROBUST_OFF),
    ("poc", [], DEPLOY_ROBUST),  # simulated data and a BYOC job, yet a real (local) deployment
    ("poc", ["--set", "robust.max_share=0.4"], {"max_norm_ratio": 10.0, "max_share": 0.4}),
    ("poc", ["--set", "robust.off=true"], ROBUST_OFF),
])
def test_run_turns_the_defences_on_in_a_poc_and_leaves_the_simulator_as_told(
    env: str, options: list[str], expected: dict, tmp_path: Path, monkeypatch
) -> None:
    from medflare.console.deploy.poc import PocSession

    monkeypatch.setattr(PocSession, "prepare", lambda self, *args, **kwargs: None)  # no POC is provisioned
    written = job_written_by(monkeypatch, "medflare.console.simulate.write_job" if env == "sim"
                             else "medflare.console.deploy.poc.write_job")
    with pytest.raises(JobWritten):
        main(["run", "fedavg", "--env", env, "--data", "synthetic:n=200", "--rounds", "1", *options,
              "--out", str(tmp_path / "out")])
    assert written["robust"] == expected
    assert written["record"] == {"on": bool(any(expected.values())), **ROBUST_OFF, **expected}


def test_a_job_submitted_to_a_poc_gets_the_deployment_defences(tmp_path: Path, monkeypatch) -> None:
    from medflare.console.deploy.poc import main as poc_main

    written = job_written_by(monkeypatch, "medflare.console.deploy.poc.write_job")
    with pytest.raises(JobWritten):
        poc_main(["--root", str(tmp_path), "submit", "fedavg", "--data", "synthetic:n=200", "--rounds", "1"])
    assert written["robust"] == DEPLOY_ROBUST


def test_flags_merge_with_the_defaults_not_replace_them() -> None:
    from medflare.console.cli import make_parser
    from medflare.console.run_options import build_run_config

    run = build_run_config(make_parser().parse_args(["run", "fedavg", "--partition", "dirichlet:0.5", "--lr", "0.1"]))
    assert run.data == {"source": RunConfig().data["source"], "partition": "dirichlet:0.5"}
    assert run.train == {"lr": 0.1}


@pytest.mark.parametrize("method,model", [("fed-mae", "vit_tiny"), ("fca", "efficientnet_lite0"), ("fedavg", "cnn")])
def test_without_model_a_command_trains_the_methods_default_model(method: str, model: str) -> None:
    from medflare.console.cli import make_parser
    from medflare.console.run_options import build_run_config

    assert validated(build_run_config(make_parser().parse_args(["run", method])), check_files=False).model == model
    chosen = validated(build_run_config(make_parser().parse_args(["run", method, "--model", "vit_micro"])),
                       check_files=False)
    assert chosen.model == "vit_micro"


# ----- report reads the job's config beside the results ------------------------------------------------
def fake_results(method: str, rounds: int) -> dict:
    """A results file shaped like the controller's (two sites, ``rounds`` rounds)."""
    metrics = {"accuracy": 0.5, "balanced_accuracy": 0.5, "macro_f1": 0.4, "auc_macro_ovr": 0.6}
    records = [{"round": r, "started_at": 1000.0 + 10 * r, "wall_seconds": 9.0, "share": {"site-1": 0.5, "site-2": 0.5},
                "sites": {s: {"n_samples": 50, "train_loss": 0.7} for s in ("site-1", "site-2")},
                "payload": {}} for r in range(rounds)]
    evaluations = {str(r): {"test": metrics, "val": metrics} for r in range(rounds + 1)}
    return {"method": method, "controller_started_at": 990.0, "rounds": records, "evaluations": evaluations,
            "finished_at": 1000.0 + 10 * rounds}


def downloaded_job(tmp_path: Path, run: RunConfig) -> Path:
    """A job laid out as `nvflare job download` leaves it: <id>/workspace/app_server/{config,results}."""
    run = validated(run)
    job = write_run_job(run, tmp_path / "export", task_of(run), mode="preinstalled")
    app_server = tmp_path / "download" / "job-id" / "workspace" / "app_server"
    (app_server / "config").mkdir(parents=True)
    for name in ("config_fed_server.json", "config_fed_client.json", PLAN_FILE):
        (app_server / "config" / name).write_text((job / "app" / "config" / name).read_text())
    (app_server.parent / "meta.json").write_text((job / "meta.json").read_text())
    (app_server / "medflare_results.json").write_text(json.dumps(fake_results(run.method, run.rounds)))
    (app_server / "FL_global_model.pt").write_bytes(b"FLARE's model")
    return app_server


def test_report_on_a_downloaded_job_reads_its_config(tmp_path: Path, capsys) -> None:
    run = RunConfig(method="fedprox", rounds=2, clients=2, seed=7, model="cnn", name="trial-7",
                    data={"source": "synthetic:n=200", "partition": "dirichlet:0.5"}, train={"lr": 0.01},
                    method_args={"mu": 0.1})
    app_server = downloaded_job(tmp_path, run)
    code, out, err = run_cli(["report", str(app_server / "medflare_results.json")], capsys)
    assert code == 0, err
    config = json.loads((app_server / "summary.json").read_text())["config"]
    assert (config["data"]["source"], config["data"]["partition"]) == ("synthetic:n=200", "dirichlet:0.5")
    assert (config["seed"], config["clients"], config["rounds"], config["name"]) == (7, 2, 2, "trial-7")
    assert config["method_args"]["mu"] == 0.1 and config["train_resolved"]["lr"] == 0.01
    report = (app_server / "report.md").read_text()
    assert "`synthetic:n=200` partition `dirichlet:0.5`" in report and "seed 7" in report
    assert "start-up 10.0 s" in report and "start-up 10.0 s" in out  # first round start - server app start
    assert (app_server / "FL_global_model.pt").read_bytes() == b"FLARE's model"
    assert run_cli(["report", str(app_server), "-o", str(tmp_path / "elsewhere")], capsys)[0] == 0
    assert (tmp_path / "elsewhere" / "FL_global_model.pt").read_bytes() == b"FLARE's model"


def test_report_never_replaces_files_it_did_not_write(tmp_path: Path, capsys) -> None:
    app_server = downloaded_job(tmp_path, RunConfig(method="fedavg", rounds=1, data={"source": "synthetic:n=200"}))
    (app_server / "report.md").write_text("my notes")
    code, _, err = run_cli(["report", str(app_server)], capsys)
    assert code == 2 and "report.md was not written by medflare" in err
    assert (app_server / "report.md").read_text() == "my notes"
    (app_server / "report.md").unlink()
    assert run_cli(["report", str(app_server)], capsys)[0] == 0
    assert run_cli(["report", str(app_server)], capsys)[0] == 0  # its own earlier report is replaced


def with_server_plan(app_server: Path, plan: str) -> None:
    """The results as a server writes them: with the fingerprint of the plan it ran."""
    results = json.loads((app_server / "medflare_results.json").read_text())
    (app_server / "medflare_results.json").write_text(json.dumps({**results, "plan": plan}))


def test_a_report_checks_the_job_config_beside_the_results_against_the_plan_the_server_ran(
    tmp_path: Path, capsys
) -> None:


    run = RunConfig(method="fedprox", rounds=2, data={"source": "synthetic:n=200"}, train={"lr": 0.01})
    app_server = downloaded_job(tmp_path, run)
    ran = plan_from_job(tmp_path / "export" / "fedprox")
    with_server_plan(app_server, ran.digest())
    assert run_cli(["report", str(app_server), "-o", str(tmp_path / "r")], capsys)[0] == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert (summary["plan"], summary["plan_check"]) == (ran.digest(), "matches")
    assert "resolves to the same plan" in (tmp_path / "r" / "report.md").read_text()

    plan_file = app_server / "config" / PLAN_FILE  # edited after the run: another patience
    record = json.loads(plan_file.read_text())
    record["plan"]["patience"] = 5
    plan_file.write_text(json.dumps(record))
    code, out, err = run_cli(["report", str(app_server), "-o", str(tmp_path / "r2")], capsys)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert f"the server ran plan {ran.digest()}" in err and "changed after the run?" in err
    assert not (tmp_path / "r2").exists()
    with_server_plan(app_server, {"not": "a fingerprint"})  # a results file edited too: one line, no report
    code, out, err = run_cli(["report", str(app_server), "-o", str(tmp_path / "r3")], capsys)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1 and "plan" in err, err
    assert not (tmp_path / "r3").exists()


def test_results_from_before_the_server_recorded_its_plan_are_reported_unchecked(tmp_path: Path) -> None:
    app_server = downloaded_job(tmp_path, RunConfig(method="fedavg", rounds=2, data={"source": "synthetic:n=200"}))
    summary = report_from_results(app_server, tmp_path / "report")
    assert summary["plan_check"] == "unknown" and "resolves to" not in (tmp_path / "report" / "report.md").read_text()


def test_a_run_whose_server_ran_another_plan_keeps_its_outputs_and_says_so(tmp_path: Path) -> None:
    from medflare.console.launch import results_text, write_job_outputs
    from medflare.plan import resolve

    run = RunConfig(method="fedavg", rounds=2, data={"source": "synthetic:n=200"})
    run = validated(run)
    app_server = downloaded_job(tmp_path, run)
    with_server_plan(app_server, "0123456789ab")
    summary = write_job_outputs(resolve(run, "byoc"), app_server / "medflare_results.json",
                                tmp_path / "out", {}, None)
    assert summary["plan_check"].startswith("differs: the server ran plan 0123456789ab")
    assert (tmp_path / "out" / "summary.json").is_file()  # nothing of a finished run is lost
    assert "**warning:** the configuration in `summary.json` (`config`) differs" in (tmp_path / "out" / "report.md").read_text()
    assert "medflare: warning: fedavg: the plan differs" in results_text([summary], tmp_path / "out")


def test_report_on_a_missing_file_is_one_line(tmp_path: Path, capsys) -> None:
    code, out, err = run_cli(["report", str(tmp_path / "nope" / "medflare_results.json")], capsys)
    assert (code, out) == (2, "") and "results file not found" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_downloaded_job_reads_back_the_plan_it_was_written_with(tmp_path: Path) -> None:
    from medflare.console.launch import job_plan_in

    run = RunConfig(method="fedprox", rounds=4, clients=3, min_clients=2, seed=5, name="x1",
                    data={"source": "synthetic:n=200", "partition": "iid", "label_noise": 0.1},
                    train={"lr": 0.02}, method_args={"mu": 0.3}, site_train={"site-2": {"batch_size": 16}},
                    site_evaluation="final", straggler_seconds=30, task_timeout=60, task_request_interval=0.5)
    app_server = downloaded_job(tmp_path, run)
    assert job_plan_in(app_server) == plan_from_job(tmp_path / "export" / "x1")
    assert job_plan_in(app_server).site("site-2").train.batch_size == 16


def test_a_downloaded_job_reads_back_each_sites_architecture(tmp_path: Path) -> None:
    from medflare.console.launch import job_plan_in

    run = RunConfig(method="local-only", clients=2, data={"source": "synthetic:n=200"},
                    site_model={"site-1": "resnet10"})
    plan = job_plan_in(downloaded_job(tmp_path, run))
    assert (plan.site("site-1").model, plan.site("site-2").model) == ("resnet10", plan.model)


def test_report_reads_a_run_folders_own_job(tmp_path: Path, capsys) -> None:
    """``medflare report runs/x/medflare_results.json``: the config is the run's ``job/<name>/app/``."""
    app_server = downloaded_job(tmp_path, RunConfig(method="fedavg", rounds=2, seed=4, data={"source": "synthetic:n=200"}))
    run_folder = tmp_path / "runs" / "x"
    (run_folder / "job" / "fedavg" / "app").mkdir(parents=True)
    (app_server / "config").rename(run_folder / "job" / "fedavg" / "app" / "config")
    (run_folder / "medflare_results.json").write_text((app_server / "medflare_results.json").read_text())

    code, _, err = run_cli(["report", str(run_folder / "medflare_results.json"), "-o", str(tmp_path / "r")], capsys)

    assert (code, err) == (0, "")
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["config"]["seed"] == 4


def test_report_from_results_is_the_function_behind_the_command(tmp_path: Path) -> None:
    app_server = downloaded_job(tmp_path, RunConfig(method="fedavg", rounds=2, data={"source": "synthetic:n=200"}))
    summary = report_from_results(app_server, tmp_path / "report")
    assert summary["rounds_completed"] == 2 and summary["config"]["data"]["source"] == "synthetic:n=200"


@pytest.mark.parametrize("args, expected", [
    (["run", "mdhfl", "--data", "synthetic"], "method 'mdhfl': its sites distil on an unlabelled public set"),
    (["compare", "fedavg", "fedmd", "--data", "synthetic"], "method 'fedmd': its sites distil"),
    (["run", "fedlsm", "--batch-size", "4"], "method 'fedlsm': train.batch_size at site-1, site-2 leaves no"),
    (["run", "fedmas", "--set", "method.cache_prior_features=true"], "data.augment=basic draws new ones"),
])
def test_a_methods_own_checks_run_before_anything_starts(args: list[str], expected: str, tmp_path: Path,
                                                          capsys) -> None:
    """Issue 27: each of these launched FLARE and failed inside the job, at the sites' first task."""
    code, out, err = run_cli(args + ["--out", str(tmp_path / "out")], capsys)
    assert (code, out) == (2, "")
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, expected", [
    (["report", "/"], "-o / is the top of the file system"),
    (["export", "fedavg", *TASK, "-o", "{tmp}/afile/sub"], "lies below {tmp}/afile, which is a file, not a folder"),
    (["run", "fedavg", "--out", "{tmp}/afile/sub"], "lies below {tmp}/afile, which is a file, not a folder"),
])
def test_an_output_folder_that_cannot_be_one_is_one_line(args: list[str], expected: str, tmp_path: Path,
                                                          capsys) -> None:
    """Issue 27: a ValueError ('has an empty name') and a 15-line NotADirectoryError before."""
    (tmp_path / "afile").write_text("mine")
    code, out, err = run_cli([a.format(tmp=tmp_path) for a in args], capsys)
    assert (code, out) == (2, "")
    assert expected.format(tmp=tmp_path) in err and len(err.strip().splitlines()) == 1, err
    assert [p.name for p in tmp_path.iterdir()] == ["afile"] and (tmp_path / "afile").read_text() == "mine"
