"""Run a medflare job in FLARE's own simulator and collect its results into the run folder."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from medflare.errors import MedflareError
from medflare.flare.controller import RESULTS_FILE
from medflare.job_export import export_job
from medflare.report import build_summary, write_outputs
from medflare.run_config import RunConfig
from medflare.site_runtime import SITE_LOG_FILE

# Simulator log lines worth showing live: round progress, per-site epochs, rejections, errors.
PROGRESS = re.compile(r"medflare:|round \d+/\d+ epoch|REJECTED|ERROR|Error:")
MESSAGE_START = re.compile(r"medflare:|[\w.-]+: round \d+/|round \d+: REJECTED")


class SimulationError(MedflareError, RuntimeError):
    """The FLARE simulator exited with an error."""


def nvflare_command() -> list[str]:
    """The nvflare CLI of *this* interpreter's environment (never whatever is first on PATH)."""
    candidate = Path(sys.executable).with_name("nvflare")
    return [str(candidate)] if candidate.exists() else [sys.executable, "-m", "nvflare.cli"]


def shot_groups_for(run: RunConfig, class_counts: list[int] | None) -> dict | None:
    """Head/medium/tail class ids from global training counts, when thresholds are configured."""
    if not run.shot_thresholds or class_counts is None:
        return None
    from medflare.metrics import shot_groups_from_counts

    head_min, tail_max = run.shot_thresholds
    return shot_groups_from_counts(class_counts, head_min=head_min, tail_max=tail_max)


def describe_sites(run: RunConfig) -> tuple[dict[str, Any], list[int] | None]:
    """Per-site partition facts (simulation only) and global training class counts."""
    if run.data.get("source", "site") == "site":
        return {}, None
    from medflare.config import from_dict
    from medflare.data import DataConfig, describe_partition

    data_cfg = from_dict(DataConfig, {**run.site_data(), "num_classes": run.task_spec().num_classes}, "data")
    facts = describe_partition(data_cfg)
    sites = {name: facts[i] for i, name in enumerate(run.site_names)}
    totals = [sum(int(f["class_counts"][k]) for f in facts) for k in range(len(facts[0]["class_counts"]))]
    return sites, totals


def run_simulation(run: RunConfig, out_dir: str | Path, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Export the job, run ``nvflare simulator`` with one thread per site, and write the run's outputs.

    Everything is staged in ``<out>.partial`` and moved to ``out`` only after success, so a failed run never
    leaves a half-written result folder. On failure the simulator log is kept as ``<out>.failed.log``.
    """
    run.validate()
    task = run.task_spec()
    clients, class_counts = describe_sites(run)
    out = Path(out_dir).resolve()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        # BYOC: the simulator enforces the same class allow-list as a real site, and a simulated site has not
        # allow-listed medflare; carrying the code is what a researcher submitting to POC does too.
        job_dir = export_job(run, staging / "job", task, mode="byoc", shot_groups=shot_groups_for(run, class_counts))
        workspace = staging / "workspace"
        launched_at = time.time()
        _launch(run, job_dir, workspace, staging / "simulator.log", echo)
        summary = write_job_outputs(run, _results_file(workspace), staging, clients, launched_at)
        if summary.get("error"):
            raise SimulationError(f"the job stopped early: {summary['error']}")
        _keep_site_logs(workspace, staging)
        _plot_site_logs(run, staging)
        shutil.rmtree(workspace, ignore_errors=True)  # logs stay in simulator.log; the model is copied out
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
        return summary
    except BaseException:
        log = staging / "simulator.log"
        if log.exists():
            shutil.copy(log, out.with_name(out.name + ".failed.log"))
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _launch(run: RunConfig, job_dir: Path, workspace: Path, log_path: Path, echo: Callable[[str], None]) -> None:
    command = nvflare_command() + [
        "simulator", str(job_dir), "-w", str(workspace), "-n", str(run.clients), "-t", str(run.clients),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tail: list[str] = []
    with log_path.open("w") as log, subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line.rstrip()])[-40:]
            if PROGRESS.search(line):
                echo(_shorten(line.rstrip()))
        code = proc.wait()
    if code != 0:
        raise SimulationError(
            f"nvflare simulator exited with code {code}. Last lines of its log:\n" + "\n".join(tail[-20:])
        )


def _shorten(line: str) -> str:
    """Drop FLARE's timestamp/logger prefix so progress lines stay readable."""
    match = MESSAGE_START.search(line)
    return "  " + (line[match.start():] if match else line[-200:])


def _plot_site_logs(run: RunConfig, out: Path) -> None:
    """Draw each simulated site's local diagnostics with the method's own plot, if it has one."""
    from medflare.registry import get_method

    plot = get_method(run.method).site_log_plot
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


def write_job_outputs(
    run: RunConfig,
    results_file: Path,
    out: Path,
    clients: dict[str, Any],
    launched_at: float | None,
    deployment: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """summary.json, rounds.csv, report.md, plots and the global models, from the controller's results file.

    Shared by the simulator and POC runners, so ``medflare run`` writes the same outputs in every environment.
    """
    results = json.loads(results_file.read_text())
    config = {**vars(run), "task": vars(run.task_spec()), "train_resolved": vars(run.train_config())}
    summary = build_summary(results, {**config, **(deployment or {})}, clients, launched_at)
    if deployment:
        summary["deployment"] = deployment
    write_outputs(summary, out)
    for name in ("FL_global_model.pt", "best_FL_global_model.pt"):
        if (results_file.parent / name).exists():
            shutil.copy(results_file.parent / name, out / name)
    return summary


def _keep_site_logs(workspace: Path, out: Path) -> None:
    """Copy each simulated site's local log (in production those stay at the site)."""
    for log in sorted(workspace.glob(f"site-*/**/{SITE_LOG_FILE}")):
        site = log.relative_to(workspace).parts[0]
        (out / "sites" / site).mkdir(parents=True, exist_ok=True)
        shutil.copy(log, out / "sites" / site / SITE_LOG_FILE)
