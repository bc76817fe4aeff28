"""Setting up and controlling a run in any environment (simulator, POC): options, the job, its outputs, child
processes.

A neutral module below the command line: ``medflare.cli`` and ``medflare.deploy.poc`` both build their run
configuration and their job and write the run's outputs here (the one door to :mod:`medflare.report`), so neither
borrows the other's internals.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from medflare.config import load_config_file
from medflare.errors import ConfigError

if TYPE_CHECKING:  # importing the run configuration pulls in torch: only the commands that build a run pay it
    from medflare.plan import RunPlan
    from medflare.run_config import RunConfig
    from medflare.site_config import TaskSpec

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# MEDFLARE_SMOKE=1 (the runnable-docs test sets it) caps every run built here, so the docs' commands run as written
# in seconds instead of minutes. The data is not shrunk (evaluating the full splits is cheap next to FLARE's start-up).
SMOKE_ENV = "MEDFLARE_SMOKE"
SMOKE_CAPS = {"rounds": 2, "train.local_epochs": 1, "train.max_steps": 2}


def nvflare_command() -> list[str]:
    """The nvflare CLI of *this* interpreter's environment (never whatever is first on PATH)."""
    candidate = Path(sys.executable).with_name("nvflare")
    return [str(candidate)] if candidate.exists() else [sys.executable, "-m", "nvflare.cli"]


# FLARE's admin side (the ``nvflare`` command, the Session API) looks for its optional comm_config.json in
# ConfigService's config path, which FLARE sets for its server and sites only; elsewhere it walks the whole working
# directory for it, once per file extension. From a source checkout with its .venv that cost ~3 CPU-s per command
# (2026-11-28), from a hospital's data share it could take minutes, and a stray comm_config.json anywhere below would
# configure FLARE's connections. medflare therefore runs those commands in a folder of its own
# (:func:`flare_admin_popen_args`) and gives its own admin sessions a config path (:func:`confine_flare_config_search`).
def flare_admin_popen_args(folder: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """``cwd`` and ``env`` for an ``nvflare`` admin command run in ``folder`` (created if missing): the environment's
    relative PYTHONPATH entries made absolute first, so the command imports what this process would."""
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(env)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(str(Path(entry).resolve()) if entry else entry
                                            for entry in env["PYTHONPATH"].split(os.pathsep))
    return {"cwd": str(folder), "env": env}


def confine_flare_config_search(folder: Path) -> None:
    """Make this process's FLARE look for its config files in ``folder`` (an admin kit) rather than walk the working
    directory (see :func:`flare_admin_popen_args`). A missing folder is left to the session to report."""
    from nvflare.fuel.utils.config_service import ConfigService

    if folder.is_dir():
        ConfigService.initialize(section_files={}, config_path=[str(folder)])


# ----- run options ------------------------------------------------------------------------------------
def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options every command that builds a job takes (``run``, ``compare``, ``export``, ``config``, POC
    ``submit``); the scenarios and partition schemes they list come from their registries."""
    from medflare.catalog import load_catalog  # not the partition module itself: that imports torch
    from medflare.scenarios import list_scenarios

    parser.add_argument("--data", help="synthetic[:k=v,...] | medmnist:PATH | folder:DIR | csv:FILE | site; "
                                       "--set data.imbalance=IR cuts a long-tailed training split from any source, "
                                       "--set data.window=40,80 (or brain, lung, bone, file) windows DICOM/NIfTI")
    parser.add_argument("--partition", help=" | ".join(load_catalog()["partitions"]))
    parser.add_argument("--clients", type=int, help="number of sites (default 2)")
    parser.add_argument("--rounds", type=int, help="federated rounds (default 3)")
    parser.add_argument("--local-epochs", type=int, help="local epochs per round (default 1)")
    parser.add_argument("--max-steps", type=int, help="cap on optimizer steps per site per round (0 = none)")
    parser.add_argument("--batch-size", type=int, help="local batch size (default 64)")
    parser.add_argument("--lr", type=float, help="local learning rate")
    parser.add_argument("--model", help="model name (see 'medflare models'; default: the method's, e.g. cnn, vit_tiny for "
                                          "fed-mae/fed-beit, efficientnet_lite0 for fca)")
    parser.add_argument("--pretrained", help="'imagenet' (efficientnet_lite0) or a local weights file")
    parser.add_argument("--seed", type=int, help="seed for data, partition and initial model (default 0)")
    parser.add_argument(
        "--shot-thresholds", type=int, nargs=2, metavar=("HEAD_MIN", "TAIL_MAX"),
        help="head/medium/tail accuracy by each class's total training images n: head if n > HEAD_MIN, tail if "
             "n < TAIL_MAX (both exclusive), medium if TAIL_MAX <= n <= HEAD_MIN (inclusive); e.g. 700 70 "
             "(HyperKvasir). Same as --set shot_thresholds=[700,70]",
    )
    parser.add_argument("--preset", help="named configuration of the method, e.g. 'paper': the paper's headline set-up "
                                         "(model, resolution, rounds, optimizer, ...); the lowest layer, so "
                                         "--scenario, --config, flags and --set override it ('medflare methods' "
                                         "lists the presets)")
    parser.add_argument("--scenario", help=f"named set-up: {' | '.join(list_scenarios())} (docs/scenarios.md)")
    parser.add_argument("--config", help="JSON or TOML file with run options (overrides the scenario; flags override it)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override any option: method.mu=0.1, train.weight_decay=1e-4, data.label_noise=0.2, min_clients=2",
    )


def build_run_config(args: argparse.Namespace, method: str | None = None) -> RunConfig:
    """RunConfig defaults <- --preset <- --scenario <- --config <- flags <- --set (validate it with
    ``RunConfig.validate``).

    Args:
        args: parsed options of :func:`add_run_options` (and ``args.method``).
        method: the method to build for (default ``args.method``; ``compare`` builds one per method).
    """
    return smoke_sized(_layered_run(args, method))


def _layered_run(args: argparse.Namespace, method: str | None) -> RunConfig:
    from medflare.run_config import apply_overrides, merge_run_config

    return apply_overrides(merge_run_config(*(layer for _, layer in run_layers(args, method))), args.set)


def smoke_sized(run: RunConfig) -> RunConfig:
    """``run`` within :data:`SMOKE_CAPS` when ``$MEDFLARE_SMOKE`` is set (and not ``0``), else ``run`` itself.

    A capped run says so on stderr: a smoke-size run must never pass for a result (its summary records the caps too,
    as the run's rounds and train settings).
    """
    from medflare.run_config import apply_overrides

    capped = smoke_caps(run)
    if capped:
        _note_once(f"medflare: note: {SMOKE_ENV}={os.environ[SMOKE_ENV]}: a smoke-size run, not a result "
                   f"({', '.join(capped)})")
    return apply_overrides(run, capped) if capped else run


def smoke_caps(run: RunConfig) -> list[str]:
    """The ``key=value`` overrides that bring ``run`` within :data:`SMOKE_CAPS` (none without ``$MEDFLARE_SMOKE``)."""
    if not smoke_requested():
        return []
    return [f"{key}={cap}" for key, cap in SMOKE_CAPS.items() if not _within(_option_value(run, key), cap)]


def smoke_requested() -> bool:
    """Whether ``MEDFLARE_SMOKE`` asks to cap every run at smoke size (the runnable-docs tests set it)."""
    return os.environ.get(SMOKE_ENV, "0") not in ("", "0")


def _option_value(run: RunConfig, key: str) -> Any:
    """A dotted option's value as set so far (``None`` when a section leaves it to the method's default)."""
    from medflare.run_config import SECTIONS

    section, _, sub = key.partition(".")
    return getattr(run, SECTIONS[section]).get(sub) if sub else getattr(run, key)


def _within(value: Any, cap: int) -> bool:
    """Whether a count option (text until validated) is already set to 1..cap; a value that is no integer is left
    for validation to refuse, with the option's name."""
    try:
        return value is not None and 0 < int(str(value)) <= cap
    except ValueError:
        return True


@functools.cache  # compare builds each method's run twice: one note per distinct change is enough
def _note_once(text: str) -> None:
    print(text, file=sys.stderr)


def option_layers(args: argparse.Namespace, method: str | None = None) -> list[tuple[str, set[str]]]:
    """Which options each layer of :func:`build_run_config` sets (dotted names), lowest first, ``--set`` last
    (then ``$MEDFLARE_SMOKE``'s caps, when set): what ``medflare config`` reports as each option's source."""
    from medflare.config import layer_options, override_options
    from medflare.run_config import SECTIONS

    sections = set(SECTIONS.values())
    named = [(name, layer_options(layer, sections)) for name, layer in run_layers(args, method)]
    named.append(("--set", override_options(args.set, SECTIONS)))
    if smoke_requested():  # a smoke-size run's caps are the top layer (build_run_config applies them last)
        named.append((SMOKE_ENV, override_options(smoke_caps(_layered_run(args, method)), SECTIONS)))
    return named


def run_layers(args: argparse.Namespace, method: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The layers of a run's configuration under ``--set`` (applied as text by ``apply_overrides``), lowest first
    and named as the user gave them: --preset, --scenario, --config, then the flags."""
    from medflare.run_config import preset_layer
    from medflare.scenarios import load_scenario

    # compare: a method without the preset takes the shared part of the first compared method's that has one
    preset = preset_layer(getattr(args, "preset", None), method or args.method, getattr(args, "preset_lead", None))
    scenario = load_scenario(args.scenario) if args.scenario else {}
    from_file = load_config_file(args.config) if args.config else {}
    data = {"source": args.data, "partition": args.partition}
    train = {"local_epochs": args.local_epochs, "max_steps": args.max_steps, "batch_size": args.batch_size,
             "lr": args.lr}
    flags = {
        "method": method or args.method, "clients": args.clients, "rounds": args.rounds, "model": args.model,
        "pretrained": args.pretrained, "seed": args.seed, "shot_thresholds": getattr(args, "shot_thresholds", None),
        "data": {k: v for k, v in data.items() if v is not None},
        "train": {k: v for k, v in train.items() if v is not None},
    }
    return [(f"--preset {args.preset}" if getattr(args, "preset", None) else "--preset", preset),
            (f"--scenario {args.scenario}" if args.scenario else "--scenario", scenario),
            (f"--config {args.config}" if args.config else "--config", from_file), ("flags", flags)]


def data_was_chosen(args: argparse.Namespace) -> bool:
    """True when --data, a scenario, a config file or --set data.source picked the data source."""
    from_file = bool(args.config) and "source" in load_config_file(args.config).get("data", {})
    from_set = any(item.partition("=")[0] == "data.source" for item in args.set)
    return args.data is not None or bool(args.scenario) or from_file or from_set


# ----- the job of a run --------------------------------------------------------------------------------
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
    from medflare.config import from_dict
    from medflare.data import DataConfig, describe_partition

    num_classes = (task or run.task_spec()).num_classes
    data_cfg = from_dict(DataConfig, {**run.site_data(), "num_classes": num_classes}, "data")
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


def plan_job(run: RunConfig, mode: str, task: TaskSpec | None = None) -> RunPlan:
    """What the job of ``run`` written in ``mode`` will do (``job_export.job_plan``), resolved once: a runner hands
    it to :func:`export_run_job` and :func:`write_job_outputs`. ``task``: the run's resolved task (read from the
    data when not given)."""
    from medflare.job_export import job_plan

    return job_plan(run, task or run.task_spec(), mode)


def export_run_job(run: RunConfig, out_dir: str | Path, mode: str, class_counts: list[int] | None = None,
                   task: TaskSpec | None = None, plan: RunPlan | None = None) -> Path:
    """The run's FLARE job (``byoc`` or ``preinstalled``), as the simulator, POC and production get it.

    Args:
        run: the validated run.
        out_dir: folder the job folder ``<job name>/`` is written into.
        mode: ``byoc`` (the job carries medflare) or ``preinstalled``.
        class_counts: global training class counts from :func:`describe_sites` (computed when not given).
        task: the run's resolved task (read from the data when neither it nor ``plan`` is given).
        plan: the job's plan from :func:`plan_job` (built here from ``task`` when not given).
    """
    from medflare.job_export import write_job

    plan = plan or plan_job(run, mode, task)
    if class_counts is None:
        _, class_counts = describe_sites(run, plan.task)
    return write_job(plan, out_dir, mode, shot_groups_for(run, class_counts), run.plugins)


# ----- outputs -----------------------------------------------------------------------------------------
def write_job_outputs(
    plan: RunPlan,
    run: RunConfig,
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
        plan: the job's plan: the task, the training settings and the fingerprint the summary records.
        run: the run the plan was resolved from, as the summary records its configuration.
        copy_models: copy the global models found beside the results (off when the outputs go beside them).
    """
    from medflare.outputs import MODEL_FILES
    from medflare.report import build_summary, write_outputs

    results = json.loads(results_file.read_text())
    config = {**summary_config(plan, run), **(deployment or {})}
    summary = build_summary(results, config, clients, launched_at)
    summary["plan_check"] = plan_check(results.get("plan"), plan)
    if deployment:
        summary["deployment"] = deployment
    write_outputs(summary, out)
    for name in (*MODEL_FILES, results_file.name) if copy_models else ():  # the history makes --resume possible
        if (results_file.parent / name).exists():
            shutil.copy(results_file.parent / name, out / name)
    return summary


def summary_config(plan: RunPlan, run: RunConfig) -> dict[str, Any]:
    """The run's configuration as summaries record it: the options of ``run``, with the task and the full
    training settings its plan resolved."""
    return {**vars(run), "task": vars(plan.task), "train_resolved": vars(plan.train_resolved)}


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
    """The usual run outputs from a job's ``medflare_results.json`` and the job config that sits beside it.

    FLARE deploys the whole app to the server, so ``app_server/config/`` holds both the server and the client
    config in a downloaded job and in a simulator workspace alike; the run and its plan are rebuilt from them as
    the server rebuilt its own, and the report says the same (data, sites, seed, model, training settings) as the
    simulator run's.

    Args:
        results_file: the results file, or the folder holding it (``.../app_server``).
        out: folder to write summary.json, rounds.csv, report.md and plots into.
        copy_models: also copy the global models there (pointless when the report goes beside them).

    Raises:
        ConfigError: the file is missing, or it or the job config beside it is unreadable, or that config is not
            the one the server ran (its plan's fingerprint differs from the one the results record).
    """
    from medflare.flare.controller import RESULTS_FILE
    from medflare.outputs import job_run_and_plan, recorded_launch
    from medflare.report import read_results

    results_file = results_file / RESULTS_FILE if results_file.is_dir() else results_file
    if not results_file.is_file():
        raise ConfigError(f"results file not found: {results_file}; give a run's {RESULTS_FILE} (a downloaded job "
                          f"has it in <job id>/workspace/app_server/)")
    run, plan = job_run_and_plan(results_file.parent)
    check = plan_check(read_results(results_file).get("plan"), plan)  # depth-limited, held to the results schema
    if check.startswith("differs"):
        raise ConfigError(f"{results_file}: {check}; report on the job as it was downloaded")
    launched_at = recorded_launch(results_file.parent)
    return write_job_outputs(plan, run, results_file, out, {}, launched_at, copy_models=copy_models)


# ----- interruption ------------------------------------------------------------------------------------
class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived: every ``except BaseException`` clean-up path runs, as for Ctrl-C.

    Attributes:
        signum: the signal received.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within this block SIGTERM/SIGINT raise :class:`Interrupted` once; repeats are ignored so clean-up finishes.

    Only the main thread can own signal handlers; elsewhere the block changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if not received:
            received.append(signum)
            raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Within this block SIGTERM/SIGINT are ignored (main thread only): the clean-up of a run that already failed
    (say its output pipe closed) must finish even when a stop request arrives meanwhile, or the processes it was
    about to stop stay running. The previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def quiet_on_closed_output(echo: Callable[[str], None]) -> Callable[[str], None]:
    """``echo`` that stays silent once its output is gone (a closed terminal or pipe), so clean-up runs on."""

    def write(line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            echo(line)

    return write


def start_process(command: list[str], **popen_args: Any) -> subprocess.Popen:
    """Start a child in its own process group, so a terminal's Ctrl-C reaches medflare only and medflare
    stops the child's whole tree itself (:func:`stop_process_tree`)."""
    return subprocess.Popen(command, start_new_session=True, **popen_args)


def stop_process_tree(proc: subprocess.Popen, grace_seconds: float = 10.0) -> None:
    """Terminate ``proc`` and every process below it (FLARE's simulator starts each site in a new session, so
    its process group alone is not enough); kill whatever outlives ``grace_seconds``."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        tree = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        tree = []
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(tree, timeout=grace_seconds)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=grace_seconds)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_seconds)
