"""The test session's warm start (tests/_warm_start): a ``python -m`` process it names runs as a fork of a process
with torch imported, and sees what a fresh interpreter would see; its stand-in carries signals and exit codes, and
no worker outlives its stand-in. Each check runs the same probe cold and warm."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow  # the session starts its warm server only when it runs slow tests

PROBE = '''
import json, os, subprocess, sys, time
if sys.argv[1:] == ["child"]:  # a warm process's own children (the simulator's site workers) start warm too
    print(subprocess.run([sys.executable, "-m", "medflare_warm_probe", "0"], capture_output=True, text=True).stdout,
          end="", flush=True)
print(json.dumps({"argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "name": __name__,
                  "answer": os.environ.get("PROBE_ANSWER"), "warm": "torch" in sys.modules, "pid": os.getpid(),
                  "cold": os.environ.get("MEDFLARE_TEST_WARM_COLD")}),
      flush=True)
if sys.argv[1:] == ["sleep"]:
    time.sleep(120)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
'''


@pytest.fixture
def probe(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A probe module in its own folder, and the environment that starts it warm (the session's server)."""
    address = os.environ.get("MEDFLARE_TEST_WARM_SERVER")
    if not address:
        pytest.skip("the session's warm start is off (MEDFLARE_TEST_WARM_START=0)")
    deadline = time.time() + 120  # the server listens once it has imported torch (until then processes start cold)
    while not Path(address).exists() and time.time() < deadline:
        time.sleep(0.5)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "medflare_warm_probe.py").write_text(PROBE)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "medflare-warm-probe").write_text(PROBE)  # as a console script runs
    (tmp_path / "cwd").mkdir()
    env = {**os.environ, "PROBE_ANSWER": "42", "MEDFLARE_TEST_WARM_MODULES": "medflare_warm_probe",
           "MEDFLARE_TEST_WARM_SCRIPTS": "medflare-warm-probe 3",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "lib"), os.environ["PYTHONPATH"]])}
    return tmp_path, env


def why_cold(report: dict) -> str:
    """The hook's reason for a cold start and the server's log (its refusals and failures)."""
    log = Path(os.environ["MEDFLARE_TEST_WARM_SERVER"]).with_name("server.log")
    return f"started cold: {report.get('cold')}; server log: {log.read_text()[-2000:] if log.exists() else 'empty'}"


def start(folder: Path, env: dict[str, str], warm: bool, argument: str, as_script: bool = False) -> subprocess.Popen:
    if not warm:
        env = {name: value for name, value in env.items() if name != "MEDFLARE_TEST_WARM_SERVER"}
    program = ["../bin/medflare-warm-probe"] if as_script else ["-m", "medflare_warm_probe"]
    return subprocess.Popen([sys.executable, *program, argument], cwd=folder / "cwd", env=env,
                            stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("as_script", [False, True], ids=["module", "script"])
def test_a_warm_process_sees_what_a_fresh_one_sees_and_ends_with_its_code(probe, as_script: bool) -> None:
    folder, env = probe
    seen = {}
    for warm in (False, True):
        proc = start(folder, env, warm, "3", as_script)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 3
        seen[warm] = json.loads(out)
    assert seen[True]["warm"], why_cold(seen[True])
    assert seen[True].pop("warm") and not seen[False].pop("warm")  # the warm one started with torch imported
    assert seen[True].pop("pid") != seen[False].pop("pid")
    assert seen[True] == seen[False]  # argv, sys.path, working directory, __name__, environment


def test_a_warm_process_starts_its_own_children_warm(probe) -> None:
    folder, env = probe
    proc = start(folder, env, True, "child")
    out, _ = proc.communicate(timeout=120)
    child, parent = (json.loads(line) for line in out.splitlines())
    assert parent["warm"], why_cold(parent)
    assert child["warm"], why_cold(child)
    assert child["pid"] != parent["pid"]


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_stand_in_ends_the_worker_as_it_would_end_a_fresh_one(probe, number: int) -> None:
    folder, env = probe
    codes = []
    for warm in (False, True):
        proc = start(folder, env, warm, "sleep")
        worker = json.loads(proc.stdout.readline())["pid"]
        proc.send_signal(number)
        codes.append(proc.wait(timeout=60))
        assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    assert codes[0] == codes[1] != 0


def test_a_killed_stand_in_takes_its_worker_along(probe) -> None:
    folder, env = probe
    proc = start(folder, env, True, "sleep")
    report = json.loads(proc.stdout.readline())
    assert report["warm"], why_cold(report)
    assert report["pid"] != proc.pid
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.time() + 15  # the keeper sees its stand-in gone, SIGTERMs the worker, waits 5 s, then SIGKILLs
    while psutil.pid_exists(report["pid"]) and time.time() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(report["pid"])


def test_a_kill_of_a_keepers_process_group_takes_its_worker_not_the_server(probe) -> None:
    """FLARE SIGKILLs the process group of a job pid it still holds after the job ended; by then that pid may be a
    keeper's (pids wrap): the kill must end that keeper and its worker only, and later processes still start warm."""
    folder, env = probe
    proc = start(folder, env, True, "sleep")
    report = json.loads(proc.stdout.readline())
    assert report["warm"], why_cold(report)
    keeper = psutil.Process(report["pid"]).ppid()
    os.killpg(os.getpgid(keeper), signal.SIGKILL)
    assert proc.wait(timeout=30) != 0  # the stand-in lost its keeper: a failed run, as FLARE should see it
    deadline = time.time() + 15
    while psutil.pid_exists(report["pid"]) and time.time() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(report["pid"])
    after = start(folder, env, True, "0")
    out, _ = after.communicate(timeout=120)
    assert json.loads(out)["warm"], why_cold(json.loads(out))


def test_a_process_in_another_network_namespace_starts_cold(probe) -> None:
    """A fork of the server would run in the server's network (a rehearsal's hospital would reach the wrong one)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--net", "true"]).returncode != 0:
        pytest.skip("no network namespaces here (unshare --net needs root)")
    folder, env = probe
    proc = subprocess.Popen(["unshare", "--net", sys.executable, "-m", "medflare_warm_probe", "3"], cwd=folder / "cwd",
                            env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3
    assert not json.loads(out)["warm"]


def test_another_name_of_the_same_interpreter_starts_warm(probe) -> None:
    """FLARE starts a POC's job processes as ``python3`` of the environment, the session runs as ``python``."""
    other = Path(sys.executable).with_name("python3" if Path(sys.executable).name != "python3" else "python")
    if not other.exists():
        pytest.skip(f"{other} does not exist")
    folder, env = probe
    proc = subprocess.Popen([str(other), "-m", "medflare_warm_probe", "0"], cwd=folder / "cwd", env=env,
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert json.loads(out)["warm"], why_cold(json.loads(out))
