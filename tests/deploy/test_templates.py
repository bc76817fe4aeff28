"""job_templates/: generated from the export builders, every key commented, and `nvflare job create` with each
template yields the exported job, whose plan, edited as the card says, runs in FLARE's simulator."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from pyhocon import ConfigFactory

from job_templates import TEMPLATES_DIR, example_command, stale_templates, template_plan
from medflare.console.deploy.apps import DEPLOY_TASK
from medflare.console.job_export import client_config, server_config
from medflare.console.processes import nvflare_command
from medflare.plan import APP_NAME, PLAN_FILE, plan_from_job, read_plan
from medflare.registry import list_methods
from medflare.server_setup import DEPLOY_ROBUST

REPO = Path(__file__).resolve().parents[2]
TEMPLATE_FILES = ("info.conf", "info.md", "meta.conf", "config_fed_client.conf", "config_fed_server.conf", PLAN_FILE)
EXAMPLE_SOURCE = "synthetic:n=400,classes={num_classes},channels={in_channels}".format(**DEPLOY_TASK)


def test_templates_are_up_to_date() -> None:
    assert stale_templates() == [], "job_templates/ is stale: run 'make templates'"


def test_one_template_per_registered_method() -> None:
    assert sorted(p.name for p in TEMPLATES_DIR.iterdir() if p.is_dir()) == list_methods()
    for method in list_methods():
        for name in TEMPLATE_FILES:
            assert (TEMPLATES_DIR / method / name).is_file(), f"{method}/{name}"


@pytest.mark.parametrize("method", list_methods())
def test_every_key_is_commented(method: str) -> None:
    for name in ("info.conf", "meta.conf", "config_fed_client.conf", "config_fed_server.conf"):
        lines = (TEMPLATES_DIR / method / name).read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*[\w\"-]+\s*=", line):
                assert lines[i - 1].strip().startswith("#"), f"{method}/{name}:{i + 1} has no comment: {line}"


def documented_command(method: str) -> str:
    """The `nvflare job create` example as info.md shows it (the first bash block)."""
    text = (TEMPLATES_DIR / method / "info.md").read_text()
    return re.search(r"```bash\n(.*?)```", text, re.S).group(1)


def laid_out_like_the_repository(workdir: Path) -> Path:
    for name in ("job_templates", "custom"):
        (workdir / name).symlink_to(REPO / name)
    return workdir


def create_job(method: str, workdir: Path) -> Path:
    """Run the documented command verbatim (a shell, from a folder laid out like the repository)."""
    command = documented_command(method)
    assert command.startswith("nvflare job create ")
    nvflare = " ".join(shlex.quote(part) for part in nvflare_command())
    proc = subprocess.run(["bash", "-c", nvflare + command.removeprefix("nvflare")],
                          cwd=laid_out_like_the_repository(workdir), capture_output=True, text=True,
                          env={"HOME": str(workdir), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return workdir / "jobs" / method


# nvflare's own command-line entry point, given each documented command's words in turn (a shell's word splitting,
# line continuations joined), in one folder laid out like the repository
CREATE_EVERY_JOB = r"""
import os, shlex, sys
from nvflare.cli import main
os.chdir(sys.argv[1])
for command in sys.argv[2:]:
    sys.argv = shlex.split(command.replace("\\\n", " "))
    try:
        main()
    except SystemExit as exc:
        if exc.code:
            raise SystemExit(f"{exc.code}: {command}")
"""


@pytest.fixture(scope="module")
def created_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every template's documented ``nvflare job create`` command run by nvflare's CLI in one Python process: each
    nvflare process imports the job's components (torch, ~5 s of CPU on the CI machine), 19 of them a minute and a
    half; test_documented_job_runs_in_the_simulator runs one command verbatim in a shell."""
    workdir = laid_out_like_the_repository(tmp_path_factory.mktemp("templates"))
    commands = [documented_command(method) for method in list_methods()]
    assert all(command.startswith("nvflare job create ") for command in commands)
    proc = subprocess.run([sys.executable, "-c", CREATE_EVERY_JOB, str(workdir), *commands], capture_output=True,
                          text=True, env={**os.environ, "HOME": str(workdir)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (workdir / CREATE_OUTPUT).write_text(proc.stdout)  # the variables nvflare lists, for the test below
    return workdir / "jobs"


CREATE_OUTPUT = "job_create.out"
# the files whose variables `nvflare job create` may list: the job's own configs (it lists every .json/.conf/.yml
# it finds under the job, the BYOC code's included)
JOB_CONFIG_FILES = {"meta.conf", "config_fed_client.conf", "config_fed_server.conf"}


def test_job_create_lists_only_the_jobs_settings_and_copies_no_install_metadata(created_jobs: Path) -> None:
    """Issue 61 minors: it listed the catalog's keys (224, default_model, ...) as job variables and copied
    medflare.egg-info into every job."""
    table = (created_jobs.parent / CREATE_OUTPUT).read_text()
    listed = {line.split()[0] for line in table.splitlines() if re.match(r"\s+\S+\.(json|conf|ya?ml)\s", line)}
    assert listed == JOB_CONFIG_FILES, table[-3000:]
    for method in list_methods():
        assert not list((created_jobs / method / "app" / "custom").glob("*.egg-info")), method


def test_an_editable_install_writes_its_metadata_outside_custom(tmp_path: Path) -> None:
    """What pip runs first for ``pip install -e .`` (the build backend's egg_info) on the project's pyproject.toml:
    the egg-info goes to the repository root, not into the custom/ folder a job's BYOC code is copied from."""
    (tmp_path / "custom" / "medflare").mkdir(parents=True)
    (tmp_path / "custom" / "medflare" / "__init__.py").write_text("")
    for name in ("pyproject.toml", "README.md"):
        (tmp_path / name).write_text((REPO / name).read_text())
    hook = "from setuptools import build_meta; build_meta.get_requires_for_build_editable()"
    proc = subprocess.run([sys.executable, "-c", hook], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [p.name for p in tmp_path.glob("*.egg-info")] == ["medflare.egg-info"]
    assert not list((tmp_path / "custom").glob("*.egg-info"))


def test_every_config_header_shows_the_documented_command() -> None:
    for method in list_methods():
        example = example_command(method)
        assert example == documented_command(method).strip()
        for name in ("config_fed_client.conf", "config_fed_server.conf"):
            header = [line.removeprefix("#   ") for line in (TEMPLATES_DIR / method / name).read_text().splitlines()
                      if line.startswith("#   ")]
            assert "\n".join(header) == example, f"{method}/{name}"


def parsed(path: Path) -> dict:
    return json.loads(json.dumps(ConfigFactory.parse_file(str(path)).as_plain_ordered_dict()))


def test_every_template_has_the_deployment_defences_and_says_so_in_its_meta() -> None:
    for method in list_methods():
        plan, written = read_plan(TEMPLATES_DIR / method / PLAN_FILE)
        assert plan.robust == DEPLOY_ROBUST and written == plan.digest(), method
        assert parsed(TEMPLATES_DIR / method / "meta.conf")["robust_aggregation"] == {"on": True, **DEPLOY_ROBUST}


@pytest.mark.parametrize("method", list_methods())
def test_job_create_yields_exactly_the_exported_job(method: str, created_jobs: Path) -> None:
    """Each template's created job equals what the export builders write for the same settings, so it runs
    wherever `medflare export` jobs run (tests/integration/test_every_method_simulator.py runs every method)."""
    job = created_jobs / method
    assert (job / "app" / "custom" / "medflare" / "flare" / "executor.py").is_file()
    plan = template_plan(method)
    assert plan_from_job(job) == plan and plan.data == {"source": "site"}
    assert parsed(job / "app" / "config" / "config_fed_server.conf") == json.loads(json.dumps(server_config(plan)))
    assert parsed(job / "app" / "config" / "config_fed_client.conf") == json.loads(json.dumps(client_config(plan)))
    assert parsed(job / "meta.conf")["scope"] == f"medflare-{method}"


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
def test_documented_job_with_its_plan_edited_runs_in_the_simulator(tmp_path: Path) -> None:
    """The job made verbatim from the docs, its plan edited by hand as a user would to try it (simulated images
    shaped like the declared task, its placeholder class names filled in, 3 rounds, 5 steps a round), trains in
    FLARE's simulator."""
    job = create_job("fedavg", tmp_path)
    path = job / APP_NAME / "config" / PLAN_FILE
    record = json.loads(path.read_text())
    plan = record["plan"]
    plan["data"] = {"source": EXAMPLE_SOURCE, "partition": "iid", "num_sites": len(plan["sites"]), "seed": 0}
    assert plan["task"]["class_names"] == ["<class 1>", "<class 2>"]  # the placeholder every site refuses
    plan["task"]["class_names"] = ["normal", "pneumonia"]
    plan["rounds"] = plan["rounds"][:3]
    for train in (plan["train"], *(site["train"] for site in plan["sites"])):
        train["max_steps"] = 5
    path.write_text(json.dumps(record, indent=2))
    sim = subprocess.run(
        nvflare_command() + ["simulator", str(job), "-w", str(tmp_path / "ws"), "-n", "3", "-t", "3"],
        capture_output=True, text=True, timeout=600,
    )
    results = list((tmp_path / "ws").glob("**/app_server/medflare_results.json"))
    assert results, sim.stdout[-3000:] + sim.stderr[-3000:]
    outcome = json.loads(results[0].read_text())
    assert outcome.get("error") is None and len(outcome["rounds"]) == 3, outcome.get("error")
    assert len(outcome["evaluations"]["3"]["test"]["per_class_recall"]) == DEPLOY_TASK["num_classes"]
