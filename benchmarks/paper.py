"""Each seed method with its ``--preset paper`` against its main baseline on the MedMNIST sets, 3 seeds (issue 28).

Every arm of a method takes that method's paper preset (``medflare.methods.<method>.paper``): a baseline takes the
preset's shared settings (model, resolution, rounds, clients, training) and keeps its own hyperparameters, exactly
as ``medflare compare <method> <baseline> --preset paper`` does. On top of the preset the benchmark fixes what the
paper's data decide (the MedMNIST set, the simulated split, label noise, identified classes) and, where the paper's
budget would not fit about 40 GPU-minutes per method, fewer rounds; each plan says what it cut.

  fedmas    Fed-MAS vs BSM-FL          RetinaMNIST, Dirichlet(0.5) over 8 sites, 50 of the paper's 200 rounds
  mdhfl     MDH-FL vs FedMD            RetinaMNIST, 20 % public, pair-flip noise 0.2, Dirichlet(0.5), 4 sites
  fed-mae   Fed-MAE vs scratch         RetinaMNIST, Dirichlet(0.5), 5 sites, 200 pre-training + 50 fine-tuning
  fed-beit  Fed-BEiT vs scratch        the same, 10 dVAE rounds first; scratch = the same recipe, no pre-training
  fedlsm    FedLSM vs FedAvg, FedRS    RetinaMNIST, 5 sites annotating 2-3 grades, 20 of 50 rounds, pools scaled
  fca       FCA vs BSM-FL, FedRep      RetinaMNIST, Dirichlet(0.5) over 6 sites, 80 rounds, per-site test slices

Without CUDA it refuses (``--allow-cpu`` runs anyway) with an estimate measured here: a few real optimizer steps of
each arm's model at the preset's resolution and batch (on CPU at a small probe batch, one thread, scaled to the
batch), times the plan's optimizer steps. The estimate counts training steps only; evaluation, Fed-MAS's prior and
FLARE's round overhead come on top.

Usage:
    python benchmarks/paper.py [--methods fedmas fca ...] [--seeds 0 1 2] [--dry-run] [--allow-cpu] [--out DIR]

A run that already finished in --out with the same configuration is reused; results land in
``<out>/<method>/results.{json,md}`` and ``<out>/results.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarking import cpu_model, mean_std, run_cell, versus

from medflare.errors import ConfigError
from medflare.methods.presets import PAPER
from medflare.plan import preset_layer, task_of, validated
from medflare.registry import get_method
from medflare.run_config import RunConfig, merge_run_config

MEDMNIST = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist"
GPU_MINUTES_PER_METHOD = 40  # the budget for one method's arms and seeds on one modern GPU
IDENTIFIED_RETINA = [[0, 1], [1, 2, 3], [3, 4], [0, 2, 4], [2, 3]]  # as benchmarks/fedlsm.py: 2-3 grades per site
METRICS = ("balanced_accuracy", "accuracy", "auc_macro_ovr")
CPU_PROBE_BATCH = 2  # images per measured CPU step (scaled to the batch: a full ViT-B batch takes minutes on CPU)


@dataclass(frozen=True)
class Arm:
    """One compared configuration: a method, its own options on top of the preset, and its rounds if they differ."""

    name: str
    method: str
    method_args: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    rounds: int | None = None


@dataclass(frozen=True)
class Plan:
    """One seed method's benchmark: its data, the budget it keeps or cuts, and its arms (the method first)."""

    method: str
    dataset: str
    data: dict[str, Any]
    arms: tuple[Arm, ...]
    cut: str  # what this benchmark changes from the preset, besides the data
    rounds: int | None = None
    method_args: dict[str, Any] = field(default_factory=dict)

    @property
    def baselines(self) -> list[str]:
        return [arm.name for arm in self.arms[1:]]


# FedLSM's pools at the paper's share of an ISIC2018 site (50 / 200 of ~1,400 images): RetinaMNIST sites hold ~216
FEDLSM_POOLS = {"uncertain_pool": round(50 / 1400, 4), "confident_pool": round(200 / 1400, 4)}
FEDLSM_ITERATIONS = 30  # the preset's T; the baselines take as many optimizer steps per round
SSL_BUDGET = {"pretrain_rounds": 200, "finetune_rounds": 50}

PLANS = {
    "fedmas": Plan(
        "fedmas", "retinamnist", {"partition": "dirichlet:0.5"},
        (Arm("fedmas", "fedmas"), Arm("bsm-fl", "bsm-fl")),
        cut="50 of the paper's 200 rounds (10 local epochs each, cosine over the 50)", rounds=50,
    ),
    "mdhfl": Plan(
        "mdhfl", "retinamnist",
        {"partition": "dirichlet:0.5", "public_fraction": 0.2, "label_noise": 0.2, "noise_kind": "pairflip"},
        (Arm("mdhfl", "mdhfl"), Arm("fedmd", "fedmd", {"chunks": 8})),
        cut="nothing beyond the data: the paper's 40 rounds (the public set is 20 % of RetinaMNIST's training split)",
    ),
    "fed-mae": Plan(
        "fed-mae", "retinamnist", {"partition": "dirichlet:0.5"},
        (Arm("fed-mae", "fed-mae"), Arm("scratch", "fed-mae", {"pretrain_rounds": 0}, rounds=SSL_BUDGET["finetune_rounds"])),
        cut="200 of 1600 pre-training rounds and 50 of 100 fine-tuning rounds", rounds=sum(SSL_BUDGET.values()),
        method_args=SSL_BUDGET,
    ),
    "fed-beit": Plan(
        "fed-beit", "retinamnist", {"partition": "dirichlet:0.5"},
        (Arm("fed-beit", "fed-beit"),
         Arm("scratch", "fed-beit", {"tokenizer_rounds": 0, "pretrain_rounds": 0}, rounds=SSL_BUDGET["finetune_rounds"])),
        cut="10 dVAE rounds, 200 of 1000 pre-training rounds and 50 of 100 fine-tuning rounds",
        rounds=10 + sum(SSL_BUDGET.values()), method_args={**SSL_BUDGET, "tokenizer_rounds": 10},
    ),
    "fedlsm": Plan(
        "fedlsm", "retinamnist", {"partition": "iid", "identified": IDENTIFIED_RETINA},
        (Arm("fedlsm", "fedlsm"),
         Arm("fedavg", "fedavg", train={"local_epochs": 50, "max_steps": FEDLSM_ITERATIONS}),
         Arm("fedrs", "fedrs", {"loss": "ce"}, train={"local_epochs": 50, "max_steps": FEDLSM_ITERATIONS})),
        cut="20 of 50 rounds; pools at the paper's share of a site (3.6 % / 14.3 %: 50 / 200 of ~1,400 images)",
        rounds=20, method_args=FEDLSM_POOLS,
    ),
    "fca": Plan(
        "fca", "retinamnist", {"partition": "dirichlet:0.5"},
        (Arm("fca", "fca"), Arm("bsm-fl", "bsm-fl", {"eps": 1e-9}), Arm("fedrep", "fedrep")),
        cut="nothing beyond the data: the paper's 80 rounds, 1 epoch each",
    ),
}


def dataset_path(dataset: str) -> Path:
    """The MD5-checked MedMNIST file; SystemExit with one line when ../shared/data is absent."""
    from medflare.data.checksums import verify_medmnist_file

    path = MEDMNIST / f"{dataset}.npz"
    if not path.is_file():
        raise SystemExit(f"bench-paper needs {path} (../shared/data of a developer machine); it is not here")
    verify_medmnist_file(path)
    return path


def arm_config(plan: Plan, arm: Arm, seed: int, *layers: Mapping[str, Any]) -> RunConfig:
    """An arm's run: the seed method's paper preset (a baseline: its shared part), the data, the plan's budget, then
    ``layers`` on top (``paper_lease.py`` puts the networks at the data's own resolution there)."""
    own = arm.method == plan.method
    layer = {
        "method": arm.method, "seed": seed, "name": f"{re.sub(r'[^a-z0-9]+', '-', arm.name)}-s{seed}",
        "site_evaluation": "final",
        "data": {"source": f"medmnist:{dataset_path(plan.dataset)}", **plan.data},
        "rounds": arm.rounds or plan.rounds,
        "method_args": {**(plan.method_args if own else {}), **arm.method_args},
        "train": dict(arm.train),
    }
    if plan.method == "fedlsm" and own:
        layer["method_args"]["local_iterations"] = FEDLSM_ITERATIONS
    return merge_run_config(preset_layer(PAPER, arm.method, lead=plan.method), layer, *layers)


# ----- the estimate ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepKey:
    """What one optimizer step's cost depends on."""

    model: str
    batch: int
    channels: int
    image_size: int
    num_classes: int


def planned_steps(run: RunConfig) -> dict[StepKey, int]:
    """Optimizer steps the run's sites take, by what a step costs: per site and round, local epochs x full
    batches (capped by max_steps), FedLSM's T iterations, MDH-FL/FedMD's local epochs plus one KL step per
    public batch; SSL-FL stage by stage with each stage's batch."""
    from medflare.plan import describe_sites, resolve
    from medflare.site_config import resolve_train_config

    spec, task = get_method(run.method), task_of(run)
    sites, _ = describe_sites(resolve(run, "byoc", task=task))
    cfg = spec.config_cls(**run.method_args)
    stages = cfg.stage_plan(run.rounds) if hasattr(cfg, "stage_plan") else []
    stage_rounds = [(s.name, s.rounds) for s in stages] or [(None, run.rounds)]
    n_private = sum(facts["n_train"] for facts in sites.values())
    public_fraction = float(run.data.get("public_fraction") or 0)
    n_public = round(n_private * public_fraction / (1 - public_fraction)) if public_fraction else 0
    steps: dict[StepKey, int] = {}
    for site, facts in sites.items():
        model = run.site_model.get(site, run.model)
        for stage, rounds in stage_rounds:
            train = resolve_train_config(spec, run.train).for_stage(stage)
            n, batch = facts["n_train"], train.batch_size
            batches = n // batch if n > batch else 1
            per_round = train.local_epochs * batches
            if run.method == "fedlsm" and cfg.local_iterations:
                per_round = cfg.local_iterations
            elif run.method in ("mdhfl", "fedmd"):
                rows = cfg.public_per_round or n_public
                epochs = cfg.local_epochs or max(n_public // max(n, 1), 1)
                per_round = epochs * batches + (math.ceil(rows / batch) if cfg.distill else 0)
            if train.max_steps and run.method not in ("mdhfl", "fedmd", "fedlsm"):
                per_round = min(per_round, train.max_steps)
            key = StepKey(model, batch, task.in_channels, task.image_size, task.num_classes)
            steps[key] = steps.get(key, 0) + per_round * rounds
    return steps


def measure_step_seconds(key: StepKey, device: str, steps: int = 2) -> float:
    """Seconds of one real optimizer step (forward, cross-entropy, backward, Adam) of ``key`` here.

    On CUDA at the full batch under autocast, the model placed as a site places it (channels_last); on CPU with
    one thread (a simulated site's share) at :data:`CPU_PROBE_BATCH` images, scaled linearly to the batch. One
    warm-up step is not timed.
    """
    import torch

    from medflare.models import create_model, place_model

    threads = torch.get_num_threads()
    probe = key.batch if device == "cuda" else min(key.batch, CPU_PROBE_BATCH)
    try:
        if device == "cpu":
            torch.set_num_threads(1)
        model = place_model(create_model(key.model, key.num_classes, key.channels, image_size=key.image_size),
                            device).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        images = torch.randn(probe, key.channels, key.image_size, key.image_size, device=device)
        labels = torch.randint(0, key.num_classes, (probe,), device=device)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type=device, enabled=device == "cuda"):
                loss = torch.nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            if device == "cuda":
                torch.cuda.synchronize()

        step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = (time.perf_counter() - start) / steps
    finally:
        torch.set_num_threads(threads)
    return seconds * key.batch / probe


@dataclass
class Estimate:
    """Planned steps and their measured cost, per method."""

    steps: dict[str, dict[StepKey, int]]
    seconds_per_step: dict[StepKey, float]

    def method_seconds(self, method: str) -> float:
        return sum(n * self.seconds_per_step[key] for key, n in self.steps[method].items())

    @property
    def total_seconds(self) -> float:
        return sum(self.method_seconds(method) for method in self.steps)

    def measured(self) -> str:
        return ", ".join(f"{s:.3g} s/step for {k.model} at {k.image_size} px, batch {k.batch}"
                         for k, s in sorted(self.seconds_per_step.items(), key=lambda item: item[0].model))


def estimate(runs: dict[str, list[RunConfig]], device: str,
             measure: Callable[[StepKey, str], float] | None = None) -> Estimate:
    """The plan's optimizer steps per method and each step kind's time measured on ``device``."""
    measure = measure or measure_step_seconds
    steps: dict[str, dict[StepKey, int]] = {}
    for method, method_runs in runs.items():
        totals: dict[StepKey, int] = {}
        for run in method_runs:
            for key, n in planned_steps(run).items():
                totals[key] = totals.get(key, 0) + n
        steps[method] = totals
    keys = {key for totals in steps.values() for key in totals}
    if device == "cuda":
        return Estimate(steps, {key: measure(key, device) for key in sorted(keys, key=repr)})
    # CPU: one probe per network and input (a step's time is linear in the batch there), scaled to each batch
    probes = {replace(key, batch=CPU_PROBE_BATCH) for key in keys}
    probed = {probe: measure(probe, device) for probe in sorted(probes, key=repr)}
    return Estimate(steps, {key: probed[replace(key, batch=CPU_PROBE_BATCH)] * key.batch / CPU_PROBE_BATCH
                            for key in keys})


def refusal(est: Estimate) -> str:
    """The one line bench-paper prints on a machine without CUDA."""
    return (f"bench-paper needs a GPU: estimated {est.total_seconds / 3600:.1f} CPU-hours here (measured "
            f"{est.measured()}); run it where CUDA is available, or pass --allow-cpu")


# ----- plan, run, report -------------------------------------------------------------------------------------
def build_runs(methods: list[str], seeds: list[int]) -> dict[str, list[RunConfig]]:
    """Every method's validated runs (arms x seeds), before anything starts."""
    runs: dict[str, list[RunConfig]] = {}
    for method in methods:
        plan = PLANS[method]
        runs[method] = []
        for arm in plan.arms:
            for seed in seeds:
                run = arm_config(plan, arm, seed)
                run = validated(run)
                runs[method].append(run)
    return runs


def plan_lines(methods: list[str], seeds: list[int], est: Estimate | None = None, device: str = "") -> list[str]:
    """The plan: each seed method with its baselines, data, what the benchmark cuts, and the estimate."""
    lines = [f"bench-paper plan: {len(methods)} methods x their arms x seeds {seeds}"]
    for method in methods:
        plan = PLANS[method]
        lines.append(f"  {method} vs {', '.join(plan.baselines)}: {plan.dataset} {plan.data}; {plan.cut}")
        if est is not None:
            steps = sum(est.steps[method].values())
            lines.append(f"    {steps} optimizer steps, estimated {est.method_seconds(method) / 60:.1f} min on {device}")
    if est is not None:
        lines.append(f"  measured on {device}: {est.measured()}")
        lines.append(f"  estimated total {est.total_seconds / 3600:.2f} h of training steps (evaluation, the Fed-MAS "
                     "prior and FLARE overhead on top)")
    return lines


def arm_rows(plan: Plan, summaries: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """mean ± std per arm and metric, and each baseline's gap read by the one-std rule."""
    table: dict[str, Any] = {}
    for arm in plan.arms:
        finals = [s["final"] for s in summaries[arm.name]]
        table[arm.name] = {m: mean_std([f[m] for f in finals if f.get(m) is not None]) for m in METRICS}
    method_values = [s["final"]["balanced_accuracy"] for s in summaries[plan.arms[0].name]]
    gaps = {b: versus(method_values, [s["final"]["balanced_accuracy"] for s in summaries[b]]) for b in plan.baselines}
    return {"table": table, "versus": gaps}


def report_lines(plan: Plan, result: dict[str, Any], seeds: list[int], device: str) -> list[str]:
    lines = [f"### {plan.method} (--preset paper) vs {', '.join(plan.baselines)}", "",
             f"{plan.dataset}, {plan.data}, seeds {seeds}, on {device}; {plan.cut}.", "",
             "| arm | " + " | ".join(METRICS) + " |", "|---|" + "---|" * len(METRICS)]
    for name, stats in result["table"].items():
        cells = ["—" if v is None else f"{v[0]:.4f} ± {v[1]:.4f}" for v in stats.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"{plan.method} minus baseline, balanced accuracy (within one std = no difference): "
              + "; ".join(f"{b}: {gap}" for b, gap in result["versus"].items()), ""]
    return lines


def device_name() -> tuple[str, str]:
    """("cuda" | "cpu", a name for the report)."""
    import torch

    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name(0)
    return "cpu", f"{cpu_model()} (no CUDA)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=sorted(PLANS), default=list(PLANS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the measured estimate; run nothing")
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA (the estimate says how long)")
    parser.add_argument("--out", default="runs/bench-paper")
    parser.add_argument("--fresh", action="store_true", help="redo runs that already finished in --out")
    args = parser.parse_args(argv)
    try:
        runs = build_runs(args.methods, args.seeds)
    except ConfigError as exc:
        print(f"bench-paper: error: {exc}", file=sys.stderr)
        return 2
    device, name = device_name()
    est = estimate(runs, device)
    if args.dry_run:
        print("\n".join(plan_lines(args.methods, args.seeds, est, name)))
        return 0
    if device != "cuda" and not args.allow_cpu:
        print(refusal(est), file=sys.stderr)
        return 2
    print("\n".join(plan_lines(args.methods, args.seeds, est, name)), flush=True)
    over = [m for m in args.methods if est.method_seconds(m) > GPU_MINUTES_PER_METHOD * 60]
    if device == "cuda" and over:
        print(f"bench-paper: note: {', '.join(over)} estimated above {GPU_MINUTES_PER_METHOD} min on {name}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = [f"# Paper presets: each seed method vs its main baseline ({name})", ""]
    started = time.time()
    for method in args.methods:
        plan, method_start = PLANS[method], time.time()
        summaries: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in plan.arms}
        for arm in plan.arms:
            for seed in args.seeds:
                run = arm_config(plan, arm, seed)
                run = validated(run)
                print(f"[{time.time() - started:6.0f}s] {method}: {arm.name} seed {seed} ...", flush=True)
                summary, _ = run_cell(run, out / method / f"{re.sub(r'[^a-z0-9]+', '-', arm.name)}-seed{seed}",
                                      reuse=not args.fresh)
                summaries[arm.name].append(summary)
        result = arm_rows(plan, summaries)
        result.update(minutes=(time.time() - method_start) / 60, device=name, seeds=args.seeds,
                      estimated_minutes=est.method_seconds(method) / 60)
        lines = report_lines(plan, result, args.seeds, name)
        lines.append(f"Wall time {result['minutes']:.1f} min (estimated training steps {result['estimated_minutes']:.1f} min).")
        (out / method).mkdir(parents=True, exist_ok=True)
        (out / method / "results.json").write_text(json.dumps(result, indent=1, default=str))
        (out / method / "results.md").write_text("\n".join(lines) + "\n")
        report += lines + [""]
        print("\n".join(lines), flush=True)
    (out / "results.md").write_text("\n".join(report))
    return 0


if __name__ == "__main__":
    from medflare.console.processes import stop_on_signals

    with stop_on_signals():
        sys.exit(main())
