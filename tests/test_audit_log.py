"""site_policy.AuditLog: a site's hash-chained audit log, each line on disk as it happens (issue 60, item 5)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from medflare.errors import ConfigError
from medflare.plan import resolve, validated
from medflare.run_config import RunConfig
from medflare.site_policy import AUDIT_FILE, AUDIT_GENESIS, AuditLog, audit_file, line_hash, verify_audit


@pytest.fixture(scope="module")
def plan():
    run = RunConfig(method="fedavg", data={"source": "site"}, task={"num_classes": 2, "in_channels": 1,
                                                                    "image_size": 28})
    return resolve(validated(run, check_files=False), "preinstalled")


def two_jobs(path: Path, plan) -> bytes:
    """A log of a job that ran two tasks and ended, then one that was declined: 5 lines."""
    first = AuditLog(path, "job-1", plan)
    first.decided("accepted")
    for round_index in range(2):
        first.task("train", round_index, {"w": np.zeros(4, np.float32)}, {"n_samples": 60})
    first.close()
    AuditLog(path, "job-2", plan).decided("declined", "the job has no dp_sgd, which this site requires")
    return path.read_bytes()


def test_each_line_carries_the_hash_of_the_line_before_it(tmp_path: Path, plan) -> None:
    data = two_jobs(tmp_path / AUDIT_FILE, plan)
    lines = data.splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["event"] for r in records] == ["decision", "task", "task", "end", "decision"]
    assert [r["prev"] for r in records] == [AUDIT_GENESIS] + [line_hash(line) for line in lines[:-1]]
    chain = verify_audit(data)
    assert (chain.broken, chain.records, chain.head) == (None, records, line_hash(lines[-1]))
    assert records[1]["arrays"] == {"w": 16} and (records[1]["array_count"], records[1]["bytes"]) == (1, 16)
    assert {k: records[3][k] for k in ("tasks", "failed", "bytes")} == {"tasks": 2, "failed": 0, "bytes": 32}


def _edit_line(lines: list[bytes]) -> list[bytes]:
    record = json.loads(lines[1])
    record["arrays"] = {"w": 0}  # the site "sent nothing" in that round
    return [lines[0], json.dumps(record).encode(), *lines[2:]]


TAMPERING: dict[str, tuple[Callable[[list[bytes]], list[bytes]], int]] = {
    # what was done to the 5 lines of two_jobs, and the first line the chain breaks at
    "a task line edited": (_edit_line, 3),
    "a task line removed": (lambda lines: [lines[0], *lines[2:]], 2),
    "a line inserted": (lambda lines: [lines[0], lines[1], lines[1], *lines[2:]], 3),
    "the lines reordered": (lambda lines: [lines[0], lines[2], lines[1], *lines[3:]], 2),
    "the first line removed": (lambda lines: lines[1:], 1),
    "a line that is not JSON": (lambda lines: [*lines[:2], b"round 2: nothing sent", *lines[2:]], 3),
    "a line that is a JSON list": (lambda lines: [*lines[:4], b"[1, 2]", lines[4]], 5),
    "a line that is not UTF-8": (lambda lines: [*lines[:4], b"\xff\xfe", lines[4]], 5),
    "a blank line": (lambda lines: [*lines[:4], b"", lines[4]], 5),
    "a line nested past the parser's limit": (lambda lines: [lines[0], b"[" * 100_000, *lines[1:]], 2),
}


@pytest.mark.parametrize("case", TAMPERING)
def test_the_verifier_names_the_first_line_that_breaks_the_chain(tmp_path: Path, plan, case: str) -> None:
    tamper, broken = TAMPERING[case]
    lines = two_jobs(tmp_path / AUDIT_FILE, plan).splitlines()
    chain = verify_audit(b"\n".join(tamper(lines)) + b"\n")
    assert chain.broken == broken and chain.why, chain
    assert len(chain.records) == broken - 1  # the lines before it hold


def test_a_log_from_before_the_chain_fails_at_its_first_line_and_new_lines_chain_onto_it(tmp_path: Path,
                                                                                          plan) -> None:
    path = tmp_path / AUDIT_FILE
    legacy = json.dumps({"job_id": "old", "plan": "0" * 12, "method": "fedavg", "tasks": [], "decision": "accepted"})
    path.write_text(legacy + "\n")
    AuditLog(path, "job-1", plan).decided("accepted")
    chain = verify_audit(path.read_bytes())
    assert chain.broken == 1 and "does not carry the first line's prev" in chain.why
    assert json.loads(path.read_bytes().splitlines()[1])["prev"] == line_hash(legacy.encode())


def test_a_torn_last_line_stays_a_line_of_its_own_and_the_verifier_names_it(tmp_path: Path, plan) -> None:
    path = tmp_path / AUDIT_FILE
    AuditLog(path, "job-1", plan).decided("accepted")
    with path.open("ab") as log:
        log.write(b'{"job_id": "job-1", "event": "ta')  # a write cut short (power lost mid-line)
    AuditLog(path, "job-2", plan).decided("accepted")
    lines = path.read_bytes().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["prev"] == line_hash(lines[1])
    assert verify_audit(path.read_bytes()).broken == 2


def test_the_last_line_is_found_from_the_end_of_a_log_longer_than_one_read(tmp_path: Path, plan) -> None:
    path = tmp_path / AUDIT_FILE
    log = AuditLog(path, "job-1", plan)
    log.decided("accepted")
    for round_index in range(40):  # ~ 300 bytes a line: several 4 KiB reads back to a line's start
        log.task("train", round_index, {f"layer{i}.weight": np.zeros(3) for i in range(8)}, {"n_samples": 60})
    assert verify_audit(path.read_bytes()).broken is None


def test_each_line_is_on_disk_before_the_site_goes_on(tmp_path: Path, plan, monkeypatch) -> None:
    import os

    synced: list[int] = []
    path = tmp_path / AUDIT_FILE
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(len(path.read_bytes().splitlines())))
    log = AuditLog(path, "job-1", plan)
    log.decided("accepted")
    log.task("train", 0, {"w": np.zeros(2)}, {})
    log.failed("validate", "DataError: no test images")
    log.close()
    assert synced == [1, 2, 3, 4]  # one fsync per line, right after it was written


@pytest.mark.parametrize("name", ["../medflare_audit.jsonl", "/tmp/medflare_audit.jsonl", "logs/../../x.jsonl", "."])
def test_an_audit_log_named_outside_local_is_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / "local").mkdir()
    with pytest.raises(ConfigError, match=r"^policy.audit_log '.*' is not a file inside the site's .*local folder"):
        audit_file(tmp_path / "local", name)


def test_an_audit_log_whose_path_leads_out_of_local_through_a_symlink_is_refused(tmp_path: Path) -> None:
    local = tmp_path / "local"
    (local / "logs").mkdir(parents=True)
    (local / AUDIT_FILE).symlink_to(tmp_path / "elsewhere.jsonl")
    (local / "out").symlink_to(tmp_path, target_is_directory=True)
    for name in (AUDIT_FILE, "out/audit.jsonl"):
        with pytest.raises(ConfigError, match="a symlink leads out of it"):
            audit_file(local, name)
    assert audit_file(local, "logs/audit.jsonl") == (local / "logs" / "audit.jsonl").resolve()


def test_a_numpy_epsilon_is_written_as_a_json_number(tmp_path: Path, plan) -> None:
    path = tmp_path / AUDIT_FILE
    log = AuditLog(path, "job-1", plan)
    log.task("train", 0, {}, {"dp_epsilon": np.float32(0.5)})
    log.close()
    task, end = verify_audit(path.read_bytes()).records
    assert (task["dp_epsilon"], end["dp_epsilon_spent"]) == (0.5, 0.5)
