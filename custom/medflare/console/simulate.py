"""Run a medflare job in FLARE's own simulator and collect its results into the run folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from medflare.console.files import OutputTarget
from medflare.console.job_export import write_job
from medflare.console.launch import failure_note, first_site_said, keep_site_logs, write_job_outputs
from medflare.console.processes import nvflare_command, signals_held, start_kept, stop_process_tree
from medflare.errors import ConfigError, MedflareError
from medflare.flare.controller import RESULTS_FILE
from medflare.flare.memory import with_allocator_settings
from medflare.flare.tracking import keep_server_records
from medflare.plan import RunPlan, describe_sites
from medflare.resume import check_resumable
from medflare.site_runtime import SITE_LOG_FILE

__all__ = ["SimulationError", "nvflare_command", "run_simulation"]

# Simulator log lines worth showing live: round progress, per-site epochs, rejections, errors.
PROGRESS = re.compile(r"medflare:|round \d+/\d+ epoch|REJECTED|ERROR|Error:")
MESSAGE_START = re.compile(r"medflare:|[\w.-]+: round \d+/|round \d+: REJECTED")
SIMULATOR_LOG = "simulator.log"
# FLARE's simulator's line (server/error_log.txt) for a site's worker gone (died, or lost its port to a simulator
# started at the same moment): never restarted, the job would wait out the task timeout (an hour by default).
LOST_SITE = re.compile(r"(?:Communication error with|Subprocess died for) client ([\w.-]+)")
SERVER_ERROR_LOG = Path("server") / "error_log.txt"
# What FLARE 2.9 logs once a participant's run is over: the server's runner after END_RUN and its cleanup
# (server/log.txt), a site's runner once its END_RUN handlers have returned (site-*/log.txt).
SERVER_RUN_ENDED = re.compile(r"ServerRunner - INFO - .*Server runner finished\.")
SITE_RUN_ENDED = re.compile(r"ClientRunner - INFO - .*END_RUN fired")


# no startup kits, so no provisioned TenSEAL contexts (FLARE's FedAvgRecipeWithHE refuses SimEnv likewise)
SIMULATOR_HAS_NO_HE = ("secure_aggregation=he needs the TenSEAL contexts FLARE's HEBuilder provisions into startup "
                       "kits, which the simulator has none of; run it in a POC (medflare run --env poc, or "
                       "python -m medflare.console.deploy.poc run) or in production")


class SimulationError(MedflareError, RuntimeError):
    """The FLARE simulator exited with an error."""


def run_simulation(plan: RunPlan, out_dir: str | Path, echo: Callable[[str], None] = print,
                   overwrite: bool = False) -> dict[str, Any]:
    """Write the job of ``plan`` (``plan.resolve(run, "byoc")``), run ``nvflare simulator`` with one thread per site,
    and write the run's outputs through :class:`medflare.console.files.OutputTarget` (a failure stops every process and
    leaves ``<out>.failed.log``)."""
    if plan.secure_aggregation == "he":
        raise ConfigError(SIMULATOR_HAS_NO_HE)
    target = OutputTarget(Path(out_dir), overwrite=overwrite)
    target.check()
    clients, _ = describe_sites(plan)  # bad data fails before anything is written
    if plan.resume_from:  # same method, model and stages, more rounds: before anything is written
        check_resumable(plan, plan.resume_from)
    staging = target.begin()
    workspace = staging / "workspace"
    rounds = len(plan.rounds)
    try:
        # BYOC: the simulator enforces the same class allow-list as a real site, and a simulated site has not
        # allow-listed medflare; carrying the code is what a researcher submitting to POC does too.
        job_dir = write_job(plan, staging / "job", "byoc")
        launched_at = time.time()
        _launch(len(plan.sites), job_dir, workspace, staging / SIMULATOR_LOG, echo)
        keep_site_logs(workspace, staging)
        keep_server_records(_server_app_dir(workspace).parent, staging)  # TensorBoard / MLflow records
        _plot_site_logs(plan, staging)  # before the report, which shows every plot of the run
        summary = write_job_outputs(plan, _results_file(workspace), staging, clients, launched_at)
        if summary.get("error"):
            raise SimulationError(f"the job stopped early: {summary['error']}{first_site_said(workspace)}")
        finished = rounds == summary["rounds_completed"] or summary.get("stopped_early")
        if not finished:  # e.g. sites that could not even load the job
            raise SimulationError(
                f"the job completed {summary['rounds_completed']} of {rounds} rounds without an error from the "
                f"server{first_site_said(workspace)}; the sites' errors are in the simulator log kept as "
                f"{Path(out_dir).name}.failed.log"
            )
        shutil.rmtree(workspace, ignore_errors=True)  # logs stay in simulator.log; the model is copied out
        target.publish()
        return summary
    except BaseException as exc:
        with signals_held():
            target.abandon(_failure_log(rounds, staging, workspace, exc))
        raise


class LogTail:
    """The lines a growing log file gained since the last call (a partial last line waits for its end)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, ""

    def new_lines(self) -> list[str]:
        if not self.path.is_file():
            return []
        with self.path.open("rb") as log:
            log.seek(self.offset)
            data = log.read()
        self.offset += len(data)
        *lines, self.partial = (self.partial + data.decode(errors="replace")).split("\n")
        return lines


class SimulatorWatch(threading.Thread):
    """Follows FLARE's simulator's workspace logs and stops it on a lost site (:data:`LOST_SITE`, kept as
    ``reason``: it could never finish) or once the server runner and every site have ended the run: what follows is
    FLARE's ~5 s shutdown grace with nothing left to write (``ended_job``; the outcome is then medflare's results)."""

    def __init__(self, workspace: Path, proc: subprocess.Popen, sites: int, period_seconds: float = 0.2) -> None:
        super().__init__(name="medflare-simulator-watch", daemon=True)
        self.proc, self.period_seconds = proc, period_seconds
        self.errors = LogTail(workspace / SERVER_ERROR_LOG)
        # the logs still to say their run ended, each with the line that says it
        self.running = [(LogTail(workspace / "server" / "log.txt"), SERVER_RUN_ENDED)] + [
            (LogTail(workspace / f"site-{i}" / "log.txt"), SITE_RUN_ENDED) for i in range(1, sites + 1)]
        self.reason: str | None = None
        self.ended_job = False
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period_seconds) and self.proc.poll() is None:
            self.reason = _lost_site_line(self.errors.new_lines())
            if self.reason:
                stop_process_tree(self.proc)
                return
            self.running = [(log, ended) for log, ended in self.running
                            if not any(ended.search(line) for line in log.new_lines())]
            if not self.running:
                self.ended_job = True
                stop_process_tree(self.proc, grace_seconds=5.0)
                return


def lost_site(error_log: Path) -> str | None:
    """The first line of FLARE's simulator error log that reports a lost site, or None."""
    return _lost_site_line(LogTail(error_log).new_lines())


def _lost_site_line(lines: list[str]) -> str | None:
    return next((line.strip() for line in lines if LOST_SITE.search(line)), None)


def _launch(sites: int, job_dir: Path, workspace: Path, log_path: Path, echo: Callable[[str], None]) -> None:
    command = nvflare_command() + ["simulator", str(job_dir), "-w", str(workspace), "-n", str(sites), "-t", str(sites)]
    env = with_allocator_settings({**os.environ, "PYTHONUNBUFFERED": "1"})  # the workers inherit it
    tail: list[str] = []
    with log_path.open("w") as log:
        # through a keeper: the simulator and its workers (each in its own session) die with medflare, SIGKILL too
        proc = start_kept(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        watch = SimulatorWatch(workspace, proc, sites)
        watch.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line.rstrip()])[-40:]
                if PROGRESS.search(line):
                    echo(_shorten(line.rstrip()))
            code = proc.wait()
        except BaseException:
            with signals_held():  # nor may a second stop request cut this short
                stop_process_tree(proc)  # an interrupted run must not leave sites training in the background
            raise
        finally:
            watch.done.set()
            watch.join()  # it may still be stopping the simulator's processes
            if proc.stdout is not None:
                proc.stdout.close()
    if watch.reason:
        site = LOST_SITE.search(watch.reason).group(1)
        raise SimulationError(
            f"FLARE's simulator lost {site} and cannot finish the job, so medflare stopped it. The simulator said: "
            f"{_shorten(watch.reason).strip()}. It does not restart a lost site. Usual causes: another simulator "
            "started at the same moment on this machine (both can be given the same free port), or the site's "
            "process was killed (out of memory). Rerun the job; if it repeats, run one simulator at a time."
        )
    if code != 0 and not watch.ended_job:
        raise SimulationError(
            f"nvflare simulator exited with code {code}. Last lines of its log:\n" + "\n".join(tail[-20:])
        )


def _failure_log(rounds: int, staging: Path, workspace: Path, exc: BaseException) -> str:
    """The simulator log plus one closing line: why the run ended and how many rounds finished."""
    log = staging / SIMULATOR_LOG
    text = log.read_text(errors="replace") if log.is_file() else ""
    return text + failure_note(rounds, workspace, exc)


def _shorten(line: str) -> str:
    """Drop FLARE's timestamp/logger prefix so progress lines stay readable."""
    match = MESSAGE_START.search(line)
    return "  " + (line[match.start():] if match else line[-200:])


def _plot_site_logs(plan: RunPlan, out: Path) -> None:
    """Draw each simulated site's local diagnostics with the method's own plot, if it has one."""
    plot = plan.spec.site_log_plot
    for log in sorted(out.glob(f"sites/*/{SITE_LOG_FILE}")) if plot else []:
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        plot(records, log.with_name("diagnostics.png"))


def _server_app_dir(workspace: Path) -> Path:
    candidates = sorted(workspace.glob("server/simulate_job/app_server")) + sorted(workspace.glob("**/app_server"))
    if not candidates:
        raise SimulationError(f"no server app folder under {workspace}: the simulator did not start the job")
    return candidates[0]


def _results_file(workspace: Path) -> Path:
    path = _server_app_dir(workspace) / RESULTS_FILE
    if not path.is_file():
        raise SimulationError(f"the job wrote no {RESULTS_FILE}; see simulator.log for the cause")
    return path

