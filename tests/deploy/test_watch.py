"""``medflare watch`` against a stand-in FLARE session: each round printed once, in order, with the rounds the
polls missed read from the finished job's results; the admin kit resolved or refused in one line.
(``test_poc_progress_and_tracking.py`` runs the real thing against a POC.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from medflare.console.deploy.poc import admin_kit
from medflare.console.deploy.watch import ProgressPrinter, progress_entries, watch_job
from medflare.errors import ConfigError
from medflare.flare.progress import STATS_GROUP, entries_from_results, format_progress
from medflare.flare.run_results import RunResults, declined_text, new_record

EVALUATION = {"sites": ["site-1", "site-2"], "test": {"balanced_accuracy": 0.5}}
RESULTS = {
    "num_rounds": 3,
    "rounds": [{"round": r, "wall_seconds": 1.0, "share": {"site-1": 0.5, "site-2": 0.5}} for r in range(3)],
    "evaluations": {str(v): EVALUATION for v in range(3)},
    "final": {"model_version": 3, **EVALUATION},
}
ALL_ENTRIES = entries_from_results(RESULTS)


class FakeSession:
    """FLARE's Session as watch uses it: the job runs for a few polls, growing its progress, then finishes."""

    def __init__(self, tmp_path: Path, shown_per_poll: list[int], downloadable: bool = True,
                 status: str = "FINISHED:COMPLETED", results: dict = RESULTS) -> None:
        self.tmp_path, self.shown_per_poll, self.downloadable = tmp_path, shown_per_poll, downloadable
        self.poll, self.status, self.results = 0, status, results

    def show_stats(self, job_id: str, target_type: str) -> dict:
        count = self.shown_per_poll[self.poll]
        return {"server": {"ServerRunner": {"status": "started"},
                           STATS_GROUP: {"num_rounds": 3, "progress": ALL_ENTRIES[:count]}}}

    def monitor_job_and_return_job_meta(self, job_id, timeout=0.0, poll_interval=2.0, cb=None):
        for poll in range(len(self.shown_per_poll)):
            self.poll = poll  # what show_stats shows at this poll
            cb(self, job_id, {"status": "RUNNING"})
        return "JOB_FINISHED", {"status": self.status}

    def download_job_result(self, job_id: str, destination: str) -> str:
        if not self.downloadable:
            raise PermissionError("not authorized for download_job")
        app = Path(destination) / job_id / "workspace" / "app_server"
        app.mkdir(parents=True)
        (app / "medflare_results.json").write_text(json.dumps(self.results))
        return str(Path(destination) / job_id)


def test_each_round_is_printed_once_and_the_missed_ones_come_from_the_results(tmp_path: Path) -> None:
    lines: list[str] = []
    status = watch_job(FakeSession(tmp_path, [0, 2, 2, 4]), "job-1", lines.append)
    assert status == "FINISHED:COMPLETED"
    assert lines == [f"  {format_progress(e)}" for e in ALL_ENTRIES]  # the last round and final only in results


def test_without_the_download_right_the_polled_rounds_are_what_is_shown(tmp_path: Path) -> None:
    lines: list[str] = []
    watch_job(FakeSession(tmp_path, [1, 3], downloadable=False), "job-1", lines.append)
    assert lines == [f"  {format_progress(e)}" for e in ALL_ENTRIES[:3]]


def test_a_failed_job_is_shown_with_its_first_cause_not_only_flares_status(tmp_path: Path) -> None:
    """Issue 61, item 4: a job one site's policy declined showed only FINISHED:EXECUTION_EXCEPTION; the reason was
    a line in the server's log. Now watch prints the declining site, its reason and the server's error."""
    record = {**new_record(0, 0.0), "failed": {"site-2": declined_text("EXECUTION_EXCEPTION", "policy")}}
    results = RunResults("balanced_accuracy")
    results.fail_round(record, "train")  # what the controller keeps of the round that ended the job
    declined = {**results.data, "num_rounds": 3, "error": "round 1: only 1 site(s) sent a valid result, 2 needed"}
    lines: list[str] = []
    status = watch_job(FakeSession(tmp_path, [0], status="FINISHED:EXECUTION_EXCEPTION", results=declined), "job-1",
                       lines.append)
    assert status == "FINISHED:EXECUTION_EXCEPTION"
    assert lines[-1] == ("  why: round 1: site-2 EXECUTION_EXCEPTION: declined: its site policy declines the job "
                         "(methods or required defences) | the server: round 1: only 1 site(s) sent a valid result, "
                         "2 needed")
    unreadable: list[str] = []
    watch_job(FakeSession(tmp_path / "other", [0], downloadable=False, status="FINISHED:ABNORMAL"), "job-2",
              unreadable.append)
    assert unreadable[-1].startswith("  why: not in what this account can read of the job; see the server's log")
    completed: list[str] = []
    watch_job(FakeSession(tmp_path / "ok", [0]), "job-3", completed.append)
    assert not any(line.startswith("  why:") for line in completed)


def test_printer_never_repeats_and_survives_a_shorter_read() -> None:
    lines: list[str] = []
    printer = ProgressPrinter(lines.append)
    printer.show(ALL_ENTRIES[:2])
    printer.show(ALL_ENTRIES[:1])
    printer.show(ALL_ENTRIES[:3])
    assert lines == [f"  {format_progress(e)}" for e in ALL_ENTRIES[:3]]


def test_stats_without_medflare_progress_give_no_entries() -> None:
    class NotRunning:
        def show_stats(self, job_id, target_type):
            raise RuntimeError("job is not running")

    assert progress_entries(NotRunning(), "job-1") == []


def test_admin_kit_is_read_from_the_kit_and_refused_in_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("NVFLARE_STARTUP_KIT_DIR", raising=False)
    kit = tmp_path / "lead@hospital-a.org"
    (kit / "startup").mkdir(parents=True)
    (kit / "startup" / "fed_admin.json").write_text(json.dumps({"admin": {"username": "lead@hospital-a.org"}}))
    assert admin_kit(str(kit)) == (kit, "lead@hospital-a.org")
    monkeypatch.setenv("NVFLARE_STARTUP_KIT_DIR", str(kit))
    assert admin_kit(None, None)[1] == "lead@hospital-a.org"
    with pytest.raises(ConfigError, match="is not an admin startup kit"):
        admin_kit(str(tmp_path))
    monkeypatch.delenv("NVFLARE_STARTUP_KIT_DIR")
    with pytest.raises(ConfigError, match="no medflare POC is prepared there"):
        admin_kit(None, str(tmp_path / "nothing"))


def write_poc_admin_kit(kit: Path, common_name: str | None) -> Path:
    """An admin kit as FLARE's POC provisioning writes it: no username, the identity in the client certificate."""
    (kit / "startup").mkdir(parents=True)
    admin = {"username": "", "uid_source": "cert", "client_cert": "client.crt"}
    (kit / "startup" / "fed_admin.json").write_text(json.dumps({"admin": admin}))
    if common_name is not None:
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
                .sign(key, hashes.SHA256()))
        (kit / "startup" / "client.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return kit


def test_a_poc_kit_names_the_admin_of_its_certificate(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("NVFLARE_STARTUP_KIT_DIR", raising=False)
    kit = write_poc_admin_kit(tmp_path / "lead", "lead@hospital-a.org")
    assert admin_kit(str(kit)) == (kit, "lead@hospital-a.org")


def test_watch_says_as_whom_it_follows_and_leaves_the_words_out_when_unknown(tmp_path: Path, monkeypatch,
                                                                            capsys) -> None:
    import medflare.console.deploy.watch as watch_module
    from medflare.console.cli import main

    monkeypatch.delenv("NVFLARE_STARTUP_KIT_DIR", raising=False)
    followed: list[str] = []
    monkeypatch.setattr(watch_module, "watch", lambda job_id, kit, user, **kwargs: followed.append(user) or
                        "FINISHED:COMPLETED")
    known = write_poc_admin_kit(tmp_path / "known", "lead@hospital-a.org")
    assert main(["watch", "job-1", "--startup-kit", str(known)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "medflare: following job job-1 as lead@hospital-a.org"
    unknown = write_poc_admin_kit(tmp_path / "unknown", None)  # no certificate to read a name from
    assert main(["watch", "job-1", "--startup-kit", str(unknown)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "medflare: following job job-1"
    assert followed == ["lead@hospital-a.org", ""]
