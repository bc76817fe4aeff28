"""FLARE's admin side looks for its optional comm_config.json by walking the whole working directory unless a config
path is set (FLARE sets one for its server and sites only): medflare runs its ``nvflare`` commands in a folder of
its own and gives its admin sessions the kit as config path (medflare/console/processes.py says why)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from nvflare.fuel.utils.config_service import ConfigService

import medflare.console.deploy.poc as poc_module
from medflare.console.deploy.poc import PocSession
from medflare.console.processes import confine_flare_config_search, flare_admin_popen_args


def test_admin_commands_run_in_the_given_folder_with_an_absolute_pythonpath(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = flare_admin_popen_args(tmp_path / "home", {"PYTHONPATH": "lib:/opt/site", "OTHER": "x"})
    assert args["cwd"] == str(tmp_path / "home") and (tmp_path / "home").is_dir()
    assert args["env"] == {"PYTHONPATH": f"{tmp_path / 'lib'}:/opt/site", "OTHER": "x"}


def test_a_poc_session_runs_nvflare_in_its_home_with_absolute_paths(tmp_path: Path, monkeypatch) -> None:
    seen: list[tuple[list[str], dict]] = []

    def fake_run(command, **kwargs):
        seen.append((command, kwargs))
        return subprocess.CompletedProcess(command, 0, json.dumps({"status": "ok", "data": {}}), "")

    monkeypatch.setattr(poc_module.subprocess, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job").mkdir()
    session = PocSession(Path("poc"), port=18002, echo=lambda line: None)
    session.state = {"project": "medflare", "lead": "lead@example.org", "jobs": {}}
    session.try_submit("job", "lead@example.org")
    command, kwargs = seen[-1]
    assert kwargs["cwd"] == str(tmp_path / "poc" / "home")
    assert command[command.index("-j") + 1] == str(tmp_path / "job")
    assert command[command.index("--startup-kit") + 1].startswith(str(tmp_path / "poc"))


# what FLARE's admin client does on `nvflare job submit` (file_transfer.py): the signed job, zipped into a file
# named by a uuid in tempfile.gettempdir(), never deleted; this command prints where it wrote its file
WRITES_A_TEMPORARY_FILE = ("import json, os, sys, tempfile, uuid; path = os.path.join(tempfile.gettempdir(), "
                           "str(uuid.uuid4())); open(path, 'w').write('job zip'); "
                           "print(json.dumps({'status': 'ok', 'data': {'path': path}}))")


def test_an_admin_command_leaves_no_file_in_the_machines_temporary_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(poc_module, "nvflare_command", lambda: [sys.executable, "-c", WRITES_A_TEMPORARY_FILE])
    session = PocSession(tmp_path / "poc", port=18002, echo=lambda line: None)
    written = Path(session.nvflare("job", "submit")["data"]["path"])
    assert written.parent.parent == tmp_path / "poc" / "home"  # a folder of its own in the POC's home ...
    assert not written.parent.exists()  # ... removed, zip and all, once the command is done
    assert list((tmp_path / "poc" / "home").iterdir()) == []


def test_an_admin_session_finds_comm_config_in_its_kit_not_below_the_working_folder(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    monkeypatch.setattr(ConfigService, "_config_path", [])  # this process's FLARE as an admin client starts it
    stray = tmp_path / "cwd" / "some" / "data"
    stray.mkdir(parents=True)
    (stray / "comm_config.json").write_text(json.dumps({"from": "working folder"}))
    kit = tmp_path / "kit"
    (kit / "local").mkdir(parents=True)
    (kit / "local" / "comm_config.json").write_text(json.dumps({"from": "kit"}))
    monkeypatch.chdir(tmp_path / "cwd")
    assert ConfigService.load_configuration("comm_config.json").to_dict() == {"from": "working folder"}  # FLARE's walk
    confine_flare_config_search(kit)
    assert ConfigService.load_configuration("comm_config.json").to_dict() == {"from": "kit"}


def test_a_missing_kit_is_left_to_the_session_to_report(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ConfigService, "_config_path", [])
    confine_flare_config_search(tmp_path / "no-kit")  # new_secure_session then names the missing kit
    assert ConfigService._config_path == []
