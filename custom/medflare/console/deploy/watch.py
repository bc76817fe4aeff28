"""Follow a POC or production job round by round: ``medflare watch JOB_ID`` (and ``medflare run --env poc``).

An admin session (FLARE's Session API, with an admin startup kit) polls the job through FLARE's ``monitor_job``;
at every poll it prints the controller's new progress entries from ``show_stats`` (any role with the ``view`` right
may read them), in the simulator's words. Rounds that finished between the last two polls are read from the ended
job's results file, if the user may download the job.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Callable

from medflare.errors import MedflareError
from medflare.flare.progress import STATS_GROUP, entries_from_results, failure_cause, format_progress

Echo = Callable[[str], None]
FINISHED_OK = "FINISHED:COMPLETED"
KIT_ENV = "NVFLARE_STARTUP_KIT_DIR"


class WatchError(MedflareError, RuntimeError):
    """The job could not be followed (no session, unknown job)."""


def kit_username(startup: Path, admin: dict[str, Any]) -> str:
    """The admin user a kit logs in as: its ``fed_admin.json`` username, else (POC kits leave it empty and take
    the identity from the certificate, ``uid_source: cert``) the common name of its client certificate, as FLARE
    does; "" when neither says."""
    if admin.get("username"):
        return str(admin["username"])
    cert = startup / str(admin.get("client_cert", "client.crt"))
    if admin.get("uid_source") != "cert" or not cert.is_file():
        return ""
    from nvflare.private.fed.utils.identity_utils import get_cn_from_cert, load_cert_file

    try:
        return str(get_cn_from_cert(load_cert_file(str(cert))) or "")
    except Exception:  # noqa: BLE001 - an unreadable certificate: FLARE's login will say why
        return ""


def as_user(username: str) -> str:
    """The words ' as USER' for a message, or '' when the user is not known."""
    return f" as {username}" if username else ""


class ProgressPrinter:
    """Prints each progress entry once to ``echo``, however often it is read again."""

    def __init__(self, echo: Echo = print) -> None:
        self.echo = echo
        self.shown = 0

    def show(self, entries: list[dict[str, Any]]) -> None:
        """Print the entries not printed yet (entries only ever grow)."""
        for entry in entries[self.shown:]:
            self.echo(f"  {format_progress(entry)}")
        self.shown = max(self.shown, len(entries))


def progress_entries(session: Any, job_id: str) -> list[dict[str, Any]]:
    """The controller's progress entries from FLARE's show_stats (empty while the job is not running)."""
    try:
        stats = session.show_stats(job_id, "server")
    except Exception:  # noqa: BLE001 - a job that is starting or ending answers nothing useful
        return []
    for target in stats.values() if isinstance(stats, dict) else []:
        group = target.get(STATS_GROUP) if isinstance(target, dict) else None
        if isinstance(group, dict) and isinstance(group.get("progress"), list):
            return group["progress"]
    return []


def watch_job(session: Any, job_id: str, echo: Echo = print, timeout: float = 0, poll_interval: float = 2.0) -> str:
    """Print the job's per-round progress until it ends (or ``timeout`` seconds, 0 = no limit, have passed: then
    "RUNNING"); return its final status (e.g. FINISHED:COMPLETED). ``session``: an open FLARE Session."""
    printer = ProgressPrinter(echo)

    def on_poll(sess: Any, polled_job: str, job_meta: dict, *args: Any, **kwargs: Any) -> bool:
        if job_meta.get("status") == "RUNNING":
            printer.show(progress_entries(sess, polled_job))
        return True

    try:
        _, meta = session.monitor_job_and_return_job_meta(job_id, timeout=timeout, poll_interval=poll_interval,
                                                          cb=on_poll)
    except Exception as exc:  # noqa: BLE001 - FLARE raises its own types for an unknown job or a lost session
        raise WatchError(f"cannot follow job {job_id}: {exc}") from exc
    if meta is None:
        return "RUNNING"  # timed out while the job runs on
    missed = _results_of_finished_job(session, job_id)
    if missed is not None and len(entries := entries_from_results(missed)) >= printer.shown:
        printer.show(entries)
    status = str(meta.get("status"))
    if status != FINISHED_OK:  # FLARE's status says that it failed; the results say why, where the user looks
        cause = failure_cause(missed) if missed is not None else ""
        echo(f"  why: {cause}" if cause else "  why: not in what this account can read of the job; see the "
                                            "server's log (and the sites' logs)")
    return status


def _results_of_finished_job(session: Any, job_id: str) -> dict[str, Any] | None:
    """The results file of an ended job, or None when it cannot be downloaded (no right, no file)."""
    from medflare.flare.controller import RESULTS_FILE

    with tempfile.TemporaryDirectory(prefix="medflare-watch-") as folder:
        try:
            download = Path(session.download_job_result(job_id, folder))
        except Exception:  # noqa: BLE001 - a member may view but not download: the polls are all there is
            return None
        found = sorted(download.glob(f"**/app_server/{RESULTS_FILE}"))
        return json.loads(found[0].read_text()) if found else None


def watch(job_id: str, kit: Path, username: str, echo: Echo = print, timeout: float = 0,
          poll_interval: float = 2.0) -> str:
    """Open an admin session with ``kit`` and :func:`watch_job`; the session is always closed."""
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    from medflare.console.processes import confine_flare_config_search

    confine_flare_config_search(Path(kit))
    try:
        session = new_secure_session(username, str(kit), timeout=30)
    except Exception as exc:  # noqa: BLE001 - connection and login failures come as several FLARE types
        raise WatchError(f"cannot open an admin session with {kit}{as_user(username)}: {exc}") from exc
    try:
        return watch_job(session, job_id, echo, timeout, poll_interval)
    finally:
        session.close()
