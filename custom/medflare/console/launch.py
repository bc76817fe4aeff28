"""Running a job in any environment (simulator, POC, rehearsal): its sites, its FLARE job, its outputs, and what a job
that ran elsewhere was built from. The layer below ``medflare.console.cli`` and ``medflare.console.deploy``, importing neither
(``tests/test_layering.py``); the one door to :mod:`medflare.console.report`. Outputs go through
:class:`medflare.console.files.OutputTarget` (never deletes what medflare did not write; a failure leaves ``.failed.log``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from medflare import readback
from medflare.errors import ConfigError, MedflareError

if TYPE_CHECKING:  # importing the plan pulls in torch: only the commands that build a run pay it
    from medflare.plan import RunPlan
    from medflare.run_config import RunConfig

# the encrypted model is what a secure_aggregation=he server writes instead (flare/he.py; only a site decrypts it)
MODEL_FILES = ("FL_global_model.pt", "best_FL_global_model.pt", "FL_global_model.ckks.npz")


LARGE_IMAGES = 512  # px: above this, an image size nobody chose gets a note (slow, and more than a CPU may hold)


def task_lines(plan: RunPlan, sites: Mapping[str, Any], run: RunConfig) -> list[str]:
    """What the plan will train, shown before anything starts: the task, each simulated site's images per split
    (``sites``: :func:`medflare.plan.describe_sites`'), and :func:`image_size_notes` of the ``run`` it came from."""
    from medflare.data.classes import placeholder_refusal  # local: as plan.py, no data package at import

    task = plan.task
    kind = "findings" if task.multi_label else "classes"
    names = f" ({', '.join(task.class_names)})" if task.class_names else " (unnamed: the job names none)"
    lines = [f"medflare: task: {task.num_classes} {kind}{names}, {task.in_channels} channel(s), "
             f"{task.image_size} x {task.image_size} px"]
    lines += [f"medflare:   {site}: {facts['n_train']} train / {facts['n_val']} val / {facts['n_test']} test images"
              for site, facts in sites.items()]
    if plan.data.get("source", "site") == "site":
        lines.append("medflare:   each site reads its own images and checks them against this task")
    if placeholder_refusal(task.class_names, "medflare"):
        lines.append("medflare:   the class names are the placeholder, which every site refuses: name the classes "
                     "in label order with --set 'task.class_names=[...]'")
    return lines + image_size_notes(plan, run)


def image_size_notes(plan: RunPlan, run: RunConfig) -> list[str]:
    """Notes on an image size read off the data: one neither ``data.image_size`` nor ``task.image_size`` of the
    layered ``run`` chose (the plan records the size, not who chose it)."""
    if run.data.get("image_size") or "image_size" in run.task or plan.data.get("source", "site") == "site":
        return []
    from medflare.data import load_source

    splits = load_source(plan.data["source"], seed=plan.seed, num_classes=run.task.get("num_classes"))  # cached
    shapes = [tuple(shape) for shape in splits.info.get("image_shapes", [])]
    size, notes = plan.task.image_size, []
    if size > LARGE_IMAGES:
        notes.append(f"medflare: note: the images are {size} px (the first image's height) and no image size is set: "
                     f"training at {size} px is slow, and may not fit a CPU's memory; set e.g. "
                     "--set data.image_size=224")
    if any(shape != (size, size) for shape in shapes):
        seen = ", ".join(f"{h} x {w}" for h, w in shapes[:4]) + (", ..." if len(shapes) > 4 else "")
        notes.append(f"medflare: note: the images are not all {size} x {size} px ({seen}): each is resized to "
                     f"{size} x {size}, which squashes other aspect ratios; set --set data.image_size=N to choose")
    return notes


# ----- outputs -----------------------------------------------------------------------------------------
def write_job_outputs(plan: RunPlan, results_file: Path, out: Path, clients: Mapping[str, Any],
                      launched_at: float | None, deployment: dict[str, Any] | None = None,
                      copy_models: bool = True) -> dict[str, Any]:
    """summary.json, rounds.csv, report.md, plots and (``copy_models``) the global models, from the controller's
    results file: the same outputs in every environment."""
    from medflare.console.report import build_summary, write_outputs

    results = json.loads(results_file.read_text())
    config = {**summary_config(plan), **(deployment or {})}
    summary = build_summary(results, config, clients, launched_at)
    summary["plan_check"] = plan_check(results.get("plan"), plan)
    if deployment:
        summary["deployment"] = deployment
    write_outputs(summary, out)
    for name in (*MODEL_FILES, results_file.name) if copy_models else ():  # the history makes --resume possible
        if (results_file.parent / name).exists():
            shutil.copy(results_file.parent / name, out / name)
    return summary


def summary_config(plan: RunPlan) -> dict[str, Any]:
    """The run's configuration as summaries record it, read off its plan alone (so a report on a downloaded job
    says what one of a local run says), with the training settings and each site's where they differ."""
    record = {key: value for key, value in plan.to_dict().items() if key not in ("sites", "rounds", "train")}
    return {**record, "name": plan.job_name, "rounds": len(plan.rounds), "clients": len(plan.sites),
            "site_evaluation": plan.evaluation, "server_model": plan.spec.server_model,
            "site_model": {site.name: site.model for site in plan.sites if site.model != plan.model},
            "train_resolved": dataclasses.asdict(plan.train),
            "site_train_resolved": {site.name: dataclasses.asdict(site.train) for site in plan.sites
                                    if site.train != plan.train}}


def plan_check(server_plan: str | None, plan: RunPlan) -> str:
    """Whether the server ran ``plan``: "matches", "unknown" (results from before the server recorded its plan),
    or a line saying which plan each side stands for."""
    if not server_plan:
        return "unknown"
    if server_plan == plan.digest():
        return "matches"
    return (f"differs: the server ran plan {server_plan}, the job config here resolves to plan {plan.digest()} "
            "(changed after the run?)")


def results_text(summaries: list[Mapping[str, Any]], out: Path, seeds: int = 1) -> str:
    """What a finished command prints: the results table (mean ± std over several seeds), a single run's timing,
    warnings (untrained best model, a differing plan) and where the files are."""
    from medflare.console.report import (
        comparison_table,
        format_seconds,
        results_table,
        startup_text,
        untrained_best_warning,
    )

    lines = ["", comparison_table(summaries) if seeds > 1 else results_table(summaries)]
    if len(summaries) == 1:
        timing = summaries[0]["timing"]
        lines.append(f"\n{startup_text(timing)}, mean round {format_seconds(timing.get('mean_round_seconds'), 2)}")
    for summary in summaries:
        warning = untrained_best_warning(summary)
        if warning:
            lines.append(f"medflare: warning: {summary['method']} (seed {summary['config'].get('seed')}): {warning}")
        if str(summary.get("plan_check", "")).startswith("differs"):  # the job that ran is not the one described
            lines.append(f"medflare: warning: {summary['method']}: the plan {summary['plan_check']}")
    lines.append(f"results: {out.resolve()}")
    return "\n".join(lines)


def report_from_results(results_file: Path, out: Path, copy_models: bool = True) -> dict[str, Any]:
    """The usual run outputs in ``out`` from a job's ``medflare_results.json`` (or its folder) and the plan FLARE
    deployed beside it (``app_server/config/``). ConfigError: a missing or unreadable file or plan, or a plan
    whose fingerprint differs from the one the server ran."""
    from medflare.console.report import read_results
    from medflare.flare.controller import RESULTS_FILE

    results_file = results_file / RESULTS_FILE if results_file.is_dir() else results_file
    if not results_file.is_file():
        raise ConfigError(f"results file not found: {results_file}; give a run's {RESULTS_FILE} (a downloaded job "
                          f"has it in <job id>/workspace/app_server/)")
    plan = job_plan_in(results_file.parent)
    check = plan_check(read_results(results_file).get("plan"), plan)  # depth-limited, held to the results schema
    if check.startswith("differs"):
        raise ConfigError(f"{results_file}: {check}; report on the job as it was downloaded")
    launched_at = recorded_launch(results_file.parent)
    return write_job_outputs(plan, results_file, out, {}, launched_at, copy_models=copy_models)


SITE_FLARE_LOG = "flare_job_log.txt"  # a POC site's FLARE log of the job, kept beside its medflare log


def keep_site_logs(root: Path, out: Path, job_id: str | None = None) -> None:
    """Copy each site's medflare log and payload audit from ``root/site-*`` (a simulator workspace or a POC's kits)
    into ``out/sites/<site>/``; with ``job_id`` (POC) also FLARE's log of that job (``SITE_FLARE_LOG``)."""
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
    """The earliest line (by FLARE's timestamps) of any ``root/site-*/**/log.txt`` in which a site says why it
    could not do a task, from the site's name on; None when no site said so."""
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
    """The closing line of a failure log: why the run ended (``exc``) and how many of ``rounds`` the server's
    results below ``search_root`` record as finished."""
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
    """``summary.json``'s ``timing.launched_at`` in ``folder``; None for a job launched elsewhere."""
    path = folder / "summary.json"
    try:
        launched_at = readback.load_json(path, ConfigError).get("timing", {}).get("launched_at")
    except (MedflareError, AttributeError):
        return None  # no summary, or not one medflare wrote: the launch is unknown
    return float(launched_at) if isinstance(launched_at, (int, float)) and not isinstance(launched_at, bool) else None


def _app_dir_of(results_dir: Path) -> Path:
    """Where these results' job config is: beside them (``app_server/``), or a run folder's ``job/<name>/app/``."""
    if (results_dir / "config").is_dir():
        return results_dir
    apps = sorted(results_dir.glob("job/*/app"))
    return apps[0] if len(apps) == 1 and (apps[0] / "config").is_dir() else results_dir


def job_plan_in(folder: Path) -> RunPlan:
    """The plan of the job whose app is in ``folder`` (see :func:`_app_dir_of`); ConfigError when unreadable."""
    from medflare.plan import PLAN_FILE, read_plan

    config_dir = _app_dir_of(folder) / "config"
    try:
        return read_plan(config_dir / PLAN_FILE)[0]
    except ConfigError as exc:
        raise ConfigError(f"{exc}; a report needs the job's plan, which FLARE keeps in app_server/config/") from exc
