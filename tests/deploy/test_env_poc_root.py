"""``MEDFLARE_POC_ROOT`` and ``MEDFLARE_POC_PORT`` are read when a POC is made, not when medflare is imported:
``medflare run --env poc``, ``python -m medflare.console.deploy.poc run`` (``poc/run.sh``) and ``medflare watch`` use the
root the variable names at that moment (issue 30, item 11). The POC steps themselves are stood in for: the real
POC runs in test_poc_*.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import medflare.console.deploy.poc as poc_module
from medflare.console.cli import main
from medflare.console.deploy.poc import PocError, PocSession, admin_kit, run_poc
from medflare.console.report import build_summary
from medflare.errors import ConfigError
from medflare.plan import resolve
from medflare.run_config import RunConfig


@pytest.fixture
def poc_steps(monkeypatch) -> list[dict]:
    """Stands in for the POC's steps: records the session's root and port and the run's staging folder."""
    seen: list[dict] = []

    def record(plan, session, target, staging, mode, timeout):
        seen.append({"root": session.root, "port": session.port, "staging": staging})
        return build_summary({"method": plan.method, "rounds": []}, {"method": plan.method}, {})

    monkeypatch.setattr(poc_module, "_run_in_poc", record)
    return seen


@pytest.fixture
def no_poc_env(monkeypatch) -> None:
    for name in ("MEDFLARE_POC_ROOT", "MEDFLARE_POC_PORT", "NVFLARE_STARTUP_KIT_DIR"):
        monkeypatch.delenv(name, raising=False)


def smoke_run() -> RunConfig:
    return RunConfig(method="fedavg", rounds=1, data={"source": "synthetic:n=200"})


def test_medflare_run_env_poc_makes_its_poc_where_the_variables_say(
    poc_steps: list[dict], no_poc_env, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("MEDFLARE_POC_ROOT", str(tmp_path / "pocs"))  # set after medflare was imported
    monkeypatch.setenv("MEDFLARE_POC_PORT", "8123")
    argv = ["run", "fedavg", "--env", "poc", "--rounds", "1", "--data", "synthetic:n=200", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    assert poc_steps == [{"root": tmp_path / "pocs", "port": 8123, "staging": tmp_path / "o.partial"}]


def test_without_the_variables_the_poc_lives_in_the_runs_staging_folder(
    poc_steps: list[dict], no_poc_env, tmp_path: Path
) -> None:
    run_poc(resolve(smoke_run(), "byoc", deployed=True), tmp_path / "o", echo=lambda line: None)
    assert poc_steps == [{"root": tmp_path / "o.partial" / "poc", "port": 8002, "staging": tmp_path / "o.partial"}]


def test_poc_run_on_the_command_line_uses_the_variable_without_locking_itself_out(
    poc_steps: list[dict], no_poc_env, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("MEDFLARE_POC_ROOT", str(tmp_path / "pocs"))
    argv = ["run", "fedavg", "--rounds", "1", "--data", "synthetic:n=200", "-o", str(tmp_path / "o")]
    assert poc_module.main(argv) == 0
    assert [seen["root"] for seen in poc_steps] == [tmp_path / "pocs"]


def test_a_shared_root_in_use_is_refused_and_leaves_no_staging_folder(
    poc_steps: list[dict], no_poc_env, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("MEDFLARE_POC_ROOT", str(tmp_path / "pocs"))
    with PocSession(tmp_path / "pocs").hold():  # as another medflare process would
        with pytest.raises(PocError, match="in use by medflare process"):
            run_poc(resolve(smoke_run(), "byoc", deployed=True), tmp_path / "o", echo=lambda line: None)
    assert poc_steps == [] and not (tmp_path / "o.partial").exists()


def test_a_port_variable_that_is_no_port_is_refused_in_one_line(no_poc_env, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MEDFLARE_POC_PORT", "eighty")
    with pytest.raises(ConfigError, match="MEDFLARE_POC_PORT=eighty is not a port number"):
        PocSession(tmp_path / "poc")


def test_watch_finds_the_lead_kit_of_the_poc_the_variable_names(no_poc_env, tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "pocs"
    kit = root / "poc" / "example" / "prod_00" / "lead@a.org"
    (kit / "startup").mkdir(parents=True)
    (kit / "startup" / "fed_admin.json").write_text(json.dumps({"admin": {"username": "lead@a.org"}}))
    (root / poc_module.STATE_FILE).write_text(json.dumps({"project": "example", "lead": "lead@a.org"}))
    monkeypatch.setenv("MEDFLARE_POC_ROOT", str(root))
    assert admin_kit(None, None) == (kit.resolve(), "lead@a.org")
    monkeypatch.setenv("MEDFLARE_POC_ROOT", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match=f"--poc {tmp_path / 'none'}: no medflare POC is prepared there"):
        admin_kit(None, None)


def test_wait_and_download_before_any_submit_say_so_in_one_line(tmp_path: Path) -> None:
    session = PocSession(tmp_path / "poc")
    for act in (lambda: session.wait(), lambda: session.download(None, tmp_path / "out")):
        with pytest.raises(ConfigError, match="no job was submitted to this POC yet"):
            act()


def test_a_poc_runs_only_a_plan_resolved_as_deployed(poc_steps: list[dict], no_poc_env, tmp_path: Path) -> None:
    """A POC is a deployment: a plan resolved for the simulator (a defence left out, so off) is refused before
    anything is made; the same run resolved as deployed reaches the POC's steps."""
    with pytest.raises(ConfigError, match=r"deployed=True"):
        run_poc(resolve(smoke_run(), "byoc"), tmp_path / "o", echo=lambda line: None)
    assert poc_steps == [] and not list(tmp_path.iterdir())
    run_poc(resolve(smoke_run(), "byoc", deployed=True), tmp_path / "o", echo=lambda line: None)
    assert [seen["staging"] for seen in poc_steps] == [tmp_path / "o.partial"]
