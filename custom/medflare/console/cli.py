"""The ``medflare`` command: list methods and models, print a run's configuration, run a method (FLARE simulator or
POC), export a job, follow a running job, apply a trained model.

Every command checks all of its input (one typed validation, ``plan.validated``) before it starts or writes
anything; bad input ends with one line naming the option and exit code 2. Result folders are never emptied:
a non-empty ``--out`` needs ``--overwrite``, and even then only files medflare wrote are replaced.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from medflare.console.files import disk_full_message, is_disk_full
from medflare.errors import ConfigError, MedflareError

EXAMPLES = """examples:
  medflare methods
  medflare config fedprox --set method.mu=0.1 > fedprox.toml    # every option: type, default, where it came from
  medflare run fedavg --clients 2 --rounds 3
  medflare run bsm-fl --data synthetic:imbalance=20 --partition dirichlet:0.5 --clients 3
  medflare run fedprox --data medmnist:../shared/data/medmnist/pneumoniamnist.npz --set method.mu=0.1
  medflare run fedavg --rounds 20 --set patience=3 --set tracking=both --out runs/fedavg
  medflare run fedavg --rounds 30 --resume runs/fedavg --out runs/fedavg-continued
  medflare run fca --preset paper --data medmnist:../shared/data/medmnist/retinamnist.npz --rounds 5
  medflare watch 3f1c9a2e-... --startup-kit workspace/prod_00/lead@hospital-a.org
  medflare export fedavg -o jobs/ --mode preinstalled --set task.num_classes=2 --set task.in_channels=1 --set task.image_size=28
  medflare rehearse --hospitals 2 --rounds 2 -o runs/rehearse   # as root: kits in network namespaces
"""
OVERWRITE_HELP = "replace medflare's earlier results in a non-empty folder (files medflare did not write are kept)"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the option, like every other medflare error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def cmd_methods(args: argparse.Namespace) -> int:
    """``medflare methods``: every registered method with its paper and what it solves (from the catalog)."""
    from medflare.catalog import load_catalog  # the registry's snapshot: listing must not import torch

    for method in load_catalog()["methods"]:
        listed = f"  [--preset {', '.join(method['presets'])}]" if method["presets"] else ""
        print(f"{method['name']:12s} {method['summary']}{listed}")
    return 0


def preset_notes(args: argparse.Namespace, methods: list[str]) -> list[str]:
    """What ``--preset`` sets and what still differs from its source, printed before anything starts (one block
    per preset used; a compared method without its own preset is named as taking the shared settings)."""
    from medflare.plan import find_preset

    name = getattr(args, "preset", None)
    if not name:
        return []
    lines: list[str] = []
    for method in methods:
        owner, preset, shared_only = find_preset(name, method, getattr(args, "preset_lead", None))
        if shared_only:
            lines.append(f"medflare: {method} has no '{name}' preset: it takes {owner}'s shared settings (model, "
                         "resolution, rounds, clients, training), not its method options")
        else:
            lines += [f"medflare: {line}" if i == 0 else line for i, line in enumerate(preset.describe(method, name))]
    return lines


def cmd_models(args: argparse.Namespace) -> int:
    """``medflare models``: every model factory with its parameter count, input and offline ImageNet weights."""
    from medflare.catalog import COUNTED_SIZES, COUNTED_TASK, installed_models, load_catalog

    print(MODELS_ROW.format("model", "params", "input", "ImageNet weights (offline)"))
    for model in load_catalog()["models"]:
        print(MODELS_ROW.format(model["name"], *model_facts(model)))
    for name in installed_models():
        print(MODELS_ROW.format(name, "?", "installed package's model, imported when a job names it", "-"))
    print(f"params: counted for {COUNTED_TASK['in_channels']} input channels, {COUNTED_TASK['num_classes']} classes "
          f"and {max(COUNTED_SIZES)} px; the stem follows the task's channels (1 or 3), the head its classes. Any "
          "model also starts from a local weights file: --pretrained FILE")
    return 0


MODELS_ROW = "{:19s} {:>7s}  {:54s} {}"


def model_facts(model: dict[str, Any]) -> tuple[str, str, str]:
    """Parameters, input and ImageNet weights of a catalog entry, as ``medflare models`` prints them."""
    from medflare.catalog import SMALLEST_SIDE, is_installed

    counts = {int(size): count for size, count in model["params"].items()}
    largest = max(counts)
    if len(set(counts.values())) == 1:
        shape = f"any side >= {SMALLEST_SIDE} px"
    else:  # the architecture depends on the image size (a ViT's position embeddings)
        shape = "sized by task.image_size: " + ", ".join(f"{short_count(n)} at {s}" for s, n in counts.items()) + " px"
    package = model["imagenet_package"]
    weights = "-" if not package else \
        f"--pretrained imagenet ({'installed' if is_installed(package) else f'{package} not installed'})"
    return short_count(counts[largest]), shape, weights


def short_count(count: int) -> str:
    """A parameter count to three significant digits: 93.7k, 11.2M."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return str(count)


def cmd_config(args: argparse.Namespace) -> int:
    """``medflare config``: the effective configuration of a run as TOML, or its resolved plan (``--plan``)."""
    from medflare.console.effective_config import config_toml
    from medflare.console.run_options import build_run_config, option_layers
    from medflare.plan import resolve, validated

    if args.plan:  # what the simulator job will do, resolved (this reads the data for the task's shape)
        plan = resolve(build_run_config(args), "byoc", check_files=False)
        print(plan.describe(), end="")
        print(f"plan {plan.digest()}: the server and every site log this fingerprint of the plan they run",
              file=sys.stderr)
        return 0
    run = validated(build_run_config(args), check_files=False)  # checked as 'run' checks it; the data is not read
    print(config_toml(run, option_layers(args)), end="")
    return 0


def checked_run(args: argparse.Namespace, method: str | None = None, seed: int | None = None,
                data_defaults: dict[str, Any] | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """The layered run of ``args``, the plan of the job ``--env`` gets and its sites' facts (the data read and
    partitioned): every check before anything starts. ``compare`` passes each ``seed`` and one protocol's
    ``data_defaults`` for every method."""
    from medflare.console.run_options import build_run_config
    from medflare.plan import describe_sites, resolve

    run = build_run_config(args, method)
    if seed is not None:
        run.seed = seed
    poc = args.env == "poc"  # a POC is a deployment: its job gets the robust defences, simulated data or not
    plan = resolve(run, args.mode if poc else "byoc", deployed=poc, data_defaults=data_defaults)
    sites, _ = describe_sites(plan)  # reads and partitions the data: a missing file or a too-small site fails here
    return run, plan, sites


def show_task(run: Any, plan: Any, sites: dict[str, Any]) -> None:
    """Print the task a plan trains and each site's images (``launch.task_lines``; ``sites``: :func:`checked_run`'s,
    or ``plan.describe_sites``')."""
    from medflare.console.launch import task_lines

    for line in task_lines(plan, sites, run):
        print(line)


def run_in_env(args: argparse.Namespace, plan: Any, out: Path, overwrite: bool = False) -> dict[str, Any]:
    """Run the job of ``plan`` (:func:`checked_run`'s) where ``--env`` says, outputs in ``out``; its summary."""
    if args.env == "poc":
        from medflare.console.deploy.poc import run_poc

        return run_poc(plan, out, mode=args.mode, overwrite=overwrite)
    from medflare.console.simulate import run_simulation

    return run_simulation(plan, out, overwrite=overwrite)


def cmd_run(args: argparse.Namespace) -> int:
    """``medflare run``: one method's job in the simulator, a POC or production, and its outputs."""
    from medflare.console.files import OutputTarget
    from medflare.console.launch import results_text

    if args.resume:  # checked with everything else: same method, model and stages, more rounds
        if args.env == "poc":
            raise ConfigError("--resume RUN_DIR works with the simulator only (a POC or production server never "
                              "reads a folder a job names); resubmit the job with resume_from=<earlier job id>")
        args.set = [*args.set, f"resume_from={args.resume}"]
    run, plan, sites = checked_run(args)
    for line in preset_notes(args, [plan.method]):
        print(line)
    _tracking_note(plan)
    out = Path(args.out or f"runs/{plan.job_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    OutputTarget(out, overwrite=args.overwrite).check()
    where = f"a {len(plan.sites)}-site FLARE POC" if args.env == "poc" else f"{len(plan.sites)} simulated sites"
    show_task(run, plan, sites)
    print(f"medflare: running {plan.method} on {where} for {len(plan.rounds)} rounds -> {out}")
    summary = run_in_env(args, plan, out, overwrite=args.overwrite)
    if summary.get("stopped_early"):
        print(f"medflare: stopped early after round {summary['stopped_early']['after_round']}: "
              f"{summary['stopped_early']['reason']}")
    print(results_text([summary], out) + "  (summary.json, rounds.csv, report.md, learning_curves.png)")
    return 0


def _tracking_note(plan: Any) -> None:
    """One line when a chosen tracker's package is missing here (the simulator's and a local POC's server)."""
    from medflare.flare.tracking import missing_notice

    notice = missing_notice(plan.tracking)
    if notice:
        print(f"medflare: note: {notice}", file=sys.stderr)


def cmd_watch(args: argparse.Namespace) -> int:
    """``medflare watch``: a submitted job's progress, round by round, and its outputs when it ends."""
    from medflare.console.deploy.poc import admin_kit
    from medflare.console.deploy.watch import FINISHED_OK, as_user, watch

    kit, user = admin_kit(args.startup_kit, args.poc)
    print(f"medflare: following job {args.job_id}{as_user(user)}")
    status = watch(args.job_id, kit, user, timeout=args.timeout, poll_interval=args.interval)
    print(f"medflare: job {args.job_id}: {status}")
    return 0 if status == FINISHED_OK else 1


def cmd_compare(args: argparse.Namespace) -> int:
    """``medflare compare``: several methods (and seeds) on the same data, with a comparison table and plots."""
    from medflare.console.files import OutputTarget
    from medflare.console.launch import results_text
    from medflare.console.report import comparison_outputs
    from medflare.console.run_options import build_run_config
    from medflare.plan import preset_lead, shared_data_defaults

    seeds = list(dict.fromkeys(args.seeds or [None]))
    methods = list(dict.fromkeys(args.methods))
    args.preset_lead = preset_lead(getattr(args, "preset", None), methods)
    # one evaluation protocol for all: a method's data defaults (FCA's like_train test slices) apply to every method
    protocol = shared_data_defaults(methods, given=build_run_config(args, methods[0]).data)
    # every run is checked before any starts
    checked = [checked_run(args, method, seed, protocol) for method in methods for seed in seeds]
    plans = [plan for _, plan, _ in checked]
    for line in preset_notes(args, methods):
        print(line)
    _tracking_note(plans[0])
    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    target = OutputTarget(out, overwrite=args.overwrite)
    staging = target.begin()
    show_task(*checked[0])  # one data protocol: the same task for every run
    summaries: list[dict[str, Any]] = []
    try:
        for plan in plans:
            step = f"[{len(summaries) + 1}/{len(plans)}]"
            seed = f" seed {plan.seed}" if len(seeds) > 1 else ""
            print(f"medflare: {step} {plan.method}{seed} on {len(plan.sites)} sites, {len(plan.rounds)} rounds "
                  f"({args.env})")
            folder = staging / plan.method / f"seed{plan.seed}" if len(seeds) > 1 else staging / plan.method
            summaries.append(run_in_env(args, plan, folder))
        comparison_outputs(summaries, staging)
        target.publish()
    except BaseException as exc:
        target.abandon(_compare_failure_log(staging, [_run_label(s, len(seeds)) for s in summaries], exc))
        raise
    print(results_text(summaries, out, seeds=len(seeds)) + "  (comparison.md, comparison.png and one folder per "
          f"method{' and seed' if len(seeds) > 1 else ''})")
    return 0


def _run_label(summary: dict[str, Any], seeds: int) -> str:
    return f"{summary['method']} seed {summary['config'].get('seed')}" if seeds > 1 else summary["method"]


def _compare_failure_log(staging: Path, finished: list[str], exc: BaseException) -> str:
    """Which methods finished, then the failed method's own failure log."""
    logs = "".join(log.read_text(errors="replace") for log in sorted(staging.rglob("*.failed.log")))
    return logs + f"\nmedflare: compare stopped ({exc or type(exc).__name__}); runs finished: {finished or 'none'}\n"


def cmd_export(args: argparse.Namespace) -> int:
    """``medflare export``: the run's FLARE job folder, to submit with FLARE's own tools."""
    from medflare.console.files import OutputTarget
    from medflare.console.job_export import job_code_digest, write_job
    from medflare.console.run_options import build_run_config, data_was_chosen
    from medflare.plan import describe_sites, resolve

    run = build_run_config(args)
    if not data_was_chosen(args):
        run.data["source"] = "site"  # an exported job is for POC/production: each hospital reads its own data
    # every check before anything is written; a weights file is read by the server, which may be another machine
    plan = resolve(run, args.mode, check_files=False)
    for line in preset_notes(args, [plan.method]):
        print(line)
    if plan.pretrained not in (None, "imagenet") and not Path(plan.pretrained).is_file():
        print(f"medflare: note: --pretrained {plan.pretrained} is not here; the FLARE server loads it",
              file=sys.stderr)
    target = OutputTarget(Path(args.output), unit=plan.job_name, overwrite=args.overwrite, option="-o")
    staging = target.begin()
    try:
        write_job(plan, staging, args.mode)
        job_dir = target.publish(source=staging / plan.job_name)
    except BaseException:
        target.abandon()
        raise
    print(f"code digest: {job_code_digest(job_dir)} (send it to the sites: a site whose policy lists approved "
          "code runs only jobs of those digests, policy.approved_code)")
    if plan.data["source"] == "site":
        print(f"wrote {job_dir} ({args.mode}); each site reads its images from local/medflare_site.json. "
              f"Submit it with: nvflare job submit -j {job_dir}")
    else:
        print(f"wrote {job_dir} ({args.mode}) with simulated data '{plan.data['source']}'; "
              f"run it with: nvflare simulator {job_dir} -n {len(plan.sites)} -t {len(plan.sites)}")
    show_task(run, plan, describe_sites(plan)[0])
    print(robust_note(plan))
    print(f"plan {plan.digest()}: the server and every site log this fingerprint once they run it")
    return 0


def robust_note(plan: Any) -> str:
    """One line saying which of the server's robust defences the exported job has on (meta.json records them):
    "on" only where they guarantee something for the job's sites (a rule that holds for them, or the deployment's
    bounds: :meth:`~medflare.server_setup.RobustConfig.guarantee_refusal`)."""
    from medflare.server_setup import DEPLOY_ROBUST

    record = plan.defences.record()
    turn_on = " ".join(f"--set robust.{key}={value:g}" for key, value in DEPLOY_ROBUST.items())
    if not record["on"]:
        return f"robust aggregation: off (one site can take over the aggregate); on: {turn_on}"
    settings = ", ".join(f"{key}={value:g}" if not isinstance(value, str) else f"{key}={value}"
                         for key, value in record.items() if key != "on")
    shortfall = plan.defences.guarantee_refusal(len(plan.sites))
    if shortfall:
        return (f"robust aggregation: no guarantee for this job's {len(plan.sites)} sites ({settings}): {shortfall}; "
                f"bounded: {turn_on}")
    return f"robust aggregation: on ({settings}); off: --set robust.off=true (docs/deploy-lead.md)"


def cmd_report(args: argparse.Namespace) -> int:
    """``medflare report``: a run's outputs rebuilt from a downloaded job's results."""
    from medflare.console.files import OutputTarget
    from medflare.console.launch import report_from_results, results_text

    results = Path(args.results)
    beside = results if results.is_dir() else results.parent
    out = Path(args.output) if args.output else beside
    target = OutputTarget(out, overwrite=True, merge=True, option="-o")
    target.check()
    staging = target.begin()
    try:
        summary = report_from_results(results, staging, copy_models=out.resolve() != beside.resolve())
        target.publish()
    except BaseException:
        target.abandon()
        raise
    print(results_text([summary], out) + "  (summary.json, rounds.csv, report.md, learning_curves.png)")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    """``medflare predict``: a saved global model's predictions for new images, as CSV."""
    from medflare.console.predict import predict_file

    done = predict_file(args.checkpoint, args.input, args.output, split=args.split, window=args.window,
                        batch_size=args.batch_size, device=args.device, threads=args.threads)
    if done["note"]:
        print(f"medflare: note: {done['note']}", file=sys.stderr)
    kind = "findings" if done["multi_label"] else "classes"
    print(f"medflare: wrote {done['images']} predictions of {done['method']} ({done['model']}, {kind} "
          f"{', '.join(done['class_names'])}, on {done['device']}) to {done['output']}")
    if done["metrics"] is not None:
        print(f"medflare: {metrics_text(done['metrics'], done['labelled'])}")
    return 0


def metrics_text(metrics: dict[str, float | None], labelled: int) -> str:
    """``on N labelled images: balanced accuracy 0.8125, ...`` (n/a where a metric is undefined)."""
    from medflare.evaluation import metric_name

    if not labelled:
        return "the input's labels mark no image as labelled: no metrics"
    values = ", ".join(f"{metric_name(key)} {'n/a' if value is None else f'{value:.4f}'}"
                       for key, value in metrics.items())
    return f"on {labelled} labelled images: {values}"


def cmd_preflight(args: argparse.Namespace) -> int:
    """``medflare preflight``: a site checked before a job (``deploy.preflight``); exit 1 when a check fails."""
    from medflare.console.deploy.preflight import FAIL, as_json, overall, preflight, table

    checks = preflight(args.kit, job=args.job, max_images=args.max_images, server=not args.no_server)
    print(as_json(checks) if args.json else table(checks))
    return 1 if overall(checks) == FAIL else 0


def add_env_options(parser: argparse.ArgumentParser) -> None:
    """Where a command's jobs run: ``--env`` and, for POC, ``--mode``."""
    parser.add_argument("--env", choices=["sim", "poc"], default="sim",
                        help="sim: FLARE simulator (default); poc: a real local FLARE POC (mTLS kits, one process "
                             "per site)")
    parser.add_argument("--mode", choices=["byoc", "preinstalled"], default="byoc",
                        help="with --env poc: job carries the code (byoc) or sites use their installed medflare")


def make_parser() -> argparse.ArgumentParser:
    """The ``medflare`` command line: one subcommand per ``cmd_*`` function."""
    from medflare.console.run_options import add_run_options

    parser = OneLineParser(prog="medflare", description=__doc__, epilog=EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("methods", help="list registered methods").set_defaults(func=cmd_methods)
    sub.add_parser("models", help="list models: parameters, input, offline ImageNet weights").set_defaults(
        func=cmd_models)
    config = sub.add_parser(
        "config", help="print the effective configuration of 'run METHOD [options]' as TOML: every option with its "
                       "type, default and the layer that set it; loadable again with --config")
    config.add_argument("method", help="registered method (see 'medflare methods')")
    config.add_argument("--plan", action="store_true",
                        help="print the run's resolved plan (JSON) instead: every site's model and training settings "
                             "per stage, every round's phases, the options the job carries")
    add_run_options(config)
    config.set_defaults(func=cmd_config)
    run = sub.add_parser("run", help="run a method in the FLARE simulator", epilog=EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("method", help="registered method (see 'medflare methods')")
    add_run_options(run)
    run.add_argument("--out", help="result folder (default runs/<method>-<time>); must be new or empty")
    run.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    add_env_options(run)
    run.add_argument("--resume", metavar="RUN_DIR",
                     help="continue a finished or stopped run from its last global model and round counter "
                          "(--rounds is the total, old rounds included)")
    run.set_defaults(func=cmd_run)
    compare = sub.add_parser("compare", help="run several methods with identical settings (and seeds); one table")
    compare.add_argument("methods", nargs="+", help="registered methods to compare")
    add_run_options(compare)
    compare.add_argument("--seeds", type=int, nargs="+", metavar="SEED",
                         help="run every method once per seed (e.g. --seeds 0 1 2) and report mean ± std; a gap "
                              "within one std is reported as no difference")
    compare.add_argument("--out", help="result folder (default runs/compare-<time>); must be new or empty")
    compare.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    add_env_options(compare)
    compare.set_defaults(func=cmd_compare)
    export = sub.add_parser("export",
                            help="write a FLARE job folder (site-local data unless --data is given) for nvflare job submit")
    export.add_argument("method", help="registered method (see 'medflare methods')")
    add_run_options(export)
    export.add_argument("-o", "--output", required=True, help="folder to write the job folder <name>/ into")
    export.add_argument("--overwrite", action="store_true",
                        help="replace a job folder medflare exported earlier under the same name (only its files)")
    export.add_argument("--mode", choices=["byoc", "preinstalled"], default="byoc",
                        help="byoc: job carries the medflare code; preinstalled: sites have medflare installed")
    export.set_defaults(func=cmd_export)
    report = sub.add_parser("report", help="rebuild summary/plots from a medflare_results.json (e.g. from POC)")
    report.add_argument("results", help="a medflare_results.json (or the folder holding it), e.g. a downloaded "
                                        "job's workspace/app_server/")
    report.add_argument("-o", "--output", help="folder for the report (default: beside the results file); "
                                               "files medflare did not write are never replaced")
    report.set_defaults(func=cmd_report)
    watch = sub.add_parser("watch", help="print a running POC/production job's rounds as they finish")
    watch.add_argument("job_id", help="the job id 'nvflare job submit' (or 'medflare run --env poc') printed")
    watch.add_argument("--startup-kit", help="an admin's startup kit (default: $NVFLARE_STARTUP_KIT_DIR, else the "
                                             "lead's kit of the POC in --poc)")
    watch.add_argument("--poc", help="a POC prepared by python -m medflare.console.deploy.poc (default $MEDFLARE_POC_ROOT "
                                     "or runs/poc)")
    watch.add_argument("--interval", type=float, default=2.0, help="seconds between polls (default 2)")
    watch.add_argument("--timeout", type=float, default=0, help="stop following after this many seconds (0 = never)")
    watch.set_defaults(func=cmd_watch)
    predict = sub.add_parser(
        "predict", help="apply a run's FL_global_model.pt or best_FL_global_model.pt to new images; writes a CSV "
                        "of class probabilities (image, predicted, p_<class>...; multi-label: a sigmoid per "
                        "finding, predicted = the findings scored >= 0.5) and prints balanced accuracy, accuracy "
                        "and AUROC when the input gives labels")
    predict.add_argument("checkpoint", help="FL_global_model.pt or best_FL_global_model.pt of a medflare run")
    predict.add_argument("input", help="a folder of images (first-level folders named like classes give labels), "
                                       "a CSV with a 'path' column, or an npz ('images' or '<split>_images')")
    predict.add_argument("-o", "--output", required=True, help="CSV file to write; must not exist")
    predict.add_argument("--split", default="test", help="which '<split>_images' of a MedMNIST-layout npz (default test)")
    predict.add_argument("--window", help="DICOM/NIfTI intensity window (CENTER,WIDTH or a preset); default: the "
                                          "window the model was trained with")
    predict.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default 64)")
    predict.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                         help="where the model runs: auto (a CUDA GPU when torch sees one, else the CPU; default), "
                              "cpu or cuda")
    predict.add_argument("--threads", type=int, help="CPU threads (default: as each site's trainer, "
                                                     "train.torch_threads)")
    predict.set_defaults(func=cmd_predict)
    rehearse = sub.add_parser(
        "rehearse", help="rehearse a deployment on this machine (root): provisioned kits, one network namespace per "
                         "participant, the lead's job over a shaped WAN, scripted faults; all removed afterwards")
    from medflare.console.deploy.rehearse import add_rehearse_options, cmd_rehearse

    add_rehearse_options(rehearse)
    rehearse.set_defaults(func=cmd_rehearse)
    preflight = sub.add_parser(
        "preflight", help="check this site before a job: kit, certificate, server, medflare_site.json, every image, "
                          "disk, devices, versions, DP budget (PASS/WARN/FAIL; exit 1 on FAIL; writes nothing)")
    preflight.add_argument("kit", help="this site's startup kit (the folder holding startup/ and local/)")
    preflight.add_argument("--job", help="also check a job folder (as `medflare export` writes it) against this "
                                         "site's data and policy, as the site will when the job arrives")
    preflight.add_argument("--json", action="store_true", help="print the report as one JSON object")
    preflight.add_argument("--no-server", action="store_true",
                           help="leave the server unchecked (a WARN), e.g. before the consortium's server runs")
    preflight.add_argument("--max-images", type=int, default=0,
                           help="read at most this many images per split (default 0: every image)")
    preflight.set_defaults(func=cmd_preflight)
    new_method = sub.add_parser(
        "new-method", help="in a source checkout: write a new method (folder, registry line, ledger, card, tests) "
                           "and regenerate what the registry feeds, so the tests pass right after")
    from medflare.console.new_method import add_new_method_options, cmd_new_method

    add_new_method_options(new_method)
    new_method.set_defaults(func=cmd_new_method)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``medflare`` console script: parse, run the subcommand, and turn a medflare error into one line."""
    from medflare.console.processes import Interrupted, stop_on_signals

    args = make_parser().parse_args(argv)
    try:
        with stop_on_signals():
            return args.func(args)
    except MedflareError as exc:
        print(f"medflare: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`medflare methods | head`): end quietly as a Unix tool killed by SIGPIPE would,
        # with stdout pointed at /dev/null so the interpreter's final flush raises nothing either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        # wherever the disk filled up (a report, a copied model, a log), the folders were already cleaned up
        # on the way out (OutputTarget.abandon); what is left is one line saying why
        print(f"medflare: error: {disk_full_message(exc)}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"medflare: interrupted by {exc}; stopped every process medflare started", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("medflare: interrupted", file=sys.stderr)
        return 130


def _one_line(exc: Exception) -> str:
    """Configuration errors are one line; a failed run's error may carry the tail of its log below it."""
    text = str(exc)
    return " ".join(text.split()) if isinstance(exc, ConfigError) else text


if __name__ == "__main__":
    sys.exit(main())
