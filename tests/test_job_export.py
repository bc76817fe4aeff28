"""The FLARE job folder every environment gets: defaults that keep a dead site from hanging a job or one site from
taking over the aggregate, and resuming."""

import dataclasses
import json
from pathlib import Path

import pytest

from medflare.console.deploy.apps import deployment_run
from medflare.console.job_export import set_resume
from medflare.plan import APP_NAME, DEFAULT_TASK_TIMEOUT, PLAN_FILE, plan_from_job, read_plan, resolve
from medflare.run_config import RunConfig
from medflare.server_setup import DEPLOY_ROBUST, ROBUST_OFF
from medflare.site_config import TaskSpec

from ._plans import write_run_job

TASK = TaskSpec(num_classes=2, in_channels=1, image_size=28)
SITE_DATA = {"source": "site"}
SIMULATED = {"source": "synthetic:n=200"}


def test_stream_aggregation_is_off_unless_the_run_turns_it_on() -> None:
    assert resolve(RunConfig(), task=TASK).stream_aggregation is False
    assert resolve(RunConfig(stream_aggregation=True), task=TASK).stream_aggregation is True


def test_every_task_has_a_timeout_unless_the_run_sets_one() -> None:
    assert DEFAULT_TASK_TIMEOUT > 0
    assert resolve(RunConfig(), task=TASK).task_timeout == DEFAULT_TASK_TIMEOUT
    assert resolve(RunConfig(task_timeout=120), task=TASK).task_timeout == 120


def test_deployment_jobs_go_on_without_one_site() -> None:
    run = deployment_run("fedavg")
    assert 2 <= resolve(run, task=TASK).min_clients < run.clients  # never one hospital's update alone


def test_set_resume_names_the_crashed_job_in_the_plan(tmp_path: Path) -> None:
    job = write_run_job(RunConfig(data={"source": "site"}, task=dict(vars(TASK))), tmp_path, TASK, mode="preinstalled")
    before = plan_from_job(job)
    set_resume(job, "0b6e1c4e-4a0e-4d43-9a53-7f0f3c7c1e11")
    assert plan_from_job(job) == dataclasses.replace(before, resume_from="0b6e1c4e-4a0e-4d43-9a53-7f0f3c7c1e11")
    loaded, written = read_plan(job / APP_NAME / "config" / PLAN_FILE)
    assert written == loaded.digest()  # rewritten by medflare: not an edit


def written_robust(job: Path) -> tuple[dict, dict]:
    """(the robust settings of a written job's plan, meta.json's robust record or None)."""
    return plan_from_job(job).robust, json.loads((job / "meta.json").read_text()).get("robust_aggregation")


@pytest.mark.parametrize("mode, data, deployed", [
    ("preinstalled", SITE_DATA, True),
    ("preinstalled", SIMULATED, True),  # cannot run in the simulator: only a POC or production runs it
    ("byoc", SITE_DATA, True),  # a BYOC consortium's job
    ("byoc", SIMULATED, False),  # the simulator's job: research runs aggregate as the papers do
])
def test_every_job_but_a_simulator_job_gets_the_deployment_defences(
    mode: str, data: dict, deployed: bool, tmp_path: Path
) -> None:
    run = RunConfig(data=data)
    robust, record = written_robust(write_run_job(run, tmp_path, TASK, mode=mode))
    assert robust == (DEPLOY_ROBUST if deployed else {})
    assert record == {"on": deployed, **(DEPLOY_ROBUST if deployed else ROBUST_OFF)}
    assert run.robust == {}  # the caller's run is left as it was


@pytest.mark.parametrize("own, expected", [
    ({"max_share": 0.4}, {"max_norm_ratio": 10.0, "max_share": 0.4}),  # the other defence stays on
    ({"max_norm_ratio": "3", "max_share": 0.5}, {"max_norm_ratio": 3.0, "max_share": 0.5}),
    ({"max_norm_ratio": 0}, {"max_norm_ratio": 0.0, "max_share": 0.6}),  # one defence off, said explicitly
    ({"off": False}, DEPLOY_ROBUST),
])
def test_the_runs_own_robust_settings_win_key_by_key(own: dict, expected: dict, tmp_path: Path) -> None:
    assert DEPLOY_ROBUST == {"max_norm_ratio": 10.0, "max_share": 0.6}
    job = write_run_job(RunConfig(data=SITE_DATA, robust=own), tmp_path, TASK, mode="preinstalled")
    assert written_robust(job) == (expected, {"on": True, **expected})


@pytest.mark.parametrize("mode, data", [("preinstalled", SITE_DATA), ("byoc", SIMULATED)])
@pytest.mark.parametrize("off", [{"off": True}, {"off": "true"}, {"max_norm_ratio": 0, "max_share": 0}])
def test_a_job_without_defences_says_so_in_its_meta_json(off: dict, mode: str, data: dict, tmp_path: Path) -> None:
    robust, record = written_robust(write_run_job(RunConfig(data=data, robust=off), tmp_path, TASK, mode=mode))
    assert robust == ROBUST_OFF  # explicit zeros: the aggregator knows no "off"
    assert record == {"on": False, **ROBUST_OFF}


def test_export_never_writes_through_a_planted_partial_or_job_symlink(tmp_path: Path) -> None:
    """A `<job>.partial` or `<job>` symlink planted in the output folder points at someone's files: the export writes
    into a folder it made itself and replaces the link, never what it points to."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("keep me")
    out = tmp_path / "jobs"
    out.mkdir()
    run = RunConfig(method="fedavg", data={"source": "site"})
    (out / "fedavg.partial").symlink_to(victim)
    (out / "fedavg").symlink_to(victim)
    job = write_run_job(run, out, TaskSpec(2, 1, 28), "preinstalled")
    assert sorted(p.name for p in victim.iterdir()) == ["thesis.tex"]
    assert (victim / "thesis.tex").read_text() == "keep me"
    assert not job.is_symlink() and (job / "meta.json").is_file()
    assert [p.name for p in out.iterdir() if p.name.endswith(".partial") and not p.is_symlink()] == []


def test_a_job_folder_is_replaced_only_where_it_holds_what_medflare_recorded_writing(tmp_path: Path) -> None:
    """Issue 49, item 5: writing a job over an earlier one removes only the files medflare recorded (with their
    SHA-256) and that still hold that content; a folder of the job's name that medflare did not write, or one with a
    file added or changed, is refused and kept whole."""
    from medflare.console.files import MARKER, OutputError

    out, run, task = tmp_path / "jobs", RunConfig(method="fedavg", data={"source": "site"}), TaskSpec(2, 1, 28)
    job = write_run_job(run, out, task, "preinstalled")
    recorded = json.loads((out / MARKER).read_text())["sha256"]
    assert "fedavg/meta.json" in recorded and not (job / MARKER).exists()  # the record lies beside the job
    assert write_run_job(run, out, task, "preinstalled") == job  # medflare's own, unchanged: replaced
    (job / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt, which medflare did not write"):
        write_run_job(run, out, task, "preinstalled")
    assert (job / "notes.txt").read_text() == "mine" and (job / "meta.json").is_file()
    (job / "notes.txt").unlink()
    (job / "meta.json").write_text('{"edited": true}')  # medflare's name, other content
    with pytest.raises(OutputError, match="meta.json, which medflare did not write"):
        write_run_job(run, out, task, "preinstalled")
    assert (job / "meta.json").read_text() == '{"edited": true}'
    theirs = tmp_path / "other" / "fedavg"
    theirs.mkdir(parents=True)
    (theirs / "meta.json").write_text("theirs")  # a folder of the job's name, never recorded
    with pytest.raises(OutputError):
        write_run_job(run, tmp_path / "other", task, "preinstalled")
    assert (theirs / "meta.json").read_text() == "theirs"
    assert not [p for p in (tmp_path / "other").iterdir() if p.name.endswith(".partial")]


def test_a_job_with_plugin_files_is_refused_for_pre_installed_sites_before_anything_is_written(tmp_path: Path) -> None:
    from medflare.errors import ConfigError

    plugin = Path(__file__).parent / "flare" / "plugins" / "exchange.py"
    run = RunConfig(data=SIMULATED, plugins=[str(plugin)])
    out = tmp_path / "jobs"
    with pytest.raises(ConfigError, match="need --mode byoc"):
        write_run_job(run, out, TASK, mode="preinstalled")
    assert not out.exists()  # no empty folder, no partial job
    job = write_run_job(run, out, TASK, mode="byoc")
    assert (job / "app" / "custom" / "medflare_plugins" / "exchange.py").is_file()


def test_both_sides_pull_arrays_in_the_chunks_the_job_sets_under_the_name_flare_reads(tmp_path: Path) -> None:
    """The chunk size is the sender's: the server's model goes down, each site's result comes up. FLARE reads it
    from the app's own config (ConfigService's application section), under the numpy decomposer's variable name."""
    import subprocess
    import sys

    job = write_run_job(RunConfig(data={"source": "site"}, task=dict(vars(TASK))), tmp_path, TASK, mode="preinstalled")
    read = ("import json, sys\n"
            "from nvflare.apis.fl_constant import ConfigVarName, SystemConfigs\n"
            "from nvflare.app_common.decomposers.numpy_decomposers import NumpyArrayDecomposer\n"
            "from nvflare.fuel.utils import app_config_utils\n"
            "from nvflare.fuel.utils.config_service import ConfigService\n"
            "ConfigService.initialize(section_files={}, config_path=[sys.argv[2]])\n"
            "ConfigService.add_section(SystemConfigs.APPLICATION_CONF, json.load(open(sys.argv[1])))\n"
            "name = NumpyArrayDecomposer()._config_var_name(ConfigVarName.DOWNLOAD_CHUNK_SIZE)\n"
            "print(app_config_utils.get_int_var(name, -1))\n")
    for side in ("server", "client"):
        config = job / "app" / "config" / f"config_fed_{side}.json"
        done = subprocess.run([sys.executable, "-c", read, str(config), str(config.parent)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert int(done.stdout.split()[-1]) == 16 * 1024 * 1024 > 2 * 1024 * 1024, (side, done.stdout)


def python_lines(folder: Path) -> int:
    return sum(len(path.read_text().splitlines()) for path in folder.rglob("*.py"))


def test_a_byoc_job_ships_the_job_package_without_the_console_or_caches(tmp_path: Path) -> None:
    """Issue 64: a job's processes never import medflare.console (tests/test_layering.py), so its app/custom carries
    every other file of the package, no console/ and no byte code: at most 75 % of the package's Python lines."""
    package = Path(__file__).resolve().parents[1] / "custom" / "medflare"
    shipped = write_run_job(RunConfig(data=SIMULATED), tmp_path, TASK, mode="byoc") / APP_NAME / "custom" / "medflare"
    expected = {path.relative_to(package) for path in package.rglob("*")
                if path.is_file() and "console" != path.relative_to(package).parts[0]
                and "__pycache__" not in path.parts and path.suffix != ".pyc"}
    assert {path.relative_to(shipped) for path in shipped.rglob("*") if path.is_file()} == expected
    assert {Path("flare/executor.py"), Path("deploy/filters.py"), Path("methods/fedavg/__init__.py")} <= expected
    assert python_lines(shipped) <= 0.75 * python_lines(package)
