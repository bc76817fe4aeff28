"""Result folders: medflare never deletes or replaces a file it did not write.

The simulator itself is replaced by a fake that leaves a results file where FLARE's server would, so these
tests run the real ``medflare run``/``compare``/``export`` paths (export, outputs, publishing) in seconds.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import medflare.console.simulate as simulate_module
from medflare.console.cli import main
from medflare.console.files import MARKER, OutputTarget
from medflare.console.launch import first_site_error
from medflare.errors import ConfigError
from medflare.flare.controller import RESULTS_FILE
from medflare.plan import plan_from_job

QUICK = ["--data", "synthetic:n=200", "--rounds", "2"]
TASK = ["--set", "task.num_classes=2", "--set", "task.in_channels=1", "--set", "task.image_size=28"]


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def results(rounds: int, extra_key: str | None, method: str = "fedavg") -> dict:
    metrics = {"accuracy": 0.5, "balanced_accuracy": 0.5, "macro_f1": 0.4, "auc_macro_ovr": 0.6}
    records = [{"round": r, "started_at": 100.0 + r, "wall_seconds": 1.0, "share": {"site-1": 0.5, "site-2": 0.5},
                "sites": {}, "payload": {}} for r in range(rounds)]
    if extra_key:  # a method extra such as Fed-MAS's RF: the report draws <key>.png for it
        for record in records:
            record[extra_key] = {"site-1": 1.0, "site-2": 2.0}
    return {"method": method, "rounds": records, "finished_at": 200.0,
            "evaluations": {str(r): {"test": metrics, "val": metrics} for r in range(rounds + 1)}}


@pytest.fixture
def fake_simulator(monkeypatch):
    """Replace ``nvflare simulator``: write the server's results file (and a log) as FLARE would."""
    calls = {"extra_key": None, "fail": False}

    def launch(sites, job_dir, workspace, log_path, echo):
        plan = plan_from_job(job_dir)  # what the simulator runs: the job
        log_path.write_text("simulator log: round 1 done\n")
        app = workspace / "server" / "simulate_job" / "app_server"
        app.mkdir(parents=True)
        (app / RESULTS_FILE).write_text(json.dumps(results(len(plan.rounds), calls["extra_key"], plan.method)))
        (app / "FL_global_model.pt").write_bytes(b"model")
        if calls["fail"]:
            raise simulate_module.SimulationError("nvflare simulator exited with code 1")

    monkeypatch.setattr(simulate_module, "_launch", launch)
    return calls


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def user_folder(path: Path) -> dict[str, bytes]:
    """A folder of the user's own files, including names medflare also writes into subfolders."""
    (path / "data").mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    (path / "data" / "images.npz").write_bytes(b"\x00\x01")
    (path / "job").mkdir()
    (path / "job" / "my_job_notes.md").write_text("mine too")
    return tree(path)


def test_run_refuses_a_non_empty_out_and_touches_nothing(tmp_path: Path, fake_simulator, capsys) -> None:
    before = user_folder(tmp_path / "mine")
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(tmp_path / "mine")], capsys)
    assert code == 2 and "is not empty" in out and "--overwrite" in out
    assert tree(tmp_path / "mine") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_run_refuses_the_current_folder(tmp_path: Path, fake_simulator, capsys, monkeypatch) -> None:
    before = user_folder(tmp_path / "project")
    monkeypatch.chdir(tmp_path / "project")
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", "."], capsys)
    assert code == 2 and "is not empty" in out
    assert tree(tmp_path / "project") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]


@pytest.mark.parametrize("command", [["run", "fedavg"], ["compare", "fedavg", "fedprox"]])
def test_out_pointing_at_a_file_is_refused_before_training(command, tmp_path: Path, fake_simulator, capsys) -> None:
    (tmp_path / "results.txt").write_text("mine")
    code, out = run_cli([*command, *QUICK, "--out", str(tmp_path / "results.txt")], capsys)
    assert code == 2 and "is a file, not a folder" in out
    assert tree(tmp_path) == {"results.txt": b"mine"}


def test_overwrite_keeps_every_user_file(tmp_path: Path, fake_simulator, capsys) -> None:
    out_dir = tmp_path / "mine"
    before = user_folder(out_dir)
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir), "--overwrite"], capsys)
    assert code == 0, out
    after = tree(out_dir)
    assert {name: after[name] for name in before} == before
    written = json.loads((out_dir / MARKER).read_text())["files"]
    assert {"summary.json", "report.md", "FL_global_model.pt", "job/fedavg/meta.json"} <= set(written)
    assert not set(written) & set(before)
    assert set(after) == set(before) | set(written) | {MARKER}


def test_overwrite_replaces_only_medflare_files_of_the_earlier_run(tmp_path: Path, fake_simulator, capsys) -> None:
    out_dir = tmp_path / "run"
    fake_simulator["extra_key"] = "rf"
    assert run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir)], capsys)[0] == 0
    assert (out_dir / "rf.png").is_file()
    (out_dir / "my_analysis.ipynb").write_text("mine")
    assert run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir)], capsys)[0] == 2  # not empty any more
    fake_simulator["extra_key"] = None
    assert run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir), "--overwrite"], capsys)[0] == 0
    assert not (out_dir / "rf.png").exists()  # the earlier run's file, not written again: removed
    assert (out_dir / "my_analysis.ipynb").read_text() == "mine"
    assert (out_dir / "summary.json").is_file()


def test_a_result_never_replaces_a_user_file_of_the_same_name(tmp_path: Path, fake_simulator, capsys) -> None:
    out_dir = tmp_path / "mine"
    out_dir.mkdir()
    (out_dir / "report.md").write_text("my report")
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir), "--overwrite"], capsys)
    assert code == 2 and "report.md was not written by medflare" in out
    assert (out_dir / "report.md").read_text() == "my report"
    assert (tmp_path / "mine.partial" / "summary.json").is_file()  # the finished results are kept, not lost


def test_a_failed_run_leaves_only_its_log(tmp_path: Path, fake_simulator, capsys) -> None:
    fake_simulator["fail"] = True
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "exited with code 1" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.failed.log"]
    log = (tmp_path / "out.failed.log").read_text()
    assert "simulator log: round 1 done" in log and "rounds finished: 2/2" in log


def test_a_staging_folder_medflare_did_not_make_is_refused(tmp_path: Path, fake_simulator, capsys) -> None:
    before = user_folder(tmp_path / "out.partial")
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "was not made by medflare" in out
    assert tree(tmp_path / "out.partial") == before


def test_compare_overwrite_keeps_user_files(tmp_path: Path, fake_simulator, capsys) -> None:
    out_dir = tmp_path / "cmp"
    before = user_folder(out_dir)
    code, out = run_cli(["compare", "fedavg", "fedprox", *QUICK, "--out", str(out_dir), "--overwrite"], capsys)
    assert code == 0, out
    after = tree(out_dir)
    assert {name: after[name] for name in before} == before
    assert {"comparison.md", "fedavg/summary.json", "fedprox/summary.json"} <= set(after)


def test_compare_with_seeds_prints_mean_and_std_and_keeps_every_run(tmp_path: Path, fake_simulator, capsys) -> None:
    out_dir = tmp_path / "cmp"
    code, out = run_cli(["compare", "fedavg", "fedprox", *QUICK, "--seeds", "0", "1", "2", "--out", str(out_dir)],
                        capsys)
    assert code == 0, out
    assert "| fedavg | 3 | 2 | 0.5000 ± 0.0000 | 0.5000 ± 0.0000 |" in out
    assert "no difference (gap 0.0000 ≤ 1 std 0.0000)" in out
    runs = {p.parent.relative_to(out_dir).as_posix() for p in out_dir.rglob("summary.json")}
    assert runs == {f"{m}/seed{s}" for m in ("fedavg", "fedprox") for s in (0, 1, 2)}
    assert [json.loads((out_dir / r / "summary.json").read_text())["config"]["seed"] for r in sorted(runs)] == [0, 1, 2] * 2
    comparison = (out_dir / "comparison.md").read_text()
    assert "over 3 seed(s)" in comparison and "| fedprox | 2 | 2 |" in comparison  # every run: method, seed, rounds


def test_report_on_a_run_folder_gives_the_start_up_the_run_printed(tmp_path: Path, fake_simulator, monkeypatch,
                                                                    capsys) -> None:
    """The run counts start-up from launching FLARE; the report used to count from the server app's start
    (1.2 s where the run printed 17.1 s)."""
    monkeypatch.setattr(simulate_module, "time", SimpleNamespace(time=lambda: 1000.0))  # medflare launches FLARE
    launch = simulate_module._launch

    def launch_then_start_the_server(run, job_dir, workspace, log_path, echo) -> None:
        launch(run, job_dir, workspace, log_path, echo)
        results_file = workspace / "server" / "simulate_job" / "app_server" / RESULTS_FILE
        written = json.loads(results_file.read_text())
        for index, record in enumerate(written["rounds"]):
            record["started_at"] = 1017.1 + 10 * index
        written["controller_started_at"] = 1015.9  # FLARE's own start-up came first
        results_file.write_text(json.dumps(written))

    monkeypatch.setattr(simulate_module, "_launch", launch_then_start_the_server)
    run_folder = tmp_path / "run"
    code, printed = run_cli(["run", "fedavg", *QUICK, "--out", str(run_folder)], capsys)
    assert code == 0 and "start-up 17.1 s," in printed, printed
    assert "start-up 17.1 s" in (run_folder / "report.md").read_text()

    code, reported = run_cli(["report", str(run_folder)], capsys)
    assert code == 0 and "start-up 17.1 s," in reported, reported
    assert "start-up 17.1 s" in (run_folder / "report.md").read_text()
    assert json.loads((run_folder / "summary.json").read_text())["timing"]["startup_seconds"] == pytest.approx(17.1)


def test_export_never_deletes_an_existing_folder_it_did_not_write(tmp_path: Path, capsys) -> None:
    jobs = tmp_path / "jobs"
    before = user_folder(jobs / "fedavg")
    code, out = run_cli(["export", "fedavg", *TASK, "-o", str(jobs)], capsys)
    assert code == 2 and "already exists" in out and tree(jobs / "fedavg") == before
    code, out = run_cli(["export", "fedavg", *TASK, "-o", str(jobs), "--overwrite"], capsys)
    assert code == 0, out
    after = tree(jobs / "fedavg")
    assert {name: after[name] for name in before} == before and "meta.json" in after


def test_export_replaces_its_own_job_and_leaves_the_others(tmp_path: Path, capsys) -> None:
    jobs = tmp_path / "jobs"
    user_folder(jobs / "their-job")
    other = tree(jobs / "their-job")
    assert run_cli(["export", "fedavg", *TASK, "-o", str(jobs), "--mode", "byoc"], capsys)[0] == 0
    assert (jobs / "fedavg" / "app" / "custom" / "medflare").is_dir()
    again = ["export", "fedavg", *TASK, "-o", str(jobs), "--mode", "preinstalled", "--overwrite"]
    assert run_cli(again, capsys)[0] == 0
    assert not (jobs / "fedavg" / "app" / "custom").exists()  # the byoc copy was medflare's: gone
    assert tree(jobs / "their-job") == other
    assert not (jobs / "fedavg" / MARKER).exists()  # the job folder stays exactly what FLARE gets


@pytest.mark.parametrize("name", ["{tmp}/victim", "../outside", "..", "a/b"])
def test_export_names_never_leave_the_output_folder(name: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "jobs").mkdir()
    name = name.format(tmp=tmp_path)
    code, out = run_cli(["export", "fedavg", *TASK, "--set", f"name={name}", "-o", str(tmp_path / "jobs")], capsys)
    assert code == 2 and "plain job name" in out
    assert tree(tmp_path) == {}


@pytest.mark.parametrize("unit", ["/elsewhere", "../outside", "..", "a/b", "."])
def test_an_output_unit_is_one_folder_inside_its_root(unit: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one folder name"):
        OutputTarget(tmp_path / "jobs", unit=unit)


def test_unreadable_marker_vouches_for_nothing(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "summary.json").write_text("mine")
    (out_dir / MARKER).write_text("not json")
    target = OutputTarget(out_dir, overwrite=True)
    staging = target.begin()
    (staging / "summary.json").write_text("new")
    with pytest.raises(Exception, match="not written by medflare"):
        target.publish()
    assert (out_dir / "summary.json").read_text() == "mine"
    assert os.listdir(staging)  # kept for the user


def test_a_poc_run_keeps_its_own_jobs_site_logs_only(tmp_path: Path) -> None:
    from medflare.console.launch import SITE_FLARE_LOG, keep_site_logs

    kits = tmp_path / "prod_00"
    for job, text in (("job-a", "this job"), ("job-b", "an earlier job")):
        app = kits / "site-1" / job / "app_site-1"
        app.mkdir(parents=True)
        (app / "medflare_site_log.jsonl").write_text(text)
        (kits / "site-1" / job / "log.txt").write_text(f"FLARE log of {text}")
    (kits / "site-1" / "log.txt").write_text("the site's parent process")
    out = tmp_path / "out"
    keep_site_logs(kits, out, "job-a")
    kept = out / "sites" / "site-1"
    assert sorted(p.name for p in kept.iterdir()) == sorted(["medflare_site_log.jsonl", SITE_FLARE_LOG])
    assert (kept / "medflare_site_log.jsonl").read_text() == "this job"
    assert (kept / SITE_FLARE_LOG).read_text() == "FLARE log of this job"


# ----- issue 27: paths confined to the folder, one writer at a time, a full disk -------------------------------
def victims(tmp_path: Path) -> dict[Path, str]:
    """A user's files outside any result folder, as a tampered marker would name them."""
    files = {tmp_path / "home" / "thesis.tex": "my thesis", tmp_path / "abs.txt": "mine"}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files


def add_to_marker(folder: Path, *entries: str) -> None:
    marker = json.loads((folder / MARKER).read_text())
    marker["files"] += list(entries)
    (folder / MARKER).write_text(json.dumps(marker))


def test_export_overwrite_never_deletes_what_a_marker_names_outside(tmp_path: Path, capsys) -> None:
    files = victims(tmp_path)
    jobs = tmp_path / "jobs"
    assert run_cli(["export", "fedavg", *TASK, "-o", str(jobs)], capsys)[0] == 0
    add_to_marker(jobs, "fedavg/../../home/thesis.tex", str(tmp_path / "abs.txt"))
    before = tree(jobs)
    code, out = run_cli(["export", "fedavg", *TASK, "-o", str(jobs), "--overwrite"], capsys)
    assert code == 2 and "which is outside" in out and len(out.strip().splitlines()) == 1, out
    assert all(path.read_text() == text for path, text in files.items())
    assert tree(jobs) == before and not (tmp_path / "jobs.lock").exists()


@pytest.mark.parametrize("entry", ["../home/thesis.tex", "{tmp}/abs.txt"])
def test_run_overwrite_never_deletes_what_a_marker_names_outside(entry: str, tmp_path: Path, fake_simulator,
                                                                 capsys) -> None:
    files = victims(tmp_path)
    out_dir = tmp_path / "run"
    assert run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir)], capsys)[0] == 0
    add_to_marker(out_dir, entry.format(tmp=tmp_path))
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir), "--overwrite"], capsys)
    assert code == 2 and "which is outside" in out, out
    assert all(path.read_text() == text for path, text in files.items())
    assert (out_dir / "summary.json").is_file() and not (tmp_path / "run.partial").exists()


def test_overwrite_never_follows_a_symlinked_folder_out(tmp_path: Path, fake_simulator, capsys) -> None:
    """The marker's ``job/fedavg/meta.json`` is fine as a name, but ``job`` now leads elsewhere."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "fedavg").mkdir(parents=True)
    (elsewhere / "fedavg" / "meta.json").write_text("mine")
    out_dir = tmp_path / "run"
    assert run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir)], capsys)[0] == 0
    shutil.rmtree(out_dir / "job")
    (out_dir / "job").symlink_to(elsewhere)
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir), "--overwrite"], capsys)
    assert code == 2 and "symlink" in out, out
    assert (elsewhere / "fedavg" / "meta.json").read_text() == "mine"


def test_a_second_run_into_the_same_out_is_one_line_naming_the_first(tmp_path: Path, fake_simulator, capsys,
                                                                    monkeypatch) -> None:
    out_dir = tmp_path / "out"
    launch = simulate_module._launch
    second: list[int] = []

    def launch_with_a_second_run(*args, **kwargs) -> None:
        second.append(main(["run", "fedavg", *QUICK, "--out", str(out_dir), "--overwrite"]))
        launch(*args, **kwargs)

    monkeypatch.setattr(simulate_module, "_launch", launch_with_a_second_run)
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir)], capsys)
    assert code == 0 and second == [2], out
    error = [line for line in out.splitlines() if "error" in line]
    assert error == [f"medflare: error: --out {out_dir} is in use by medflare process {os.getpid()} "
                     f"(lock {tmp_path / 'out.lock'}); wait for it to finish, or choose another --out"]
    assert (out_dir / "summary.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_killed_runs_lock_does_not_block(tmp_path: Path, fake_simulator, capsys) -> None:
    (tmp_path / "out.lock").write_text("medflare process 999999999\n")
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(tmp_path / "out")], capsys)
    assert code == 0, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_full_disk_during_a_run_is_one_line_and_leaves_only_the_log(tmp_path: Path, fake_simulator, capsys,
                                                                       monkeypatch) -> None:
    launch = simulate_module._launch

    def fill_the_disk(run, job_dir, workspace, log_path, echo) -> None:
        launch(run, job_dir, workspace, log_path, echo)
        (workspace / "big.bin").write_bytes(b"x" * 3_000_000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(workspace / "log.txt"))

    monkeypatch.setattr(simulate_module, "_launch", fill_the_disk)
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "no space left to write" in out, out
    assert len([line for line in out.splitlines() if "Traceback" in line or "error" in line]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.failed.log"]
    log = (tmp_path / "out.failed.log").read_text()
    assert "simulator log: round 1 done" in log and "No space left on device" in log


def test_a_really_full_disk_during_a_run_leaves_only_the_log(tiny_disk: Path, fake_simulator, capsys) -> None:
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(tiny_disk / "out")], capsys)
    assert code == 2 and "no space left to write" in out and "Traceback" not in out, out
    assert [p.name for p in tiny_disk.iterdir()] == ["out.failed.log"]
    assert "No space left on device" in (tiny_disk / "out.failed.log").read_text()


def test_a_marker_nested_too_deep_vouches_for_nothing(tmp_path: Path) -> None:
    """A crafted `.medflare-outputs.json` nested 100,000 deep was an uncaught RecursionError under --overwrite; it
    now vouches for nothing, so nothing is removed."""
    from medflare.console.files import MARKER, read_marker as _read_marker

    (tmp_path / MARKER).write_text("[" * 100_000 + "]" * 100_000)
    assert _read_marker(tmp_path) == []


def test_the_first_site_error_is_the_earliest_sites_line_whole(tmp_path: Path) -> None:
    """A site's error reached the console cut to its last 200 characters, behind a generic "only 0 site(s) sent a
    valid result" (issue 48, item 6): the run's message now carries the earliest site's own line, from its name."""
    why = ("data.window 'brain' applies to DICOM and NIfTI files, but /data/xray/normal/img_001.png is a PNG; remove "
           "data.window from the job or give this site DICOM images " + "x" * 200)
    prefix = "2026-11-28 18:00:0{} - MedflareExecutor - ERROR - [identity={}, run=simulate_job]: "
    logs = {"site-1": f"{prefix.format(5, 'site-1')}site-1: task 'train' crashed: boom\nTraceback (most recent)\n",
            "site-2": f"{prefix.format(3, 'site-2')}site-2: task 'train' failed: {why}\n"}
    assert first_site_error(tmp_path) is None
    for site, text in logs.items():
        (tmp_path / site / "simulate_job").mkdir(parents=True)
        (tmp_path / site / "log.txt").write_text("2026-11-28 17:59:59 - INFO - started\n" + text)
    assert first_site_error(tmp_path) == f"site-2: task 'train' failed: {why}"


def test_overwrite_keeps_a_file_whose_content_changed_since_medflare_wrote_it(tmp_path: Path, fake_simulator,
                                                                              capsys) -> None:
    """Issue 49, item 5: a deletion checks the content medflare recorded, not the name. A user who put their own
    text in medflare's report.md (same name) keeps it: --overwrite refuses to replace it, and an earlier result that
    is not written again is removed only while it holds what medflare wrote."""
    out_dir = tmp_path / "run"
    fake_simulator["extra_key"] = "rf"
    assert run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir)], capsys)[0] == 0
    marker = json.loads((out_dir / MARKER).read_text())
    assert set(marker["sha256"]) == set(marker["files"]) and all(len(d) == 64 for d in marker["sha256"].values())
    (out_dir / "rf.png").write_bytes(b"my own picture")  # medflare's name, someone's content now
    fake_simulator["extra_key"] = None
    assert run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir), "--overwrite"], capsys)[0] == 0
    assert (out_dir / "rf.png").read_bytes() == b"my own picture"  # not written again, and changed: kept
    (out_dir / "report.md").write_text("my notes")
    code, out = run_cli(["run", "fedavg", *QUICK, "--out", str(out_dir), "--overwrite"], capsys)
    assert code == 2 and "report.md was not written by medflare (or changed since it was)" in out
    assert (out_dir / "report.md").read_text() == "my notes"


def test_a_marker_without_digests_vouches_for_no_deletion(tmp_path: Path) -> None:
    from medflare.console.files import remove_recorded

    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "meta.json").write_text("{}")
    (tmp_path / MARKER).write_text(json.dumps({"written_by": "medflare", "files": ["job/meta.json"]}))
    assert remove_recorded(tmp_path, "job") == ["job/meta.json"]  # an older marker names it; nothing proves content
    assert (tmp_path / "job" / "meta.json").read_text() == "{}"
