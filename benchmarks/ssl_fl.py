"""SSL-FL on RetinaMNIST and PneumoniaMNIST: ViT from scratch vs Fed-MAE vs Fed-BEiT, fine-tuned federatedly.

Parts (``--part``):
  main    Dirichlet(alpha) label skew over 5 simulated sites, alpha in {100, 1.0, 0.5}, both data sets, every
          label kept: Fed-MAE vs its scratch arm (scratch-mae: fed-mae with pretrain_rounds=0, the same network,
          initialisation and fine-tuning recipe) and Fed-BEiT vs its own (scratch-beit: fed-beit's layer scale
          0.1, drop-path 0.2 and gradient clipping 3.0, no tokenizer or pre-training).
  labels  the label-efficiency curve: the same, with data.label_fraction 0.1, 0.3 and 1.0 (1.0 = the main
          grid's job), on one data set and alpha (default RetinaMNIST, alpha 100 = the paper's IID Split-1).
  fedmas  Fed-MAS with a Fed-MAE prior (the encoder pre-trained on the same sites) vs the ImageNet
          EfficientNet-Lite0 prior, on RetinaMNIST alpha 0.5 (long tail; head > 300, tail < 100 images).

Every (data set, alpha, seed) pre-trains once per method in a pre-training-only job; its exported encoder is
then fine-tuned in chained jobs (``pretrained=encoder.pt``, ``pretrain_rounds=0``), so the label fractions
share one pre-training, as the paper's label-efficiency runs do. The split is simulated (MedMNIST has no
hospital IDs); metrics are of the final global model on the sites' pooled test splits.

Runner: by default every job runs in this process through the same code FLARE runs (SiteRuntime at each site,
RoundAggregation with the method's rule at the server, sites one after another, each with its own random
generators as in its own process: ``benchmarks/inprocess.py``, shared with ``mdhfl.py``), which saves FLARE's
per-job start-up on a shared 2-core machine.
``--check-simulator`` runs one small job both in FLARE's simulator and in process and records whether their
final metrics are identical. ``--runner simulator`` runs everything in FLARE's simulator.

Usage:
    python benchmarks/ssl_fl.py --part main [--datasets retina pneumonia] [--alphas 100 1.0 0.5] [--seeds 0 1 2]
    python benchmarks/ssl_fl.py --part labels | --part fedmas | --check-simulator
    budgets: --pretrain-rounds R --finetune-rounds R --max-steps S --fedmas-rounds R (job names omit them:
    give a run with other budgets its own --out)
    python benchmarks/ssl_fl.py --part all --report-only    (tables and plot from the finished jobs only)
Finished jobs are cached in --out (rerunning skips them; a cached job run with another configuration stops the
script). The rows go to --results, the mean ± std tables to the same name with .md, the label-efficiency plot
beside it (-label-efficiency.png).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
from benchmarking import mean_std, versus

from medflare import contracts
from medflare.config import from_dict, parse_value
from medflare.console.simulate import run_simulation
from medflare.data.checksums import verify_medmnist_file
from medflare.evaluation import summarize
from medflare.methods.ssl_fl.export import ENCODER_FORMAT, export_global_model
from medflare.metrics import shot_groups_from_counts
from medflare.plan import describe_sites, resolve, task_of
from medflare.plotting import legend_outside, pyplot, save
from medflare.registry import get_method
from medflare.run_config import RunConfig

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # benchmarks/ is not a package: the sibling scripts are imported by name
    sys.path.insert(0, str(HERE))

from inprocess import RoundDone, run_rounds  # noqa: E402

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist"
DATASETS = {"retina": "retinamnist.npz", "pneumonia": "pneumoniamnist.npz"}
CLASSES = {"retina": 5, "pneumonia": 2}  # balanced accuracy of a constant prediction = 1 / classes
METHODS = ("scratch-mae", "fed-mae", "scratch-beit", "fed-beit")
# arm -> the registered method whose network and fine-tuning recipe it runs; each pre-training arm is read against
# the scratch arm with its own recipe (the "vs scratch" column)
NETWORK = {"scratch-mae": "fed-mae", "fed-mae": "fed-mae", "scratch-beit": "fed-beit", "fed-beit": "fed-beit"}
SCRATCH = {"fed-mae": "scratch-mae", "fed-beit": "scratch-beit"}
LEGACY_NAMES = {"scratch-mae-": "scratch-"}  # scratch-mae jobs were named "scratch-ft-..." (same configuration)
# CPU budget per job (stated in docs/benchmarks.md): a ViT-Micro at 28 px, 5 sites, max_steps per site and round.
MODEL, CLIENTS, BATCH = "vit_micro", 5, 32
PRETRAIN = {"rounds": 20, "max_steps": 10}  # Fed-BEiT: 2 of these rounds train its tokenizer first
TOKENIZER_ROUNDS = 2
# Fed-BEiT's tokenizer options, written into its pre-training jobs (a job cached with the old, collapsed tokenizer
# then differs in method_args and is refused rather than reused)
# Pre-training keeps the generic flip + affine the earlier tables used (the methods' paper recipes are now their
# defaults), so a re-measurement changes only the tokenizer, norm_pix_loss's default and the scratch arms.
PRETRAIN_AUGMENT = {"pretrain_augment": "basic"}
BEIT_ARGS = {"dvae_usage_weight": 1.0, "min_code_perplexity": 16.0, **PRETRAIN_AUGMENT}
# Fed-MAE pre-training options: a decoder narrower than the 96-d encoder (--mae-arg adds others)
MAE_ARGS = {"decoder_dim": 64, "decoder_depth": 2, "decoder_heads": 4, **PRETRAIN_AUGMENT}
# Both pre-trainings at BEiT's absolute lr 1.5e-3: MAE's rule (blr 2e-3 x 32 / 256 = 2.5e-4) is meant for
# hundreds of epochs at large batches.
PRETRAIN_TRAIN = {"stages": {"pretrain": {"lr": 1.5e-3, "base_batch": 0}}}
FINETUNE = {"rounds": 20, "max_steps": 10}
# CPU-budget recipe, the same for every arm: in a centralised 64-step probe on PneumoniaMNIST's validation split a
# ViT-Micro from scratch stayed at the majority class with MAE's rule (3e-3 x 32 / 256) and learned with an absolute
# 2e-3 (layer decay 0.65); augmentation and Mixup/CutMix also slow such short runs, so fine-tuning runs without them.
FINETUNE_TRAIN = {"lr": 2e-3, "base_batch": 0}
FINETUNE_DATA = {"augment": "none"}
FINETUNE_ARGS = {"mixup": 0.0, "cutmix": 0.0, "finetune_augment": "none"}
FEDMAS = {"rounds": 10, "model": "cnn", "batch_size": 64}  # as benchmarks/fedmas_vs_baselines.py --setting retina
SHOT_THRESHOLDS = (300, 100)


# ----- one job --------------------------------------------------------------------------------------------
def run_in_process(run: RunConfig, log: Any = print) -> dict[str, Any]:
    """The job's rounds in this process (``inprocess.run_rounds``): the final evaluation summary, the last global
    model, the mean training loss and the server's record of each round."""
    losses, infos = [], []

    def record(done: RoundDone) -> None:
        plan = done.plan
        infos.append({"round": plan.round + 1, "stage": plan.stage, **done.aggregate.info})
        losses.append(statistics.mean(u.meta[contracts.TRAIN_LOSS] for u in done.accepted))
        log(f"    round {plan.round + 1}/{run.rounds} ({plan.stage}) loss {losses[-1]:.4f} {done.seconds:.1f}s")

    global_params, evaluations = run_rounds(run, on_round=record)
    _, counts = describe_sites(resolve(run, "byoc"))
    groups = shot_groups_from_counts(counts, *run.shot_thresholds) if run.shot_thresholds and counts else None
    return {"final": summarize(evaluations, groups), "global_params": global_params, "train_loss": losses,
            "per_round": infos}


def run_job(run: RunConfig, runner: str, out: Path, log: Any = print) -> dict[str, Any]:
    """Final test metrics of one job (``runner`` 'inprocess' or 'simulator'); the global model lands in ``out``."""
    started = time.perf_counter()
    if runner == "simulator":
        summary = run_simulation(resolve(run, "byoc"), out, echo=lambda line: None)
        metrics = {k: v for k, v in summary["final"].items() if k not in ("by_site", "site_mean", "extra")}
        metrics.update(tokenizer_codes(summary["per_round"]))
        model_file = out / "FL_global_model.pt"
    else:
        result = run_in_process(run, log)
        metrics = {**result["final"]["test"], "train_loss_per_round": result["train_loss"],
                   **tokenizer_codes(result["per_round"])}
        out.mkdir(parents=True, exist_ok=True)
        model_file = out / "FL_global_model.pt"
        torch.save({"model": {k: torch.from_numpy(np.array(v)) for k, v in result["global_params"].items()}}, model_file)
    return {"metrics": metrics, "seconds": time.perf_counter() - started, "model_file": str(model_file)}


def tokenizer_codes(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """Fed-BEiT: the visual tokens' codes used (per site) and perplexity (per site, image-weighted mean) in the
    first pre-training round, whose targets are the final tokenizer's; {} for other jobs."""
    first = next((r for r in per_round if r.get("stage") == "pretrain" and "code_perplexity_mean" in r), None)
    if first is None:
        return {}
    return {"tokenizer": {k: first[k] for k in ("codes_used", "code_perplexity", "code_perplexity_mean")}}


# ----- the grid ---------------------------------------------------------------------------------------------
def data_config(dataset: str, alpha: float, fraction: float = 1.0) -> dict[str, Any]:
    path = DATA_DIR / DATASETS[dataset]
    verify_medmnist_file(path)
    data = {"source": f"medmnist:{path}", "partition": f"dirichlet:{alpha:g}"}
    return {**data, "label_fraction": fraction} if fraction < 1.0 else data


def pretrain_run(method: str, dataset: str, alpha: float, seed: int) -> RunConfig:
    rounds = PRETRAIN["rounds"]
    args: dict[str, Any] = {"pretrain_rounds": rounds, "finetune_rounds": 0, **MAE_ARGS}
    if method == "fed-beit":
        args = {"tokenizer_rounds": TOKENIZER_ROUNDS, "pretrain_rounds": rounds - TOKENIZER_ROUNDS, "finetune_rounds": 0,
                **BEIT_ARGS}
    return RunConfig(method=method, model=MODEL, rounds=rounds, clients=CLIENTS, seed=seed, method_args=args,
                     data=data_config(dataset, alpha),
                     train={"max_steps": PRETRAIN["max_steps"], "batch_size": BATCH, **PRETRAIN_TRAIN},
                     site_evaluation="final", name=f"{method}-pt-{dataset}-a{alpha:g}-s{seed}")


def finetune_run(method: str, dataset: str, alpha: float, seed: int, fraction: float, encoder: str | None) -> RunConfig:
    network = NETWORK[method]  # a scratch arm: its pre-training method's network and recipe, no pre-training
    args: dict[str, Any] = {"pretrain_rounds": 0, **FINETUNE_ARGS}
    if network == "fed-beit":
        args["tokenizer_rounds"] = 0
    return RunConfig(method=network, model=MODEL, rounds=FINETUNE["rounds"], clients=CLIENTS, seed=seed,
                     method_args=args, pretrained=encoder, data={**data_config(dataset, alpha, fraction), **FINETUNE_DATA},
                     train={"max_steps": FINETUNE["max_steps"], "batch_size": BATCH, **FINETUNE_TRAIN},
                     site_evaluation="final", name=f"{method}-ft-{dataset}-a{alpha:g}-f{fraction:g}-s{seed}")


class MissingJob(LookupError):
    """A job the report needs has not finished (``--report-only`` runs nothing)."""


def job_config(run: RunConfig) -> dict[str, Any]:
    """What a cached job's result records about its run, as JSON reads it back (budget, data, recipe)."""
    config = {k: v for k, v in vars(run).items() if k in ("method", "model", "rounds", "clients", "seed",
                                                          "method_args", "data", "train", "pretrained")}
    if run.pretrained:  # the encoder's weights, not only its path: a re-exported encoder is another job
        config["pretrained_digest"] = encoder_digest(run.pretrained)
    return json.loads(json.dumps(config, default=str))


def encoder_digest(path: str) -> str:
    """sha256 over an encoder file's tensors (state dict and trained norm), in key order."""
    import hashlib

    content = torch.load(path, map_location="cpu", weights_only=True)
    digest = hashlib.sha256(str(content.get("format")).encode())
    for part in ("state_dict", "encoder_norm"):
        for key, tensor in sorted((content.get(part) or {}).items()):
            digest.update(key.encode())
            digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


class Grid:
    """Runs and caches jobs under ``out``: one folder per job with result.json (rerunning skips finished jobs).

    Job names omit the budget, so a cached job is reused only when its recorded configuration equals the
    requested one; anything else stops the script rather than mixing budgets in one table.
    """

    def __init__(self, out: Path, runner: str, run_missing: bool = True) -> None:
        self.out, self.runner, self.run_missing = out, runner, run_missing

    def job(self, run: RunConfig) -> dict[str, Any]:
        folder = self.out / run.name
        for new, old in LEGACY_NAMES.items():  # a job finished under its former name is reused from there
            legacy = self.out / run.name.replace(new, old, 1)
            if run.name.startswith(new) and not folder.exists() and (legacy / "result.json").is_file():
                folder = legacy
        done = folder / "result.json"
        config = job_config(run)
        if done.is_file():
            result = json.loads(done.read_text())
            if result.get("config") != config:
                changed = sorted(k for k in config if result.get("config", {}).get(k) != config[k])
                raise SystemExit(f"{done} was run with another configuration ({', '.join(changed)} differ): give "
                                 f"this budget its own --out, or delete {folder} to redo it")
            return result
        if not self.run_missing:
            raise MissingJob(run.name)
        print(f"  {run.name} ...", flush=True)
        result = run_job(run, self.runner, folder)
        result["config"] = config
        done.write_text(json.dumps(result, indent=1, default=str) + "\n")
        m = result["metrics"]
        print(f"  {run.name}: accuracy {m['accuracy']:.4f}, balanced {m['balanced_accuracy']:.4f} "
              f"({result['seconds']:.0f}s)", flush=True)
        return result

    def encoder(self, method: str, dataset: str, alpha: float, seed: int) -> str:
        """The exported encoder of the method's pre-training job for this split (run once, then cached)."""
        run = pretrain_run(method, dataset, alpha, seed)
        file = self.out / run.name / "encoder.pt"
        result = self.job(run)  # cached when finished with this configuration; refused when run with another
        if not file.is_file() or torch.load(file, weights_only=True).get("format") != ENCODER_FORMAT:
            task, spec = task_of(run), get_method(method)
            network = spec.build_model(MODEL, task.num_classes, task.in_channels, task.image_size, None,
                                       from_dict(spec.config_cls, run.method_args, method))
            export_global_model(network, method, MODEL, result["model_file"], file)
        return str(file)

    def finetune(self, method: str, dataset: str, alpha: float, seed: int, fraction: float = 1.0) -> dict[str, Any]:
        encoder = None if method in SCRATCH.values() else self.encoder(method, dataset, alpha, seed)
        result = self.job(finetune_run(method, dataset, alpha, seed, fraction, encoder))
        row = {"method": method, "dataset": dataset, "alpha": alpha, "seed": seed, "label_fraction": fraction,
               "accuracy": result["metrics"]["accuracy"], "balanced_accuracy": result["metrics"]["balanced_accuracy"],
               "macro_f1": result["metrics"].get("macro_f1"), "seconds": result["seconds"]}
        if method == "fed-beit":  # the tokenizer its encoder learnt from (recorded by the pre-training job)
            tokenizer = self.job(pretrain_run(method, dataset, alpha, seed))["metrics"].get("tokenizer", {})
            row.update({"code_perplexity": tokenizer.get("code_perplexity_mean"),
                        "codes_used": tokenizer.get("codes_used")})
        return row

    def fedmas(self, prior: str, seed: int, dataset: str = "retina", alpha: float = 0.5) -> dict[str, Any]:
        args: dict[str, Any] = {}
        if prior == "fed-mae":
            args = {"prior": f"fed-mae:{self.encoder('fed-mae', dataset, alpha, seed)}", "prior_dim": 96}
        run = RunConfig(method="fedmas", model=FEDMAS["model"], rounds=FEDMAS["rounds"], clients=CLIENTS, seed=seed,
                        method_args=args, data=data_config(dataset, alpha), shot_thresholds=list(SHOT_THRESHOLDS),
                        train={"batch_size": FEDMAS["batch_size"]}, site_evaluation="final",
                        name=f"fedmas-{prior}-{dataset}-a{alpha:g}-s{seed}")
        m = self.job(run)["metrics"]
        return {"prior": prior, "dataset": dataset, "alpha": alpha, "seed": seed, "accuracy": m["accuracy"],
                "balanced_accuracy": m["balanced_accuracy"], "tail_accuracy": m.get("tail_accuracy"),
                "head_accuracy": m.get("head_accuracy")}


def check_simulator(grid: Grid) -> dict[str, Any]:
    """One small two-stage job in FLARE's simulator and in process: are the final metrics identical?"""
    run = RunConfig(method="fed-mae", model=MODEL, rounds=3, clients=2, seed=0, method_args={"pretrain_rounds": 1},
                    data={**data_config("retina", 1.0), "label_fraction": 0.5}, site_evaluation="final",
                    train={"max_steps": 2, "batch_size": 16}, name="check")
    simulator = run_job(run, "simulator", grid.out / "check-simulator")["metrics"]
    in_process = run_job(run, "inprocess", grid.out / "check-inprocess", log=lambda m: None)["metrics"]
    keys = ("accuracy", "balanced_accuracy", "macro_f1", "loss")
    return {"simulator": {k: simulator.get(k) for k in keys}, "in_process": {k: in_process.get(k) for k in keys},
            "identical": all(simulator.get(k) == in_process.get(k) for k in keys)}


# ----- tables ----------------------------------------------------------------------------------------------
def gather(make_row: Callable[..., dict[str, Any]], cells: Iterable[tuple]) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of the cells whose jobs finished, and the names of the jobs still missing (``--report-only``)."""
    rows, missing = [], []
    for cell in cells:
        try:
            rows.append(make_row(*cell))
        except MissingJob as job:
            missing.append(str(job))
    return rows, missing


def table(rows: list[dict[str, Any]], keys: tuple[str, ...], group: str, metrics: tuple[str, ...],
          baseline: str | dict[str, str] | None = None) -> list[str]:
    """Markdown rows: one per (keys, group) cell, mean ± std over seeds of each metric.

    With ``baseline`` (a value of ``group``), a last column reads the first metric's gap to the baseline in the
    same (keys) cell: within one standard deviation is "no difference".
    """
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault(tuple(row[k] for k in keys) + (row[group],), []).append(row)
    against = (lambda arm: baseline.get(arm)) if isinstance(baseline, dict) else (lambda arm: baseline)
    extra = [f"{metrics[0]} vs {'its scratch arm' if isinstance(baseline, dict) else baseline}"] if baseline else []
    header = list(keys) + [group] + list(metrics) + ["seeds"] + extra
    lines = [f"| {' | '.join(header)} |", "|" + "---|" * len(header)]
    for cell, members in sorted(cells.items(), key=lambda item: tuple(str(v) for v in item[0])):
        values = ["{:.4f} ± {:.4f}".format(*mean_std([m[metric] for m in members])) for metric in metrics]
        if baseline:
            reference = against(cell[-1])
            base = cells.get(cell[:-1] + (reference,)) if reference else None
            ours = [m[metrics[0]] for m in members]
            values.append("" if cell[-1] == reference or not base else versus(ours, [b[metrics[0]] for b in base]))
        columns = [str(v) for v in cell] + values[: len(metrics)] + [str(len(members))] + values[len(metrics):]
        lines.append(f"| {' | '.join(columns)} |")
    return lines


def label_efficiency_figure(rows: list[dict[str, Any]], metric: str = "balanced_accuracy") -> Any:
    """Per method: ``metric`` against the labelled share of each site's images (mean ± std over seeds)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    points: dict[str, dict[float, list[float]]] = {}
    for row in rows:
        points.setdefault(row["method"], {}).setdefault(row["label_fraction"], []).append(row[metric])
    seeds = {len(v) for by_fraction in points.values() for v in by_fraction.values()}
    for method, by_fraction in points.items():
        fractions = sorted(by_fraction)
        stats = [mean_std(by_fraction[f]) for f in fractions]
        ax.errorbar([100 * f for f in fractions], [m for m, _ in stats], yerr=[s for _, s in stats], capsize=3,
                    marker="o", label=method)
    ticks = sorted({100 * f for by_fraction in points.values() for f in by_fraction})
    chance = {1 / CLASSES[r["dataset"]] for r in rows if r["dataset"] in CLASSES}
    if metric == "balanced_accuracy" and len(chance) == 1:
        ax.axhline(chance.pop(), color="grey", linestyle=":", label="chance")
    ax.set_xscale("log")
    ax.set_xticks(ticks, [f"{t:g}%" for t in ticks])
    ax.minorticks_off()
    spread = f"mean ± std over {max(seeds)} seeds" if seeds and max(seeds) > 1 else "one seed"
    setting = ", ".join(sorted({f"{r['dataset']} alpha {r['alpha']:g}" for r in rows}))
    ax.set(xlabel="labelled share of each site's training images", ylabel=f"test {metric.replace('_', ' ')}",
           title=f"label efficiency, {setting} ({spread})")
    legend_outside(ax)
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["main", "labels", "fedmas", "all"], default="all")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--alphas", type=float, nargs="+", default=[100.0, 1.0, 0.5])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.3, 1.0])
    parser.add_argument("--labels-setting", nargs=2, default=["retina", "100"], metavar=("DATASET", "ALPHA"))
    parser.add_argument("--runner", choices=["inprocess", "simulator"], default="inprocess")
    parser.add_argument("--check-simulator", action="store_true", help="only compare the two runners on one job")
    parser.add_argument("--report-only", action="store_true", help="run nothing: tables from the finished jobs")
    parser.add_argument("--pretrain-rounds", type=int, default=PRETRAIN["rounds"],
                        help=f"pre-training rounds, Fed-BEiT's {TOKENIZER_ROUNDS} tokenizer rounds included")
    parser.add_argument("--finetune-rounds", type=int, default=FINETUNE["rounds"])
    parser.add_argument("--max-steps", type=int, default=FINETUNE["max_steps"],
                        help="steps per site and round in pre-training and fine-tuning (smoke runs: 1)")
    parser.add_argument("--fedmas-rounds", type=int, default=FEDMAS["rounds"])
    parser.add_argument("--mae-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a Fed-MAE pre-training option, e.g. norm_pix_loss=false (use its own --out)")
    parser.add_argument("--out", default="runs/bench-ssl-fl")
    parser.add_argument("--results", default="benchmarks/results/ssl_fl.json")
    args = parser.parse_args()
    set_budget(args)
    torch.set_num_threads(1)
    grid = Grid(Path(args.out), args.runner, run_missing=not args.report_only)
    results_file = Path(args.results)
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    if args.check_simulator:
        results["simulator_check"] = check_simulator(grid)
        print(json.dumps(results["simulator_check"], indent=1))
    else:
        results["budget"] = {"model": MODEL, "clients": CLIENTS, "batch_size": BATCH, "pretrain": PRETRAIN,
                             "tokenizer_rounds": TOKENIZER_ROUNDS, "mae_args": MAE_ARGS, "finetune": FINETUNE,
                             "pretrain_train": PRETRAIN_TRAIN, "finetune_train": FINETUNE_TRAIN,
                             "finetune_data": FINETUNE_DATA, "finetune_args": FINETUNE_ARGS, "fedmas": FEDMAS,
                             "runner": args.runner}
        report = run_parts(grid, args, results)
        report_file = results_file.with_suffix(".md")
        report_file.write_text("\n".join(report) + "\n")
        print(f"tables: {report_file}")
    results_file.parent.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {results_file}")


def run_parts(grid: Grid, args: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    """Runs (or, with --report-only, reads) the parts asked for; their rows go into ``results``, tables returned."""
    metrics = ("balanced_accuracy", "accuracy", "macro_f1")
    report: list[str] = []
    missing: list[str] = []
    if args.part in ("main", "all"):
        cells = [(m, d, a, s) for d in args.datasets for a in args.alphas for s in args.seeds for m in args.methods]
        rows, lost = gather(grid.finetune, cells)
        results["main"] = _merge(results.get("main", []), rows, ("method", "dataset", "alpha", "seed"))
        results["main"] = [r for r in results["main"] if r["method"] in METHODS]  # the former single "scratch" arm
        report += ["## main", *table(results["main"], ("dataset", "alpha"), "method", metrics, baseline=SCRATCH), ""]
        missing += lost
    if args.part in ("labels", "all"):
        dataset, alpha = args.labels_setting[0], float(args.labels_setting[1])
        cells = [(m, dataset, alpha, s, f) for f in args.fractions for s in args.seeds for m in args.methods]
        rows, lost = gather(grid.finetune, cells)
        results["labels"] = _merge(results.get("labels", []), rows, ("method", "dataset", "alpha", "seed", "label_fraction"))
        results["labels"] = [r for r in results["labels"] if r["method"] in METHODS]
        report += ["## labels", *table(results["labels"], ("dataset", "alpha", "label_fraction"), "method", metrics,
                                       baseline=SCRATCH), ""]
        if results["labels"]:
            plot = results_file_for_plot(args)
            save(label_efficiency_figure(results["labels"]), plot)
            report += [f"plot: {plot}", ""]
        missing += lost
    if args.part in ("fedmas", "all"):
        cells = [(prior, s) for prior in ("imagenet-lite0", "fed-mae") for s in args.seeds]
        rows, lost = gather(grid.fedmas, cells)
        results["fedmas"] = _merge(results.get("fedmas", []), rows, ("prior", "dataset", "alpha", "seed"))
        report += ["## fedmas", *table(results["fedmas"], ("dataset", "alpha"), "prior",
                                       ("balanced_accuracy", "tail_accuracy", "accuracy"), baseline="imagenet-lite0"), ""]
        missing += lost
    if missing:
        missing = list(dict.fromkeys(missing))  # a pre-training several cells share is named once
        report += [f"not finished ({len(missing)} jobs, left out of the tables): {', '.join(missing)}"]
    print("\n".join(report))
    return report


def results_file_for_plot(args: argparse.Namespace) -> Path:
    results_file = Path(args.results)
    results_file.parent.mkdir(parents=True, exist_ok=True)
    return results_file.with_name(f"{results_file.stem}-label-efficiency.png")


def set_budget(args: argparse.Namespace) -> None:
    """The CPU budget of this invocation (a smoke run shrinks it; use another --out, as job names omit it)."""
    if args.pretrain_rounds <= TOKENIZER_ROUNDS:
        raise SystemExit(f"--pretrain-rounds must exceed Fed-BEiT's {TOKENIZER_ROUNDS} tokenizer rounds")
    PRETRAIN.update(rounds=args.pretrain_rounds, max_steps=args.max_steps)
    FINETUNE.update(rounds=args.finetune_rounds, max_steps=args.max_steps)
    FEDMAS["rounds"] = args.fedmas_rounds
    MAE_ARGS.update(parse_options(args.mae_arg))


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings -> options, each value read as JSON (false, 0.3) or else kept as text."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--mae-arg takes KEY=VALUE, got '{pair}'")
        options[key] = parse_value(value)
    return options


def _merge(old: list[dict[str, Any]], new: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows of ``old`` not redone, plus ``new`` (a rerun of a cell replaces it)."""
    redone = {tuple(row[k] for k in keys) for row in new}
    return [row for row in old if tuple(row[k] for k in keys) not in redone] + new


if __name__ == "__main__":
    main()
