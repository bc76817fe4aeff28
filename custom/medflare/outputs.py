"""Where a run's results go: safe output folders, the site logs and failure note a run leaves, and what a job that
ran elsewhere was built from. The results themselves are written by :func:`medflare.runner.write_job_outputs`.

Nothing is deleted that medflare did not write. Every folder medflare writes results into holds a marker file
(:data:`MARKER`) listing each file medflare put there with the SHA-256 of what it wrote. A non-empty folder is
refused unless the user passes ``--overwrite``; even then only the files the marker lists, still holding the content
it recorded, are removed (a file of that name with other content is someone's: kept, and a new result never replaces
it), and a new result never replaces a file medflare did not write. Results are staged in ``<target>.partial`` (marked as medflare's) and appear under their
real name only when complete; a failed or interrupted run leaves ``<target>.failed.log`` instead. Every path
medflare deletes, replaces or writes stays inside the folder it owns (a marker naming anything else is refused),
and one command at a time writes a folder (``<folder>.lock``, :class:`medflare.files.FolderLock`).

Shared by the simulator and POC runners and by ``medflare export``/``report``; it imports no reporting, so
deployment tools may use it.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from medflare import readback
from medflare.errors import ConfigError, MedflareError
from medflare.files import (  # noqa: F401  (MARKER, record_files: re-exported)
    MARKER,
    FolderLock,
    OutputError,
    atomic_write_text,
    confined,
    digests as _digests,
    files_under as _files_under,
    read_marker as _read_marker,
    record_files,
    remove_files as _remove_files,
    unchanged_files,
    write_marker as _write_marker,
)

# the encrypted model is what a secure_aggregation=he server writes instead (flare/he.py; only a site decrypts it)
MODEL_FILES = ("FL_global_model.pt", "best_FL_global_model.pt", "FL_global_model.ckks.npz")


@dataclass
class OutputTarget:
    """A result folder (``unit`` inside ``root``) that medflare may create, fill and replace.

    Attributes:
        root: the folder whose marker records every file medflare wrote into it.
        unit: the subfolder one command replaces as a whole ("" = ``root`` itself; ``export`` writes one job
            folder per call into a shared ``-o`` folder).
        overwrite: replace medflare's earlier files in a non-empty target (never anyone else's).
        merge: add the results beside what the target holds, replacing only medflare's files of the same name
            (``report`` writes into a downloaded job's folder); otherwise all of medflare's earlier files go.
        option: how the user named the folder, for messages (``--out``, ``-o``).
    """

    root: Path
    unit: str = ""
    overwrite: bool = False
    merge: bool = False
    option: str = "--out"

    def __post_init__(self) -> None:
        if self.unit and (Path(self.unit).name != self.unit or self.unit in (".", "..")):
            raise ConfigError(f"'{self.unit}' must be one folder name inside {self.option} (no '/', '.' or '..')")
        self.root = Path(self.root).resolve()
        if not self.root.name:
            raise ConfigError(f"{self.option} {self.root} is the top of the file system; medflare stages results "
                              f"beside the folder it writes, so choose a named folder (e.g. {self.option} results)")
        self._keep_staging = False  # set when publishing refused: the finished results must not be lost
        self._lock = FolderLock(self.root, self.option)  # the root: units share its marker

    @property
    def target(self) -> Path:
        return self.root / self.unit if self.unit else self.root

    @property
    def staging(self) -> Path:
        return self.target.with_name(self.target.name + ".partial")

    @property
    def failed_log(self) -> Path:
        return self.target.with_name(self.target.name + ".failed.log")

    def check(self) -> None:
        """Refuse, before anything starts, a target that is a file or already holds something (without
        ``--overwrite``), and a staging folder medflare did not make. Writes nothing."""
        for folder in (self.root, self.target):
            if folder.exists() and not folder.is_dir():
                raise ConfigError(f"{self.option} {folder} is a file, not a folder; choose a folder path")
        blocker = next((p for p in self.root.parents if p.exists() or p.is_symlink()), None)
        if blocker is not None and not blocker.is_dir():
            raise ConfigError(f"{self.option} {self.root} lies below {blocker}, which is a file, not a folder; "
                              f"choose a folder path")
        if _has_content(self.target) and not (self.overwrite or self.merge):
            what = "already exists" if self.unit else "is not empty"
            raise ConfigError(
                f"{self.option} {self.target} {what}; choose a new folder, or add --overwrite to replace "
                f"medflare's earlier results there (files medflare did not write are kept)"
            )
        if self.staging.is_symlink() or (self.staging.exists() and not (self.staging / MARKER).is_file()):
            raise ConfigError(f"{self.staging} exists and was not made by medflare; move it away or choose "
                              f"another {self.option}")
        _read_marker(self.root)  # a marker naming a path outside the folder is refused before anything runs

    def begin(self) -> Path:
        """Lock the folder for this command, then a fresh staging folder, marked as medflare's (a leftover of a
        killed medflare run is replaced). The lock is held until :meth:`publish` or :meth:`abandon`.

        Raises:
            OutputError: another command writes the folder (the message names its process).
        """
        self.check()  # a refusal creates nothing, not even the lock's folder
        self._lock.acquire()
        try:
            self.check()  # again, now that no other medflare command can change the folder
            shutil.rmtree(self.staging, ignore_errors=True)  # check() proved it is medflare's, and no one uses it
            self.staging.mkdir(parents=True)
            _write_marker(self.staging, [])
        except BaseException:
            self._lock.release()
            raise
        return self.staging

    def publish(self, source: Path | None = None) -> Path:
        """Move the staged results into the target and record them in the root's marker; return the target.

        Args:
            source: the folder inside the staging folder that holds the results (default: the staging folder).

        Raises:
            OutputError: a result would replace a file medflare did not write; the results stay staged.
        """
        source = source or self.staging
        new_files = _files_under(source)
        if not self.target.exists():
            if self.unit:
                (self.staging / MARKER).unlink(missing_ok=True)  # the root's marker records a unit's files
            else:
                _write_marker(source, new_files, _digests(source, new_files))
            source.rename(self.target)
            shutil.rmtree(self.staging, ignore_errors=True)
            if self.unit:
                self._record(new_files)
            self._lock.release()
            return self.target
        prefix = f"{self.unit}/" if self.unit else ""
        ours = {f[len(prefix):] for f in unchanged_files(self.root) if f.startswith(prefix)}
        clashes = sorted(set(new_files) & (set(_files_under(self.target)) - ours))
        if clashes:
            self._keep_staging = True
            raise OutputError(
                f"{self.target / clashes[0]} was not written by medflare (or changed since it was) and would be "
                f"replaced; the results are kept in {self.staging}. Move that file away, or choose another "
                f"{self.option}"
            )
        replaced = ours & set(new_files) if self.merge else ours
        destinations = [confined(self.target, relative, f"the result {relative}") for relative in new_files]
        # first: a result moved in below is medflare's even if the move stops half-way
        self._record(new_files, digests=_digests(source, new_files))
        _remove_files(self.target, sorted(replaced))
        for relative, destination in zip(new_files, destinations):
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source / relative, destination)
        shutil.rmtree(self.staging)
        self._record(new_files, replaced={prefix + f for f in replaced})
        self._lock.release()
        return self.target

    def abandon(self, log: str | None = None) -> Path | None:
        """Remove the staging folder (medflare's); keep ``log`` as ``<target>.failed.log`` and return its path
        (None when even the log cannot be written: the error that ended the run is the one to report)."""
        try:
            if (self.staging / MARKER).is_file() and not self._keep_staging:
                shutil.rmtree(self.staging, ignore_errors=True)  # first: on a full disk it frees room for the log
            return self._keep_log(log) if log else None
        finally:
            self._lock.release()

    def _keep_log(self, log: str) -> Path | None:
        try:
            self.failed_log.parent.mkdir(parents=True, exist_ok=True)
            return atomic_write_text(self.failed_log, log)
        except (OSError, OutputError):
            return None

    def _record(self, new_files: list[str], replaced: set[str] | None = None,
                digests: dict[str, str] | None = None) -> None:
        """Add ``new_files`` (relative to the unit) to the root's marker, with ``digests`` (default: read from
        where they now lie); ``replaced`` leaves the marker."""
        prefix = f"{self.unit}/" if self.unit else ""
        digests = digests if digests is not None else _digests(self.target, new_files)
        record_files(self.root, {prefix + f: digest for f, digest in digests.items()}, replaced or set())


def _has_content(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


SITE_FLARE_LOG = "flare_job_log.txt"  # a POC site's FLARE log of the job, kept beside its medflare log


def keep_site_logs(root: Path, out: Path, job_id: str | None = None) -> None:
    """Copy each site's local medflare log and payload audit from a run's workspace on this machine into
    ``out/sites/<site>/`` (in production those stay at the site). ``root`` holds one ``site-*`` folder per site
    (a simulator workspace, or a POC's startup kits); with ``job_id`` (POC) FLARE's own log of that job at each
    site comes too, as ``flare_job_log.txt`` (``benchmarks/round_timeline.py`` reads it)."""
    from medflare.flare.audit import AUDIT_FILE
    from medflare.site_runtime import SITE_LOG_FILE  # imports torch: only when a run has finished

    under = f"{job_id}/**" if job_id else "**"  # a POC keeps every job's folder; the simulator runs one job
    patterns = {name: f"site-*/{under}/{name}" for name in (SITE_LOG_FILE, AUDIT_FILE)}
    if job_id:
        patterns[SITE_FLARE_LOG] = f"site-*/{job_id}/log.txt"
    for name, pattern in patterns.items():
        for log in sorted(root.glob(pattern)):
            site = log.relative_to(root).parts[0]
            (out / "sites" / site).mkdir(parents=True, exist_ok=True)
            shutil.copy(log, out / "sites" / site / name)


# the executor's one line for a task a site could not do (flare/executor.py): "<site>: task '<name>' failed: <why>"
SITE_TASK_ERROR = re.compile(r"(?P<site>[\w.-]+): task '[^']+' (?:failed|crashed|declined): .*")


def first_site_error(root: Path) -> str | None:
    """The earliest line, over every site's FLARE log below ``root`` (``site-*/**/log.txt``: a simulator
    workspace), in which a site says why it could not do a task: that line from the site's name on, whole (FLARE's
    timestamps order the sites' logs); None when no site said so."""
    found: list[tuple[str, str]] = []
    for log in sorted(root.glob("site-*/**/log.txt")):
        for line in log.read_text(errors="replace").splitlines():
            match = SITE_TASK_ERROR.search(line)
            if match:
                found.append((line[:match.start()], match.group(0)))  # the prefix starts with the timestamp
                break
    return min(found)[1] if found else None


def first_site_said(root: Path) -> str:
    """:func:`first_site_error` as the end of a failed run's one-line error ("" when no site gave one)."""
    said = first_site_error(root)
    return f". The first site error: {said}" if said else ""


def failure_note(rounds: int, search_root: Path, exc: BaseException) -> str:
    """The closing line of a failure log: why the run ended and how many rounds the server finished.

    Args:
        rounds: the rounds the run was to have.
        search_root: folder holding the server's workspace (the controller writes its results every round).
        exc: what ended the run.
    """
    from medflare.flare.controller import RESULTS_FILE

    finished = 0
    for results in search_root.glob(f"**/app_server/{RESULTS_FILE}"):
        try:
            finished = max(finished, len(readback.load_json(results).get("rounds", [])))
        except (MedflareError, AttributeError, TypeError):
            continue
    reason = f"interrupted by {exc}" if isinstance(exc, KeyboardInterrupt) else f"failed: {type(exc).__name__}: {exc}"
    return f"\nmedflare: run {reason}; rounds finished: {finished}/{rounds}\n"


# ----- results of a job that ran elsewhere (downloaded from POC/production, or a simulator workspace) -------
def recorded_launch(folder: Path) -> float | None:
    """When medflare launched the run whose outputs ``folder`` holds (``summary.json``'s ``timing.launched_at``),
    so that a report on a run folder gives the run's own start-up; None for a job launched elsewhere."""
    path = folder / "summary.json"
    try:
        launched_at = readback.load_json(path, ConfigError).get("timing", {}).get("launched_at")
    except (MedflareError, AttributeError):
        return None  # no summary, or not one medflare wrote: the launch is unknown
    return float(launched_at) if isinstance(launched_at, (int, float)) and not isinstance(launched_at, bool) else None


def _app_dir_of(results_dir: Path) -> Path:
    """Where the job config of these results is: beside them (``app_server/``), or in a medflare run folder the
    app of the one job it ran (``job/<name>/app/``)."""
    if (results_dir / "config").is_dir():
        return results_dir
    apps = sorted(results_dir.glob("job/*/app"))
    return apps[0] if len(apps) == 1 and (apps[0] / "config").is_dir() else results_dir


def job_run_config(folder: Path) -> Any:
    """The RunConfig a job was built from, read back from its app config (``config_fed_server/client``) in
    ``folder`` (``app_server/``) or in the one job of the medflare run folder ``folder``."""
    return job_run_and_plan(folder)[0]


def job_run_and_plan(folder: Path) -> tuple[Any, Any]:
    """The RunConfig and the RunPlan of the job whose app config is in ``folder`` (see :func:`job_run_config`),
    rebuilt as the server rebuilt its own (``plan.job_from_app``)."""
    from medflare.plan import job_from_app

    app_dir = _app_dir_of(folder)
    meta_path = next((p for p in (app_dir.parent / "meta.json", app_dir.parent.parent / "meta.json") if p.is_file()),
                     None)
    try:
        return job_from_app(app_dir / "config", meta_path)
    except ConfigError as exc:
        raise ConfigError(f"{app_dir / 'config'}: {exc}; a report needs the job config FLARE keeps in "
                          "app_server/config/") from exc
