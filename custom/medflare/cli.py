"""The ``medflare`` command: list methods and models, run a method in the FLARE simulator, export a job."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from medflare.config import load_config_file
from medflare.errors import MedflareError

EXAMPLES = """examples:
  medflare methods
  medflare run fedavg --clients 2 --rounds 3
  medflare run bsm-fl --data synthetic:imbalance=20 --partition dirichlet:0.5 --clients 3
  medflare run fedprox --data medmnist:../shared/data/medmnist/pneumoniamnist.npz --set method.mu=0.1
  medflare export fedavg -o jobs/ --mode preinstalled --set task.num_classes=2 --set task.in_channels=1 --set task.image_size=28
"""


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", help="synthetic[:k=v,...] | medmnist:PATH | folder:DIR | csv:FILE | site")
    parser.add_argument("--partition", help="iid | dirichlet:A | quantity:A | attribute:F1/F2/.. | labelset:K | longtail-missing:A[:M]")
    parser.add_argument("--clients", type=int, help="number of sites (default 2)")
    parser.add_argument("--rounds", type=int, help="federated rounds (default 3)")
    parser.add_argument("--local-epochs", type=int, help="local epochs per round (default 1)")
    parser.add_argument("--max-steps", type=int, help="cap on optimizer steps per site per round (0 = none)")
    parser.add_argument("--batch-size", type=int, help="local batch size (default 64)")
    parser.add_argument("--lr", type=float, help="local learning rate")
    parser.add_argument("--model", help="model name (see 'medflare models'; default cnn)")
    parser.add_argument("--pretrained", help="'imagenet' (efficientnet_lite0) or a local weights file")
    parser.add_argument("--seed", type=int, help="seed for data, partition and initial model (default 0)")
    parser.add_argument("--scenario", help="named set-up: hyperkvasir-like | isic-attribute-like (see docs/scenarios)")
    parser.add_argument("--config", help="JSON or TOML file with run options (overrides the scenario; flags override it)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override any option: method.mu=0.1, train.weight_decay=1e-4, data.label_noise=0.2, min_clients=2",
    )


def build_run_config(args: argparse.Namespace) -> Any:
    """Defaults <- --config <- flags <- --set."""
    from medflare.run_config import apply_overrides, merge_run_config, merge_sections

    from medflare.scenarios import load_scenario

    scenario = load_scenario(args.scenario) if args.scenario else {}
    base = merge_sections(scenario, load_config_file(args.config) if args.config else {})
    base["method"] = args.method
    data = {k: v for k, v in (("source", args.data), ("partition", args.partition)) if v is not None}
    train = {
        k: v
        for k, v in (
            ("local_epochs", args.local_epochs), ("max_steps", args.max_steps),
            ("batch_size", args.batch_size), ("lr", args.lr),
        )
        if v is not None
    }
    flags = {
        "clients": args.clients, "rounds": args.rounds, "model": args.model, "pretrained": args.pretrained,
        "seed": args.seed, "data": data or None, "train": train or None,
    }
    return apply_overrides(merge_run_config(base, flags), args.set)


def cmd_methods(args: argparse.Namespace) -> int:
    from medflare.registry import get_method, list_methods

    for name in list_methods():
        print(f"{name:12s} {get_method(name).summary}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from medflare.models import list_models

    print("\n".join(list_models()))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from medflare.report import results_table
    from medflare.simulate import run_simulation

    run = build_run_config(args)
    out = Path(args.out or f"runs/{run.job_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if getattr(args, "env", "sim") == "poc":
        from medflare.deploy.poc import run_poc

        print(f"medflare: running {run.method} on a {run.clients}-site FLARE POC for {run.rounds} rounds -> {out}")
        summary = run_poc(run, out, mode=args.mode)
    else:
        print(f"medflare: running {run.method} on {run.clients} simulated sites for {run.rounds} rounds -> {out}")
        summary = run_simulation(run, out)
    print()
    print(results_table([summary]))
    timing = summary["timing"]
    print(
        f"\nstart-up {timing.get('startup_seconds', 0):.1f} s, mean round {timing.get('mean_round_seconds') or 0:.2f} s"
    )
    print(f"results: {out.resolve()}  (summary.json, rounds.csv, report.md, learning_curves.png)")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from medflare.report import comparison_outputs, results_table
    from medflare.simulate import run_simulation

    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    summaries = []
    for method in args.methods:
        args.method = method
        run = build_run_config(args)
        print(f"medflare: [{len(summaries) + 1}/{len(args.methods)}] {method} on {run.clients} sites, {run.rounds} rounds")
        summaries.append(run_simulation(run, out / method))
    files = comparison_outputs(summaries, out)
    print()
    print(results_table(summaries))
    print(f"\nresults: {out.resolve()}  ({', '.join(f.name for f in files)} and one folder per method)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from medflare.job_export import export_job

    run = build_run_config(args)
    if not data_was_chosen(args):
        run.data = {"source": "site"}  # an exported job is for POC/production: each hospital reads its own data
    job_dir = export_job(run, args.output, run.task_spec(), mode=args.mode)
    if run.data["source"] == "site":
        print(f"wrote {job_dir} ({args.mode}); each site reads its images from local/medflare_site.json. "
              f"Submit it with: nvflare job submit -j {job_dir}")
    else:
        print(f"wrote {job_dir} ({args.mode}) with simulated data '{run.data['source']}'; "
              f"run it with: nvflare simulator {job_dir} -n {run.clients} -t {run.clients}")
    return 0


def data_was_chosen(args: argparse.Namespace) -> bool:
    """True when --data, a scenario or a config file picked the data source (else the built-in default did)."""
    from_file = bool(args.config) and "source" in load_config_file(args.config).get("data", {})
    return args.data is not None or bool(args.scenario) or from_file


def cmd_report(args: argparse.Namespace) -> int:
    import json

    from medflare.report import build_summary, results_table, write_outputs

    source = Path(args.results)
    results = json.loads(source.read_text())
    summary = build_summary(results, {"method": results.get("method")}, {})
    files = write_outputs(summary, args.output or source.parent)
    print(results_table([summary]))
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="medflare", description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("methods", help="list registered methods").set_defaults(func=cmd_methods)
    sub.add_parser("models", help="list model names").set_defaults(func=cmd_models)
    run = sub.add_parser("run", help="run a method in the FLARE simulator", epilog=EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("method", help="registered method (see 'medflare methods')")
    _add_run_options(run)
    run.add_argument("--out", help="result folder (default runs/<method>-<time>)")
    run.add_argument("--env", choices=["sim", "poc"], default="sim",
                     help="sim: FLARE simulator (default); poc: a real local FLARE POC (mTLS kits, one process per site)")
    run.add_argument("--mode", choices=["byoc", "preinstalled"], default="byoc",
                     help="with --env poc: job carries the code (byoc) or sites use their installed medflare")
    run.set_defaults(func=cmd_run)
    compare = sub.add_parser("compare", help="run several methods with identical settings; one table")
    compare.add_argument("methods", nargs="+", help="registered methods to compare")
    _add_run_options(compare)
    compare.add_argument("--out", help="result folder (default runs/compare-<time>)")
    compare.set_defaults(func=cmd_compare)
    export = sub.add_parser(
        "export", help="write a FLARE job folder (site-local data unless --data is given) for nvflare job submit"
    )
    export.add_argument("method", help="registered method (see 'medflare methods')")
    _add_run_options(export)
    export.add_argument("-o", "--output", required=True, help="folder to write the job into")
    export.add_argument("--mode", choices=["byoc", "preinstalled"], default="byoc",
                        help="byoc: job carries the medflare code; preinstalled: sites have medflare installed")
    export.set_defaults(func=cmd_export)
    report = sub.add_parser("report", help="rebuild summary/plots from a medflare_results.json (e.g. from POC)")
    report.add_argument("results", help="path to medflare_results.json")
    report.add_argument("-o", "--output", help="folder for the report (default: beside the results file)")
    report.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except MedflareError as exc:
        print(f"medflare: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("medflare: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
