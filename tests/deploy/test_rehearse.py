"""``medflare rehearse``: a provisioned consortium run from its kits, one network namespace per participant.

Without root or network namespaces the rehearsal tests skip with the reason (the refusal itself is tested
everywhere). The small rehearsal (2 hospitals, fedavg on cnn, 2 rounds) takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest

from medflare.console.cli import main as medflare_main
from medflare.console.deploy import netns
from medflare.console.deploy.netns import NETNS_ETC, PREFIX, Wan, list_namespaces, sweep_stale, unavailable_reason
from medflare.console.deploy.rehearse import (
    RECONNECT_ALLOWANCE,
    WORK_ALLOWANCE,
    Fault,
    Rehearsal,
    RehearseError,
    add_rehearse_options,
    check_outcome,
    consortium,
    failure_cause,
    plan_from_args,
    rehearse,
    server_reason,
    stalled_rounds,
    summary_line,
)
from medflare.errors import ConfigError

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"medflare rehearse {REASON}")
SERVER = "fl-server.medflare.example.org"


def ours(owner: int | None = None) -> list[str]:
    """Namespaces and /etc/netns folders a rehearsal of process ``owner`` (default: this one) made."""
    prefix = f"{PREFIX}-{owner or os.getpid()}-"
    made = [ns for ns in list_namespaces() if ns.startswith(prefix)]
    if NETNS_ETC.is_dir():
        made += [p.name for p in NETNS_ETC.iterdir() if p.name.startswith(prefix)]
    return made


def processes_naming(text: str) -> list[int]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if text in " ".join(process.info["cmdline"] or []):
                found.append(process.pid)
        except psutil.Error:
            continue
    return found


# ----- without namespaces ----------------------------------------------------------------------------------------
def test_fault_specs_parse_and_bad_ones_are_refused() -> None:
    assert Fault.parse("outage", "hospital-b@round2:25") == Fault("outage", "hospital-b", 2, 0.0, 25.0)
    assert Fault.parse("kill", "hospital-c@40:5") == Fault("kill", "hospital-c", None, 40.0, 5.0)
    for bad in ("hospital-b", "hospital-b@round2", "@round2:3", "hospital-b@soon:3"):
        with pytest.raises(ConfigError, match="SITE@roundK:SECONDS"):
            Fault.parse("outage", bad)


def test_a_server_crash_parses_and_names_the_recovery() -> None:
    crash = Fault.server_crash("round3:5")
    assert crash == Fault("server", "server", 3, 0.0, 5.0) and "resubmitted with resume_from" in crash.describe()
    with pytest.raises(ConfigError, match="^--kill-server 'soon' must be roundK:SECONDS"):
        Fault.server_crash("soon")
    parser = argparse.ArgumentParser()
    add_rehearse_options(parser)
    plan = plan_from_args(parser.parse_args(["--kill-server", "round3:5", "--kill", "hospital-b@round2:5"]))
    assert sorted(f.kind for f in plan.faults) == ["kill", "server"]


def test_the_checks_of_a_server_crash_need_the_checkpoints_round_and_model_and_every_round_once() -> None:
    plan = Rehearsal(hospitals=2, rounds=4, faults=[Fault.server_crash("round3:5")])
    every = {"hospital-a": 1, "hospital-b": 1}
    crash = {"fault": plan.faults[0].describe(), "struck_at": 30.0, "recovered_at": 35.0, "crashed_job": "old",
             "checkpoint": {"next_round": 2, "model_digest": "d2"}, "reconnected_after": 4.0, "resumed_job": "new"}
    results = {"rounds": [{"round": r, "wall_seconds": 5, "share": every} for r in range(4)],
               "resumed": [{"from_job": "old", "start_round": 2, "initial_model_digest": "d2"}]}
    args = ("FINISHED:COMPLETED", results, None, ["hospital-a", "hospital-b"], [crash], {}, "", "new")
    checks = check_outcome(plan, *args)
    assert all(c["ok"] for c in checks) and {"server restarted", "resumed from the checkpoint",
                                             "every round once"} <= {c["check"] for c in checks}

    def failed(**changes) -> list[str]:
        broken = json.loads(json.dumps({"results": results, "crash": crash}))
        for path, value in changes.items():
            where, key = path.split(".")
            target = broken["results"]["resumed"][0] if where == "resumed" else broken[where]
            target[key] = value
        broken_args = (args[0], broken["results"], *args[2:4], [broken["crash"]], *args[5:])
        return [c["check"] for c in check_outcome(plan, *broken_args) if not c["ok"]]

    assert failed(**{"resumed.start_round": 0}) == ["resumed from the checkpoint"]  # started over
    assert failed(**{"resumed.initial_model_digest": "d0"}) == ["resumed from the checkpoint"]  # another model
    assert failed(**{"resumed.from_job": "other"}) == ["resumed from the checkpoint"]
    assert failed(**{"crash.checkpoint": {}}) == ["resumed from the checkpoint"]  # nothing was checkpointed
    assert failed(**{"crash.reconnected_after": None}) == ["server restarted"]
    repeated = json.loads(json.dumps(results))
    repeated["rounds"].insert(2, dict(repeated["rounds"][1]))  # round 2 played twice
    assert [c["check"] for c in check_outcome(plan, args[0], repeated, *args[2:]) if not c["ok"]] == [
        "rounds", "every round once"]


def test_a_server_crash_the_job_outran_is_a_failed_check() -> None:
    plan = Rehearsal(hospitals=2, rounds=2, faults=[Fault.server_crash("round3:5")])
    results = {"rounds": [{"round": r, "wall_seconds": 5, "share": {"hospital-a": 1, "hospital-b": 1}}
                          for r in range(2)]}
    event = {"fault": plan.faults[0].describe(), "not_played": "the job ended before it was due"}
    checks = check_outcome(plan, "FINISHED:COMPLETED", results, None, ["hospital-a", "hospital-b"], [event], {}, "",
                           "job")
    assert [c["observed"] for c in checks if not c["ok"]] == ["not played: the job ended before it was due"]


def test_consortium_keeps_server_and_people_and_names_more_hospitals() -> None:
    project = {"name": "p", "participants": [
        {"name": "srv.example.org", "type": "server"},
        {"name": "hospital-a", "type": "client", "org": "hospital_a"},
        {"name": "lead@x.org", "type": "admin", "role": "lead"},
    ]}
    cut = consortium(project, 3)
    assert [p["name"] for p in cut["participants"]] == ["srv.example.org", "hospital-a", "hospital-b", "hospital-c",
                                                         "lead@x.org"]
    assert [p["name"] for p in consortium(project, 1)["participants"] if p["type"] == "client"] == ["hospital-a"]


def test_without_root_it_refuses_in_one_line(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(RehearseError, match="^rehearse needs root: it creates network namespaces"):
        rehearse(Rehearsal(), tmp_path / "out")
    assert medflare_main(["rehearse", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_the_checks_catch_a_round_over_its_bound_and_a_site_that_never_came_back() -> None:
    plan = Rehearsal(hospitals=3, min_clients=2, rounds=3, straggler_seconds=10,
                     faults=[Fault("outage", "hospital-b", 2, 0, 30)])
    every = {"hospital-a": 1, "hospital-b": 1, "hospital-c": 1}
    without_b = {"hospital-a": 1, "hospital-c": 1}
    good = {"rounds": [{"round": 0, "wall_seconds": 5, "share": every},
                       {"round": 1, "wall_seconds": 12, "share": without_b,
                        "sites": {"hospital-a": {"result_at": 2.0}, "hospital-c": {"result_at": 1.5}}},
                       {"round": 2, "wall_seconds": 5, "share": every}]}
    args = ("FINISHED:COMPLETED", good, None, ["hospital-a", "hospital-b", "hospital-c"], [],
            {"hospital-b": True}, "", "job")
    assert all(c["ok"] for c in check_outcome(plan, *args))
    slow = json.loads(json.dumps(good))
    slow["rounds"][0]["wall_seconds"] = plan.round_bound() + 1  # every site answered, too late
    failed = [c["check"] for c in check_outcome(plan, args[0], slow, *args[2:]) if not c["ok"]]
    assert failed == ["longest round"]
    lingering = json.loads(json.dumps(good))  # result at 1 s, the round ended 15 s later: over the 10 s wait
    lingering["rounds"][1]["sites"] = {"hospital-a": {"result_at": 1.0}, "hospital-c": {"result_at": 0.5}}
    lingering["rounds"][1]["wall_seconds"] = 16.0
    failed = [c["check"] for c in check_outcome(plan, args[0], lingering, *args[2:]) if not c["ok"]]
    assert failed == ["straggler wait"]
    gone = json.loads(json.dumps(good))
    gone["rounds"][2]["share"] = without_b
    failed = [c["check"] for c in check_outcome(plan, args[0], gone, *args[2:]) if not c["ok"]]
    assert failed == ["hospital-b back in the job"]
    # the same rounds, the outage over only after the last round started (--rounds 3, hospital-b@round2:30 with
    # --min-clients 1): no round was left to come back in, which is no failure; recovered before it, it is
    submitted = 1000.0
    for index, started in enumerate((1001.0, 1010.0, 1020.0)):
        gone["rounds"][index]["started_at"] = started
    late = [{"fault": "hospital-b: link down", "site": "hospital-b", "struck_at": 12.0, "recovered_at": 42.0}]
    timed = (args[0], gone, None, args[3], late, *args[5:], submitted)
    assert all(c["ok"] for c in check_outcome(plan, *timed))
    assert "the job had no later round" in {c["check"]: c["observed"] for c in check_outcome(plan, *timed)}[
        "hospital-b back in the job"]
    early = [{**late[0], "recovered_at": 15.0}]
    failed = [c["check"] for c in check_outcome(plan, args[0], gone, None, args[3], early, *args[5:], submitted)
              if not c["ok"]]
    assert failed == ["hospital-b back in the job"]


def test_a_completed_jobs_error_lines_are_no_cause() -> None:
    """A completed job whose checks failed: the server's error lines at its end (a job cell gone) are not named as
    the reason (the real --min-clients 1 outage rehearsal named a 'target_unreachable' line)."""
    record = {"checks": [{"check": "x", "ok": False}], "status": "FINISHED:COMPLETED", "job_id": "J1", "faults": []}
    log = "2026-12-02 - CoreCell - ERROR - cannot send to 'server.J1': target_unreachable\n"
    assert "server:" not in failure_cause(record, {}, log)
    assert "server: 2026-12-02 - CoreCell" in failure_cause({**record, "status": "FINISHED:ABNORMAL"}, {}, log)


def test_an_outage_that_ends_the_job_names_its_cause_in_the_summary_line() -> None:
    """--min-clients 1 and hospital-b's link down in round 2: FLARE fails the job (ABNORMAL). The summary line
    names the failed checks, the status and the controller's error, the fault and its site, and the server's
    reason (was: "CHECKS FAILED" and nothing else)."""
    plan = Rehearsal(hospitals=2, min_clients=1, rounds=3, faults=[Fault.parse("outage", "hospital-b@round2:60")])
    results = {"rounds": [{"round": 0, "wall_seconds": 5, "share": {"hospital-a": 1, "hospital-b": 1}}],
               "error": "round 2: only 0 site(s) sent a valid result"}
    event = {"fault": plan.faults[0].describe(), "struck_at": 20.0, "recovered_at": 80.0}
    server_log = ("2026-12-02 01:00:00,000 - ServerRunner - INFO - round 2 started\n"
                  "2026-12-02 01:00:01,000 - FedServer - WARNING - Failing job J1: terminal outcome unavailable from "
                  "hospital-b: heartbeat lost\n2026-12-02 01:00:02,000 - X - ERROR - [run=J1]: later noise\n")
    checks = check_outcome(plan, "FINISHED:ABNORMAL", results, None, ["hospital-a", "hospital-b"], [event],
                           {"hospital-b": True}, server_log, "J1")
    record = {"checks": checks, "ok": False, "status": "FINISHED:ABNORMAL", "job_id": "J1", "faults": [event],
              "timings": {"total": 99.0}}
    record["cause"] = failure_cause(record, results, server_log)
    line = summary_line(record, Path("runs/rehearse"))
    assert line.count("\n") == 0 and "CHECKS FAILED" in line
    for named in ("failed: job status, rounds", "job J1 ended FINISHED:ABNORMAL: round 2: only 0 site(s)",
                  "hospital-b: link down at round 2 for 60 s",
                  "server: 2026-12-02 01:00:01,000 - FedServer - WARNING - Failing job J1: terminal outcome"):
        assert named in line, line
    no_failing_line = "a\n2026-12-02 - X - ERROR - [run=J2]: other job\n2026-12-02 - Y - ERROR - [run=J1]: boom\n"
    assert server_reason(no_failing_line, "J1").endswith("[run=J1]: boom")
    assert server_reason("all fine\n", "J1") is None


def test_the_round_bound_states_both_set_ups_and_a_stalled_round_names_its_cause() -> None:
    """Issue 49, item 6: with every hospital required a round waits out the faulted site's outage; with fewer it
    waits the straggler time. A round over the fault-free bound is recorded with the fault that overlapped it."""
    outage = Fault("outage", "hospital-b", 2, 0, 30)
    some = Rehearsal(hospitals=3, min_clients=2, straggler_seconds=10, faults=[outage])
    every = Rehearsal(hospitals=3, straggler_seconds=10, faults=[outage])
    assert not some.all_required() and every.all_required()
    assert some.round_bound() == WORK_ALLOWANCE + 10 + 5 == 75
    assert every.round_bound() == WORK_ALLOWANCE + 10 + 30 + RECONNECT_ALLOWANCE + 5
    assert "the longest fault 30 s" in every.bound_text() and "fault" not in some.bound_text()
    assert Rehearsal(hospitals=2, straggler_seconds=10).round_bound() == 75  # no fault: nothing to wait out
    rounds = [{"round": 0, "started_at": 1000.0, "wall_seconds": 20.0},
              {"round": 1, "started_at": 1020.0, "wall_seconds": 109.0},
              {"round": 2, "started_at": 1129.0, "wall_seconds": 80.0}]
    events = [{"fault": outage.describe(), "struck_at": 25.0, "recovered_at": 55.0}]
    hospitals, share = ["hospital-a", "hospital-b", "hospital-c"], {"hospital-a": 1, "hospital-b": 1, "hospital-c": 1}
    waited = {"rounds": [{**r, "share": share} for r in rounds]}
    checks = {c["check"]: c for c in check_outcome(every, "FINISHED:COMPLETED", waited, None, hospitals, events,
                                                  {"hospital-b": True}, "", "job")}
    assert checks["hospital-b in every round"]["ok"] and checks["longest round"]["ok"]  # 109 s <= 135 s
    stalled = stalled_rounds(every, rounds, events, submitted_at=1000.0)
    assert stalled == [{"round": 2, "wall_seconds": 109.0, "cause": outage.describe()},
                       {"round": 3, "wall_seconds": 80.0, "cause": "no scripted fault overlapped it (the sites' "
                                                                   "work, the network, or the machine's load)"}]


# ----- the network -----------------------------------------------------------------------------------------------
def _in(wan: Wan, name: str, code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*wan.exec_prefix(name), sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


LISTEN = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 9000)); s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept(); n = 0
    while (d := c.recv(1 << 16)):
        n += len(d)
    c.sendall(str(n).encode()); c.close()
"""
SEND = """
import socket, sys, time
t = time.time(); s = socket.create_connection(("{host}", 9000), timeout={timeout})
s.sendall(b"x" * {size}); s.shutdown(socket.SHUT_WR); print(s.recv(64).decode(), time.time() - t)
"""


@needs_netns
def test_the_wan_resolves_the_server_shapes_links_and_cuts_them() -> None:
    wan = Wan(["server", "hospital"], {SERVER: "server"})
    try:
        wan.up()
        assert len(set(ours())) == 3 and all(ns in list_namespaces() for ns in wan.made)
        resolved = subprocess.run([*wan.exec_prefix("hospital"), "getent", "hosts", SERVER], capture_output=True,
                                  text=True)
        assert resolved.stdout.split()[0] == wan.hosts["server"].address  # through /etc/netns/<ns>/hosts
        assert subprocess.run(["getent", "hosts", SERVER], capture_output=True).returncode != 0  # not outside
        listener = subprocess.Popen([*wan.exec_prefix("server"), sys.executable, "-c", LISTEN],
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert listener.stdout.readline().strip() == "ready"
            wan.set_rate("hospital", 10)
            assert wan.qdiscs("hospital").count("tbf") == 2 and "rate 10Mbit" in wan.qdiscs("hospital")
            size = 2_500_000  # 2 s at 10 Mbit/s
            received, seconds = _in(wan, "hospital", SEND.format(host=SERVER, size=size, timeout=30)).stdout.split()
            assert int(received) == size and 1.8 <= float(seconds) <= 6, seconds  # the link's floor, not loopback's
            wan.set_rate("hospital", None)
            assert "tbf" not in wan.qdiscs("hospital")
            wan.set_link("hospital", False)
            cut = _in(wan, "hospital", SEND.format(host=SERVER, size=1000, timeout=2))
            assert cut.returncode != 0 and ("timed out" in cut.stderr or "unreachable" in cut.stderr), cut.stderr
            wan.set_link("hospital", True)
            deadline = time.monotonic() + 30  # the failed attempt above may leave the neighbour entry FAILED a while
            while True:
                back = _in(wan, "hospital", SEND.format(host=SERVER, size=1000, timeout=10))
                if back.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert back.returncode == 0 and back.stdout.split()[0] == "1000", back.stderr
        finally:
            listener.kill()
            listener.wait()
    finally:
        wan.teardown()
    assert not ours() and not wan.made


@needs_netns
def test_namespaces_of_a_killed_rehearsal_are_swept() -> None:
    code = ("from medflare.console.deploy.netns import Wan; import time; w = Wan(['a', 'b'], {'x.org': 'a'}); w.up(); "
            "print('up', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        left = ours(child.pid)
        assert len(set(left)) == 3
        assert not set(left) & set(sweep_stale())  # its owner lives: not stale
        child.kill()
        child.wait()
        assert set(left) <= set(sweep_stale())
        assert not ours(child.pid)
    finally:
        child.kill()
        child.wait()
        sweep_stale()


# ----- whole rehearsals ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict:
    """2 hospitals, fedavg on cnn, 2 rounds, no faults. No POC lock: every participant listens inside its own
    namespace, so nothing collides with a loopback POC of another test (waiting for the lock idled a worker ~5 min)."""
    if REASON:
        pytest.skip(f"medflare rehearse {REASON}")
    out = tmp_path_factory.mktemp("rehearse") / "out"
    lines: list[str] = []
    record = rehearse(Rehearsal(hospitals=2, rounds=2), out, echo=lines.append)
    return {"record": record, "out": out, "lines": lines}


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
def test_a_small_rehearsal_runs_the_lead_job_over_the_namespaces(small) -> None:
    record, out = small["record"], small["out"]
    assert record["ok"], json.dumps(record["checks"], indent=1)
    assert record["status"] == "FINISHED:COMPLETED" and record["watch_exit"] == 0
    assert [r["sites"] for r in record["rounds"]] == [["hospital-a", "hospital-b"]] * 2
    addresses = record["addresses"]
    assert len(set(addresses.values())) == 4 and set(addresses) == {SERVER, "hospital-a", "hospital-b",
                                                                      "lead@hospital-a.example.org"}
    server = addresses[SERVER]
    for site in ("hospital-a", "hospital-b"):  # each site dialled the server's FQDN from its own address, over TLS
        log = (out / "logs" / f"{site}.log").read_text()
        assert f"{addresses[site]}:" in log and f"=> {server}:8002 SSL {SERVER}" in log, log[-2000:]
    assert any("round 2/2 done" in line for line in small["lines"])  # medflare watch, in the lead's namespace
    # each hospital's admin check, in its namespace, before the job: the server reached by its name, no FAIL
    assert set(record["preflight"]) == {"hospital-a", "hospital-b"} and "FAIL" not in record["preflight"].values()
    summary = json.loads((out / "summary.json").read_text())  # `medflare report` of the lead's download
    assert summary["rounds_completed"] == 2 and not summary["error"]
    for name in ("report.md", "rounds.csv", "FL_global_model.pt", "rehearsal.md"):
        assert (out / name).is_file(), name
    # The bar for the default suite is 2 minutes on its own: 76 s here, idle, on 2026-11-27 (a CPU that ran
    # the bare PyTorch loop at 8.2 s/round, 3.6x slower than on 2026-11-26). make test's 3 workers share 2 cores and
    # stretch it (123 s seen in CI), so what is asserted is twice that bar: a rehearsal that sits out one of its own
    # deadlines (180 s to connect, the job's 900 s) fails it; stage timings name where the time went. Inside make
    # test it took 156 s on 2026-11-28 (fresh clone, 4 workers on 2 cores), over the bar: it runs in make test-heavy.
    timings = record["timings"]
    assert set(timings) >= {"start_and_connect", "preflight", "submit", "job", "download_and_report", "close", "total"}
    assert timings["total"] <= 2 * 120, f"the small rehearsal took {timings['total']:.0f} s: {timings}"


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
def test_a_rehearsal_leaves_nothing_behind(small) -> None:
    out = small["out"]
    assert not ours()
    assert not list(out.rglob("*.key")) and not (out / "work").exists()  # the kits, with their private keys, went
    assert not out.with_name("out.partial").exists()
    assert not processes_naming(str(out))
    assert "tbf" not in subprocess.run(["tc", "qdisc"], capture_output=True, text=True).stdout


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
@needs_netns
def test_ctrl_c_mid_rehearsal_removes_everything(tmp_path: Path) -> None:
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-m", "medflare.console.deploy.rehearse", "run", "--rounds", "20", "-o",
                              str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    lines = []
    try:
        for line in child.stdout:
            lines.append(line)
            if "submitted" in line:
                break
        assert ours(child.pid), "".join(lines)
        work = out.with_name("out.partial") / "work"  # the kits and keys: this account's only, also if SIGKILLed now
        assert work.stat().st_mode & 0o077 == 0, oct(work.stat().st_mode)
        child.send_signal(signal.SIGINT)
        rest, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 128 + signal.SIGINT, "".join(lines) + rest
    assert "interrupted by SIGINT" in rest
    assert not ours(child.pid) and not processes_naming(str(out))
    assert not out.exists() and not out.with_name("out.partial").exists()
    assert out.with_name("out.failed.log").is_file()


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
@needs_netns
def test_a_server_killed_mid_job_is_resumed_and_the_report_accepts_the_resumed_job(tmp_path: Path) -> None:
    """The server SIGKILLed in round 2 of 3 and its kit started again: the lead resubmits with resume_from, the job
    finishes every round once from the checkpoint, and `medflare report` accepts the resumed job (its own plan) and
    names the crashed job (was: the resumed job carried the crashed job's plan fingerprint; report refused it)."""
    out = tmp_path / "out"
    lines: list[str] = []
    record = rehearse(Rehearsal(hospitals=2, rounds=3, faults=[Fault.server_crash("round2:3")]), out,
                      echo=lines.append)
    assert record["ok"], json.dumps(record["checks"], indent=1) + "\n".join(lines[-30:])
    crash = next(e for e in record["faults"] if "crashed_job" in e)
    assert record["jobs"] == [crash["crashed_job"], crash["resumed_job"]] and record["job_id"] == crash["resumed_job"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan_check"] == "matches" and summary["rounds_completed"] == 3
    assert f"resumed from job `{crash['crashed_job']}`" in (out / "report.md").read_text()
    assert not ours()


def _gone_within(seconds: float, left: Callable[[], list]) -> list:
    """``left()`` polled until it is empty or ``seconds`` passed; what was left last."""
    deadline = time.time() + seconds
    while (remaining := left()) and time.time() < deadline:
        time.sleep(0.5)
    return remaining


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
@needs_netns
def test_sigkill_of_medflare_rehearse_leaves_no_namespace_hosts_entry_or_process(tmp_path: Path) -> None:
    """SIGKILL while the hospitals' preflights run: its reaper removes its namespaces, /etc/netns entries and every
    process it started (the preflight included) within a bound (was: a running preflight, 5 namespaces and their
    /etc/netns entries left until the next rehearsal)."""
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-m", "medflare.console.cli", "rehearse", "--rounds", "20", "-o", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for line in child.stdout:
            lines.append(line)
            if "started from their kits and connected" in line:  # the preflights start next
                break
        preflight = f"preflight {out}"  # a hospital's preflight of its kit, below this rehearsal's folder
        assert _gone_within(30, lambda: [] if processes_naming(preflight) else ["none yet"]) == [], "".join(lines)
        made = ours(child.pid)
        assert len(set(made)) == 5, made  # the bridge, the server, 2 hospitals, the lead
        child.kill()
        child.wait()
        assert _gone_within(60, lambda: ours(child.pid)) == []
        assert _gone_within(30, lambda: processes_naming(str(out))) == []  # preflight, server, sites, the reaper
        assert not list(out.parent.rglob("*.key"))  # the kits, with their private keys
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for ns in set(ours(child.pid)):
            netns.delete_namespace(ns)
        for pid in processes_naming(str(out)):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
