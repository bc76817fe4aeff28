"""Running a job in any environment (simulator, POC, rehearsal): describing its sites, writing its FLARE job,
writing its outputs and reading back what a job that ran elsewhere was built from. The layer below the command line
(``medflare.cli``) and the deployment tools (``medflare.deploy``): both launch through it, neither borrows the
other's internals, and it imports neither (``tests/test_layering.py``). The one door to :mod:`medflare.report`.

Where results go is :class:`medflare.files.OutputTarget`'s: nothing is deleted that medflare did not write (its
marker records each file's SHA-256), results appear under their real name only when complete, and a failed or
interrupted run leaves ``<target>.failed.log`` instead.
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

if TYPE_CHECKING:  # importing the run configuration pulls in torch: only the commands that build a run pay it
    from medflare.plan import RunPlan
    from medflare.run_config import RunConfig
    from medflare.site_config import TaskSpec

# the encrypted model is what a secure_aggregation=he server writes instead (flare/he.py; only a site decrypts it)
MODEL_FILES = ("FL_global_model.pt", "best_FL_global_model.pt", "FL_global_model.ckks.npz")


def shot_groups_for(run: RunConfig, class_counts: list[int] | None) -> dict | None:
    """Head/medium/tail class ids from global training counts, when thresholds are configured."""
    if not run.shot_thresholds or class_counts is None:
        return None
    from medflare.metrics import shot_groups_from_counts

    head_min, tail_max = run.shot_thresholds
    return shot_groups_from_counts(class_counts, head_min=head_min, tail_max=tail_max)


def describe_sites(run: RunConfig, task: TaskSpec | None = None) -> tuple[dict[str, Any], list[int] | None]:
    """Per-site partition facts (simulated data only) and global training class counts; ``task``: the run's
    resolved task, read from the data when not given."""
    if run.data.get("source", "site") == "site":
        return {}, None
    from medflare.data import describe_partition
    from medflare.plan import task_of
    from medflare.site_config import typed_data_config

    num_classes = (task or task_of(run)).num_classes
    data_cfg = typed_data_config({**run.site_data(), "num_classes": num_classes})
    facts = describe_partition(data_cfg)
    sites = {name: facts[i] for i, name in enumerate(run.site_names)}
    totals = [sum(int(f["class_counts"][k]) for f in facts) for k in range(len(facts[0]["class_counts"]))]
    return sites, totals


LARGE_IMAGES = 512  # px: above this, an image size nobody chose gets a note (slow, and more than a CPU may hold)


def task_lines(run: RunConfig, task: TaskSpec, sites: Mapping[str, Any]) -> list[str]:
    """What the run will train, shown before anything starts: the task (classes with their names, channels, image
    size), each simulated site's images per split (``sites``: :func:`describe_sites`'), and a note when the image
    size was read off the data and is large, or the images are not all that one square size."""
    kind = "findings" if task.multi_label else "classes"
    names = f" ({', '.join(task.class_names)})" if task.class_names else " (unnamed: the job names none)"
    lines = [f"medflare: task: {task.num_classes} {kind}{names}, {task.in_channels} channel(s), "
             f"{task.image_size} x {task.image_size} px"]
    lines += [f"medflare:   {site}: {facts['n_train']} train / {facts['n_val']} val / {facts['n_test']} test images"
              for site, facts in sites.items()]
    if run.data.get("source", "site") == "site":
        lines.append("medflare:   each site reads its own images and checks them against this task")
    return lines + image_size_notes(run, task)


def image_size_notes(run: RunConfig, task: TaskSpec) -> list[str]:
    """Notes on an image size read off the data (not set by ``data.image_size`` or ``task.image_size``)."""
    if run.data.get("image_size") or "image_size" in run.task or run.data.get("source", "site") == "site":
        return []
    from medflare.data import load_source

    splits = load_source(run.data["source"], seed=run.seed, num_classes=run.task.get("num_classes"))  # cached
    shapes = [tuple(shape) for shape in splits.info.get("image_shapes", [])]
    size, notes = task.image_size, []
    if size > LARGE_IMAGES:
        notes.append(f"medflare: note: the images are {size} px (the first image's height) and no image size is set: "
                     f"training at {size} px is slow, and may not fit a CPU's memory; set e.g. "
                     "--set data.image_size=224")
    if any(shape != (size, size) for shape in shapes):
        seen = ", ".join(f"{h} x {w}" for h, w in shapes[:4]) + (", ..." if len(shapes) > 4 else "")
        notes.append(f"medflare: note: the images are not all {size} x {size} px ({seen}): each is resized to "
                     f"{size} x {size}, which squashes other aspect ratios; set --set data.image_size=N to choose")
    return notes


def plan_job(run: RunConfig, mode: str, task: TaskSpec | None = None,
             class_counts: list[int] | None = None) -> RunPlan:
    """What the job of ``run`` written in ``mode`` will do (``job_export.job_plan``), resolved once: a runner hands
    it to :func:`export_run_job` and :func:`write_job_outputs`. ``task``: the run's resolved task (read from the
    data when not given); ``class_counts``: the global training class counts the long-tail groups come from
    (:func:`describe_sites`; read from the data when the run asks for the groups and does not give them)."""
    from medflare.job_export import job_plan
    from medflare.plan import task_of

    task = task or task_of(run)
    if class_counts is None and run.shot_thresholds:
        _, class_counts = describe_sites(run, task)
    return job_plan(run, task, mode, shot_groups_for(run, class_counts))


def export_run_job(run: RunConfig, out_dir: str | Path, mode: str, class_counts: list[int] | None = None,
                   task: TaskSpec | None = None, plan: RunPlan | None = None) -> Path:
    """The run's FLARE job (``byoc`` or ``preinstalled``), as the simulator, POC and production get it.

    Args:
        run: the validated run.
        out_dir: folder the job folder ``<job name>/`` is written into.
        mode: ``byoc`` (the job carries medflare) or ``preinstalled``.
        class_counts: global training class counts from :func:`describe_sites` (read when needed, not given).
        task: the run's resolved task (read from the data when neither it nor ``plan`` is given).
        plan: the job's plan from :func:`plan_job` (built here from ``task`` when not given).
    """
    from medflare.job_export import write_job

    return write_job(plan or plan_job(run, mode, task, class_counts), out_dir, mode, run.plugins)


# ----- outputs -----------------------------------------------------------------------------------------
def write_job_outputs(
    plan: RunPlan,
    results_file: Path,
    out: Path,
    clients: Mapping[str, Any],
    launched_at: float | None,
    deployment: dict[str, Any] | None = None,
    copy_models: bool = True,
) -> dict[str, Any]:
    """summary.json, rounds.csv, report.md, plots and the global models, from the controller's results file.

    Shared by the simulator and POC runners, so ``medflare run`` writes the same outputs in every environment.

    Args:
        plan: the job's plan: the configuration, task, training settings and fingerprint the summary records.
        copy_models: copy the global models found beside the results (off when the outputs go beside them).
    """
    from medflare.report import build_summary, write_outputs

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
    says what one of a local run says): the plan's options, its rounds and sites counted, whether the server holds a
    model, the sites' own models,
    the job's training settings (``train_resolved``) and each named site's where they differ."""
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
    """What a finished command prints: the results table (mean ± std over seeds when there are several), timing
    of a single run, a warning for each run whose best model is the untrained one, and where the files are."""
    from medflare.report import comparison_table, format_seconds, results_table, startup_text, untrained_best_warning

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
    """The usual run outputs from a job's ``medflare_results.json`` and the job's plan beside it.

    FLARE deploys the whole app to the server, so ``app_server/config/`` holds the job's plan in a downloaded job
    and in a simulator workspace alike; the report reads the configuration off it, as a simulator run's does
    (data, sites, seed, model, training settings).

    Args:
        results_file: the results file, or the folder holding it (``.../app_server``).
        out: folder to write summary.json, rounds.csv, report.md and plots into.
        copy_models: also copy the global models there (pointless when the report goes beside them).

    Raises:
        ConfigError: the file is missing, or it or the plan beside it is unreadable, or that plan is not the one
            the server ran (its fingerprint differs from the one the results record).
    """
    from medflare.flare.controller import RESULTS_FILE
    from medflare.report import read_results

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


def job_plan_in(folder: Path) -> RunPlan:
    """The plan of the job whose app is in ``folder`` (``app_server/``, whose ``config/`` FLARE deployed) or in
    the one job of the medflare run folder ``folder``.

    Raises:
        ConfigError: there is no readable plan there (one line naming the file).
    """
    from medflare.plan import PLAN_FILE, read_plan

    config_dir = _app_dir_of(folder) / "config"
    try:
        return read_plan(config_dir / PLAN_FILE)[0]
    except ConfigError as exc:
        raise ConfigError(f"{exc}; a report needs the job's plan, which FLARE keeps in app_server/config/") from exc
