"""The lease-sized paper pack (issue 51, item 1): every seed method against its paper's baselines, at the MedMNIST
files' own 28 px, within one 10-minute lease of one H100/H200, start-up included.

Each method takes bench-paper's plan (``paper.py``: the arms, the data, the paper preset of every arm) with the
paper's rounds, local epochs, optimizer, schedule and batch, and puts its networks at 28 px as follows:

  fedmas    torchvision ResNet-18 as registered (ImageNet stem: a 28-px image is a 7x7 map after the stem and
            max-pool); the frozen ImageNet prior (EfficientNet-Lite0) still sees 224 px, the size its weights know
  mdhfl     the paper's CIFAR-style ResNet-10/12 (3x3 stride-1 stem, no max-pool, as its code for 32-px images);
            ShuffleNetV2 and MobileNetV2 as registered (ImageNet stems)
  fed-mae   ViT-B with 4-px patches (7x7 grid, 49 tokens; the paper's 16-px patches give 14x14 at 224 px)
  fed-beit  the same ViT-B; the dVAE tokenizer codes one 4-px patch per token
  fedlsm    torchvision DenseNet-121 as registered (ImageNet stem; ceil-mode transition pools reach the last block)
  fca       torchvision EfficientNet-B0 as registered (ImageNet stem)

No CIFAR-stem ResNet-18, DenseNet-121 or EfficientNet-B0 is registered: with a stride-1 stem and no max-pool every
later map has 16 times the pixels (DenseNet-121's step counts 13 times the FLOPs), more than a lease holds at the
papers' rounds. Where the budget still does not fit 10 minutes the pack runs fewer rounds (:data:`LEASE_ROUNDS`),
and the plan prints each cut: Fed-MAS 50 of 200 rounds (its 224-px prior runs on every step), SSL-FL's pre-training
100 of 1,600 (Fed-MAE) and 100 of 1,000 (Fed-BEiT) rounds.

Every arm runs as its own OS process on the one GPU, through ``inprocess.run_rounds`` on the arm's plan (the same
RunPlan, site runtime and round core as a FLARE job; FLARE itself is not started). Seed 0 runs first; further
seeds only with ``--seeds``. A job saves its global model, its round and every site's trainer state (what
``SiteRuntime`` keeps in its state file) under ``--out`` after the first round that ends ``--checkpoint-seconds``
after the last save, and after its last round; a rerun skips finished arms and resumes the others from their last save. Each finished arm appends one row
(device, commit, seed, metrics, wall time) to ``benchmarks/results/paper_lease.md``.

``--dry-run`` prints the plan, this machine's measured time per step of every arm's network, and the H100 cost
model (:class:`CostModel`): FLOPs and dispatched operations of a real step counted with FlopCounterMode on the
"meta" device (shapes only, nothing computed), turned into seconds by the stated rates below.

Usage:
    python benchmarks/paper_lease.py [--methods fca ...] [--seeds 0 1] [--dry-run] [--out DIR] [--parallel N]
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarking import cpu_model, run_fingerprint
from paper import (
    CPU_PROBE_BATCH,
    METRICS,
    PLANS,
    Arm,
    Plan,
    StepKey,
    arm_config,
    device_name,
    measure_step_seconds,
    planned_steps,
)

from medflare.errors import ConfigError
from medflare.methods.presets import PAPER
from medflare.plan import validated
from medflare.registry import get_method
from medflare.run_config import RunConfig

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "paper_lease.md"
IMAGE_SIZE = 28  # MedMNIST's own resolution
LEASE_SECONDS = 600
PAPER_METHODS = list(PLANS)

# The pack's rounds: the paper's unless the lease cannot hold them (each cut is printed with the plan). Fed-MAS's
# ImageNet prior at 224 px on every step and SSL-FL's ViT-B rounds (5 sites' parameters through the host each) are
# what the H100 estimate cannot fit at the papers' 200 / 1,600 / 1,000 rounds.
LEASE_ROUNDS: dict[str, dict[str, int]] = {
    "fedmas": {"rounds": 50},
    "mdhfl": {"rounds": 40},
    "fed-mae": {"pretrain_rounds": 100, "finetune_rounds": 100},
    "fed-beit": {"tokenizer_rounds": 20, "pretrain_rounds": 100, "finetune_rounds": 100},
    "fedlsm": {"rounds": 50},
    "fca": {"rounds": 80},
}
STAGE_KEYS = ("tokenizer_rounds", "pretrain_rounds", "finetune_rounds")


# ----- the plan -------------------------------------------------------------------------------------------
def paper_budget(method: str) -> dict[str, int]:
    """The paper preset's rounds (SSL-FL: per stage), the numbers :data:`LEASE_ROUNDS` is read against."""
    overrides = get_method(method).presets[PAPER].overrides
    staged = {key: overrides["method_args"][key] for key in STAGE_KEYS if key in overrides["method_args"]}
    return staged or {"rounds": overrides["rounds"]}


def cut_line(method: str) -> str:
    """What the pack keeps of the paper's rounds, e.g. '200 of 1600 pretrain rounds, 100 of 100 finetune rounds'."""
    paper, lease = paper_budget(method), LEASE_ROUNDS[method]
    parts = [f"{lease[key]} of the paper's {paper[key]} {key.replace('_rounds', ' ').replace('rounds', '')}rounds"
             for key in lease]
    kept = all(lease[key] == paper[key] for key in lease)
    return ("the paper's budget, uncut: " if kept else "CUT to fit the lease: ") + ", ".join(parts)


def lease_plan(method: str) -> Plan:
    """bench-paper's plan of ``method`` with the pack's rounds (a scratch arm: the fine-tuning rounds alone)."""
    plan, rounds = PLANS[method], LEASE_ROUNDS[method]
    if "rounds" in rounds:
        return replace(plan, rounds=rounds["rounds"], cut=cut_line(method))
    arms = tuple(replace(arm, rounds=rounds["finetune_rounds"]) if arm.rounds else arm for arm in plan.arms)
    return replace(plan, arms=arms, rounds=sum(rounds.values()), method_args={**plan.method_args, **rounds},
                   cut=cut_line(method))


@dataclass(frozen=True)
class Tiny:
    """Overrides for a smoke run (tests): fewer rounds and capped local steps; the default changes nothing."""

    rounds: int = 0
    max_steps: int = 0
    sites: int = 0

    def layer(self) -> dict[str, Any]:
        layer: dict[str, Any] = {"rounds": self.rounds or None, "clients": self.sites or None}
        if self.max_steps:
            layer["train"] = {"max_steps": self.max_steps}
        return layer


def lease_run(method: str, arm: Arm, seed: int, tiny: Tiny = Tiny()) -> RunConfig:
    """The arm's run at 28 px, validated."""
    plan = lease_plan(method)
    run = arm_config(plan, arm, seed, {"data": {"image_size": IMAGE_SIZE}}, tiny.layer())
    run = validated(run)
    return run


def arms_of(methods: list[str], names: list[str] | None) -> list[tuple[str, Arm]]:
    """(method, arm) of every arm of ``methods`` (only those named in ``names``, when given)."""
    return [(method, arm) for method in methods for arm in lease_plan(method).arms if not names or arm.name in names]


# ----- the estimate ----------------------------------------------------------------------------------------
H100_STEPS = REPO / "benchmarks" / "results" / "paper_plan_h100.txt"  # bench-paper's steps timed on an H100 lease
# networks without a timed step of their own take a timed one's rate: Lite0 is EfficientNet-B0 without
# squeeze-excitation (depthwise convolutions, as memory-bound)
RATE_STAND_INS = {"efficientnet_lite0": "efficientnet_b0"}
BACKWARD_FACTOR = 3  # a training step = forward + backward (about twice the forward's FLOPs)


@dataclass(frozen=True)
class StepCount:
    """One step counted on the meta device: FLOPs, dispatched aten operations (each about one kernel launch) and
    the network's parameter bytes. FLOPs are FlopCounterMode's count of the forward (2 per multiply-add), times
    :data:`BACKWARD_FACTOR` for a training step: its convolution-backward formula overcounts grouped (depthwise)
    convolutions about tenfold (EfficientNet-B0)."""

    flops: float
    ops: int
    param_bytes: int = 0

    def __add__(self, other: StepCount) -> StepCount:
        return StepCount(self.flops + other.flops, self.ops + other.ops, self.param_bytes + other.param_bytes)


def count_step(key: StepKey, train: bool = True) -> StepCount:
    """A real step of ``key``'s network at its batch on the meta device (shapes only): forward, cross-entropy,
    backward and a foreach Adam step (``train``), or a forward alone (a frozen prior or teacher)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from medflare.models import create_model

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops += 1
            return func(*args, **(kwargs or {}))

    with torch.device("meta"):
        model = create_model(key.model, key.num_classes, key.channels, image_size=key.image_size).train(train)
        images = torch.randn(key.batch, key.channels, key.image_size, key.image_size)
        labels = torch.randint(0, key.num_classes, (key.batch,))
        optimizer = torch.optim.Adam(model.parameters(), foreach=True) if train else None
    flops, ops = FlopCounterMode(display=False), CountOps()
    with ops, torch.set_grad_enabled(train):
        with flops:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        if optimizer is not None:
            loss.backward()
            optimizer.step()
    factor = BACKWARD_FACTOR if train else 1
    return StepCount(float(flops.get_total_flops() * factor), ops.ops, sum(p.numel() * 4 for p in model.parameters()))


def timed_steps(path: Path = H100_STEPS) -> dict[StepKey, float]:
    """bench-paper's training steps timed on an H100 (its dry run's 'measured on' line): key -> seconds."""
    text = path.read_text() if path.is_file() else ""
    found = re.findall(r"([\d.]+) s/step for (\w+) at (\d+) px, batch (\d+)", text)
    # bench-paper's RetinaMNIST plans: 3 channels, 5 classes
    return {StepKey(model, int(batch), 3, int(size), 5): float(seconds) for seconds, model, size, batch in found}


def calibrated_rates(path: Path = H100_STEPS) -> dict[str, float]:
    """Sustained FLOP/s per network on an H100: its timed step's counted FLOPs over its time (the best of its
    timed batches). The timed steps ran at 224-288 px; a 28-px step has smaller maps and fewer tokens, so these
    rates are the most it can reach."""
    rates: dict[str, float] = {}
    for key, seconds in timed_steps(path).items():
        rates[key.model] = max(rates.get(key.model, 0.0), count_step(key).flops / seconds)
    if not rates:
        raise SystemExit(f"bench-paper-lease: {path} holds no timed H100 steps; the estimate is calibrated on them")
    return rates


def extra_forwards(run: RunConfig, key: StepKey) -> list[StepKey]:
    """Forward-only networks a method runs on every step beside the one it trains: Fed-MAS's prior at its input
    size, FedLSM's EMA teacher (the same network)."""
    if run.method == "fedmas":
        cfg = get_method("fedmas").config_cls(**run.method_args)
        prior = "efficientnet_lite0" if cfg.prior == "imagenet-lite0" else cfg.prior_model  # else a local checkpoint
        return [replace(key, model=prior, image_size=cfg.prior_input_size)]
    if run.method == "fedlsm":
        return [key]
    return []


@dataclass(frozen=True)
class CostModel:
    """Seconds on one H100 of the pack's arms, each its own process on the one GPU. The stated assumptions:

    * compute: a step's FLOPs at its network's sustained rate (:func:`calibrated_rates`: bench-paper's steps timed
      on an H100 over their counted FLOPs), the lowest timed rate for a network without one;
    * launch: eager PyTorch's host cost of each dispatched operation (``launch_s``), and the least GPU time of a
      kernel (``kernel_s``);
    * a round in the in-process loop moves every site's parameters through the host ``host_passes`` times (to the
      host, checked, aggregated, back) at ``host_bytes_per_s``;
    * the arms' processes share the GPU by time-slicing (no MPS): their GPU work adds up, only host work overlaps;
    * ``startup_s``: the processes' start, imports, CUDA context, data and models (in parallel), the wheels' install.

    Optimistic where a step runs outside autocast (the timed steps ran under it): Fed-MAS's prior runs in fp32
    (``prior_precision``), and evaluation is not counted (once per arm, a few hundred 28-px images).
    """

    rates: Mapping[str, float]
    launch_s: float = 6e-6
    kernel_s: float = 2e-6
    host_passes: int = 4
    host_bytes_per_s: float = 4e9
    startup_s: float = 60.0
    overlap: int = 1  # GPU work of the arms' processes that runs at once (time-slicing: one)

    def rate(self, model: str) -> float:
        model = RATE_STAND_INS.get(model, model)
        return self.rates.get(model) or min(self.rates.values())

    def describe(self) -> str:
        rates = ", ".join(f"{m} {r / 1e12:.1f}" for m, r in sorted(self.rates.items()))
        return (f"TFLOP/s from {H100_STEPS.name}: {rates}; {self.launch_s * 1e6:g} us host and "
                f"{self.kernel_s * 1e6:g} us GPU per operation; {self.host_passes} host passes of each site's "
                f"parameters a round at {self.host_bytes_per_s / 1e9:g} GB/s; {self.startup_s:g} s start-up; the "
                f"arms' GPU work serialised (overlap {self.overlap})")

    def step(self, key: StepKey, count: StepCount, extras: tuple[tuple[StepKey, StepCount], ...] = ()
             ) -> tuple[float, float]:
        """(GPU seconds, the arm's own seconds) of one step and its extra forwards: compute or the kernels' floor
        on the GPU; the arm waits for the slower of its GPU work and its host's launches."""
        compute = count.flops / self.rate(key.model) + sum(c.flops / self.rate(k.model) for k, c in extras)
        ops = count.ops + sum(c.ops for _, c in extras)
        gpu = max(compute, ops * self.kernel_s)
        return gpu, max(gpu, ops * self.launch_s)

    def round_s(self, site_param_bytes: int) -> float:
        return self.host_passes * site_param_bytes / self.host_bytes_per_s


@dataclass
class ArmCost:
    """One arm's planned steps, its counted cost on the H100 model, and this machine's measured step times."""

    method: str
    arm: str
    steps: dict[StepKey, int]
    rounds: int
    gpu_s: float = 0.0
    own_s: float = 0.0
    measured_s: dict[StepKey, float] = field(default_factory=dict)

    @property
    def measured_total_s(self) -> float:
        return sum(n * self.measured_s[key] for key, n in self.steps.items())


def site_param_bytes(run: RunConfig, counts: Mapping[StepKey, StepCount]) -> int:
    """Parameter bytes of all of a round's sites (MDH-FL: each site its own network)."""
    from medflare.plan import describe_sites, resolve

    sizes = {key.model: count.param_bytes for key, count in counts.items()}
    sites, _ = describe_sites(resolve(run, "byoc"))
    return sum(sizes.get(run.site_model.get(site, run.model), 0) for site in sites)


def cost_arms(runs: dict[tuple[str, str], RunConfig], model: CostModel, measure_device: str = "cpu") -> list[ArmCost]:
    """Every arm's cost: each step kind counted once and measured once on ``measure_device``."""
    counts: dict[tuple[StepKey, bool], StepCount] = {}
    measured: dict[StepKey, float] = {}

    def counted(key: StepKey, train: bool = True) -> StepCount:
        if (key, train) not in counts:
            counts[(key, train)] = count_step(key, train)
        return counts[(key, train)]

    costs = []
    for (method, arm), run in runs.items():
        cost = ArmCost(method, arm, planned_steps(run), run.rounds)
        for key, n in cost.steps.items():
            if key not in measured:
                measured[key] = measure_step_seconds(key, measure_device)
            extras = tuple((k, counted(k, train=False)) for k in extra_forwards(run, key))
            gpu, own = model.step(key, counted(key), extras)
            cost.gpu_s += n * gpu
            cost.own_s += n * own
            cost.measured_s[key] = measured[key]
        cost.own_s += run.rounds * model.round_s(site_param_bytes(run, {k: c for (k, t), c in counts.items() if t}))
        costs.append(cost)
    return costs


def wall_seconds(costs: list[ArmCost], model: CostModel) -> tuple[float, float, float]:
    """(GPU-bound seconds, the longest arm's seconds, the lease's total): start-up, then the slower of the GPU's
    serialised work and the longest arm."""
    gpu = sum(c.gpu_s for c in costs) / model.overlap
    longest = max((c.own_s for c in costs), default=0.0)
    return gpu, longest, model.startup_s + max(gpu, longest)


def plan_lines(methods: list[str], runs: dict[tuple[str, str], RunConfig], costs: list[ArmCost], device: str,
               seeds: list[int], model: CostModel) -> list[str]:
    """The plan per method (arms, data, sites, rounds, epochs, batch, optimizer, steps) and the estimate."""
    by_arm = {(c.method, c.arm): c for c in costs}
    lines = [f"bench-paper-lease plan: {len(methods)} methods at {IMAGE_SIZE} px, seeds {seeds} (seed {seeds[0]} "
             f"first), every arm its own process on one GPU"]
    for method in methods:
        plan = lease_plan(method)
        lines.append(f"  {method} vs {', '.join(plan.baselines)}: {plan.dataset} {plan.data}; {plan.cut}")
        for (m, arm), run in runs.items():
            if m != method:
                continue
            train, cost = run.train, by_arm[(m, arm)]
            models = sorted({run.model, *run.site_model.values()})
            lines.append(
                f"    {arm}: {run.clients} sites, {run.rounds} rounds, {'/'.join(models)}, "
                f"{train.get('optimizer', 'adam')} lr {train.get('lr')} {train.get('lr_schedule', 'constant')}, "
                f"{train.get('local_epochs', 1)} local epochs, batch {train.get('batch_size')}"
                + (f", max {train['max_steps']} steps a round" if train.get("max_steps") else "")
                + (f", {run.method_args['local_iterations']} iterations a round"
                   if run.method_args.get("local_iterations") else "")
                + "".join(f"; {stage} stage batch {values.get('batch_size')} lr {values.get('lr')}"
                          for stage, values in train.get("stages", {}).items())
                + f"; {sum(cost.steps.values())} steps; H100 model {cost.own_s:.0f} s alone, {cost.gpu_s:.0f} s "
                f"of GPU; {device} {cost.measured_total_s / 60:.1f} min "
                f"({', '.join(f'{cost.measured_s[k] * 1e3:.0f} ms/step {k.model} b{k.batch}' for k in cost.steps)})")
    gpu, longest, total = wall_seconds(costs, model)
    lines += [f"  H100 cost model: {model.describe()}",
              f"  H100 estimate: GPU-bound {gpu:.0f} s, longest arm {longest:.0f} s, total {total:.0f} s "
              f"= {total / 60:.1f} min with start-up: {'<=' if total <= LEASE_SECONDS else 'ABOVE'} "
              f"{LEASE_SECONDS // 60} min",
              f"  measured here ({device}, training steps only): "
              f"{sum(c.measured_total_s for c in costs) / 3600:.2f} h of steps in all"]
    return lines


# ----- running an arm ------------------------------------------------------------------------------------
class Stopped(Exception):
    """--stop-after-rounds reached (the job's state is saved)."""


def arm_folder(out: Path, method: str, arm: str, seed: int) -> Path:
    return out / method / f"{re.sub(r'[^a-z0-9]+', '-', arm)}-s{seed}"


def git_commit() -> str:
    """The checkout's commit (``+dirty`` with local changes); a copy without .git says so, unless
    PAPER_LEASE_COMMIT names it (the lent machine's copy of the tree has no history)."""
    if os.environ.get("PAPER_LEASE_COMMIT"):
        return os.environ["PAPER_LEASE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return head + ("+dirty" if dirty else "")


RESULT_HEADER = ("| date (UTC) | device | commit | seed | method | arm | rounds | resumed at round | "
                 + " | ".join(METRICS) + " | wall min |\n|" + "---|" * (9 + len(METRICS)) + "\n")


def append_row(results: Path, row: dict[str, Any]) -> None:
    """One finished arm's row, under a lock (the arms' processes finish independently)."""
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        if not handle.read():
            handle.write("# Lease-sized paper pack (make bench-paper-lease): one row per finished arm\n\n"
                         "Simulated splits of MedMNIST v2 (Yang et al., Scientific Data 2023; RetinaMNIST from "
                         "DeepDRiD, CC BY 4.0) at 28 px; test-split metrics pooled over the sites.\n\n"
                         + RESULT_HEADER)
        cells = [row["date"], row["device"], row["commit"], row["seed"], row["method"], row["arm"], row["rounds"],
                 row["resumed_at"], *(f"{row['metrics'].get(m, float('nan')):.4f}" for m in METRICS),
                 f"{row['wall_s'] / 60:.1f}"]
        handle.write("| " + " | ".join(str(c) for c in cells) + " |\n")


def save_state(folder: Path, sites: Any, rounds_done: int, params: dict, fingerprint: str, wall_s: float) -> None:
    """The job after ``rounds_done`` rounds: the global model and round, and each site's trainer state in the
    site's own folder, under SiteRuntime's state-file name; each file replaced whole."""
    import torch

    from medflare.site_runtime import SITE_STATE_FILE

    for name, runtime in sites.sites.items():
        path = folder / "sites" / name / SITE_STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(runtime.trainer.state_dict(), path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    state = {"rounds_done": rounds_done, "params": params, "fingerprint": fingerprint, "wall_s": wall_s}
    torch.save(state, folder / "checkpoint.tmp")
    os.replace(folder / "checkpoint.tmp", folder / "checkpoint.pt")


def restore_sites(folder: Path, sites: Any) -> None:
    import torch

    from medflare.site_runtime import SITE_STATE_FILE

    for name, runtime in sites.sites.items():
        path = folder / "sites" / name / SITE_STATE_FILE
        if path.is_file():
            runtime.trainer.load_state(torch.load(path, map_location=runtime.device, weights_only=False))


@dataclass(frozen=True)
class RunOptions:
    out: Path
    results: Path
    tiny: Tiny = Tiny()
    stop_after_rounds: int = 0
    checkpoint_seconds: float = 60.0


def run_arm(method: str, arm: Arm, seed: int, opts: RunOptions, log: Any = print) -> str:
    """One arm's job through the in-process loop, resumed from its last save; 'finished', 'skipped' (finished
    before) or 'stopped' (--stop-after-rounds)."""
    import torch
    from inprocess import RoundDone, final_summary, run_rounds

    run = lease_run(method, arm, seed, opts.tiny)
    folder, fingerprint = arm_folder(opts.out, method, arm.name, seed), run_fingerprint(run)
    folder.mkdir(parents=True, exist_ok=True)
    result_file = folder / "result.json"
    if result_file.is_file() and json.loads(result_file.read_text()).get("fingerprint") == fingerprint:
        log(f"{method}/{arm.name} seed {seed}: finished before, skipped")
        return "skipped"
    saved = None
    if (folder / "checkpoint.pt").is_file():
        saved = torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=False)
        if saved["fingerprint"] != fingerprint:
            log(f"{method}/{arm.name} seed {seed}: the saved job is another configuration; starting afresh")
            saved = None
    resumed_at = saved["rounds_done"] if saved else 0
    wall_before, started = (saved["wall_s"] if saved else 0.0), time.perf_counter()
    held: dict[str, Any] = {}
    last_save = [time.perf_counter()]
    trained: list[int] = []

    def on_sites(sites: Any) -> None:
        held["sites"] = sites
        if saved:
            restore_sites(folder, sites)
            log(f"{method}/{arm.name} seed {seed}: resumed after round {resumed_at} of {run.rounds}")

    def on_round(done: RoundDone) -> None:
        rounds_done = done.plan.round + 1
        trained.append(done.plan.round)
        stop = opts.stop_after_rounds and rounds_done >= opts.stop_after_rounds
        due = time.perf_counter() - last_save[0] >= opts.checkpoint_seconds or rounds_done == run.rounds
        if stop or due:
            wall_s = wall_before + time.perf_counter() - started
            save_state(folder, held["sites"], rounds_done, done.aggregate.params, fingerprint, wall_s)
            last_save[0] = time.perf_counter()
            log(f"{method}/{arm.name} seed {seed}: saved after round {rounds_done} of {run.rounds} ({wall_s:.0f} s)",
                flush=True)
        if stop and rounds_done < run.rounds:
            raise Stopped(rounds_done)

    start = (resumed_at, saved["params"]) if saved else None
    try:
        _, evaluations = run_rounds(run, on_round=on_round, on_sites=on_sites, start=start)
    except Stopped as stopped:
        log(f"{method}/{arm.name} seed {seed}: stopped after round {stopped.args[0]} (saved)")
        return "stopped"
    metrics = final_summary(run, evaluations)["test"]  # as the FLARE controller summarises them
    _, device = device_name()
    row = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"), "device": device,
           "commit": git_commit(), "seed": seed, "method": method, "arm": arm.name, "rounds": run.rounds,
           "resumed_at": resumed_at, "metrics": {m: metrics.get(m) for m in METRICS if metrics.get(m) is not None},
           "wall_s": wall_before + time.perf_counter() - started}
    result_file.write_text(json.dumps({**row, "trained_rounds": trained, "fingerprint": fingerprint}, indent=1))
    append_row(opts.results, row)
    log(f"{method}/{arm.name} seed {seed}: " + ", ".join(f"{m} {v:.4f}" for m, v in row["metrics"].items()))
    return "finished"


def run_in_processes(jobs: list[tuple[str, Arm]], seed: int, argv: list[str], parallel: int, out: Path) -> int:
    """Every arm of one seed as its own process of this script (``--worker``), ``parallel`` at once; their
    output goes to each arm's log.txt. A stopped pack (SIGTERM) stops its arms, whose saves it resumes from."""
    pending, running, failed = list(jobs), [], 0
    threads = max(1, (os.cpu_count() or 1) // max(1, min(parallel, len(jobs))))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                method, arm = pending.pop(0)
                folder = arm_folder(out, method, arm.name, seed)
                folder.mkdir(parents=True, exist_ok=True)
                log = open(folder / "log.txt", "a")
                command = [sys.executable, __file__, *argv, "--worker", method, arm.name, str(seed)]
                running.append((method, arm, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                              env=env), log))
            time.sleep(1)
            for job in [job for job in running if job[2].poll() is not None]:
                running.remove(job)
                job[3].close()
                failed += job[2].returncode != 0
                tail = (arm_folder(out, job[0], job[1].name, seed) / "log.txt").read_text().strip().splitlines()
                print(f"  {job[0]}/{job[1].name} seed {seed}: exit {job[2].returncode}; {tail[-1] if tail else ''}",
                      flush=True)
    finally:
        for _, _, process, log in running:
            process.terminate()
            process.wait()
            log.close()
    return failed


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=PAPER_METHODS, default=PAPER_METHODS)
    parser.add_argument("--arms", nargs="+", help="only these arms (names as in the plan)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the estimates; run nothing")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-paper-lease"))
    parser.add_argument("--results", type=Path, default=RESULTS, help="the markdown file rows are appended to")
    parser.add_argument("--parallel", type=int, default=0, help="arms at once, each its own process (0: all; 1: in "
                        "this process, one after another)")
    parser.add_argument("--checkpoint-seconds", type=float, default=60.0, help="least seconds between saves")
    parser.add_argument("--stop-after-rounds", type=int, default=0, help="save and stop once a job has this many")
    parser.add_argument("--rounds", type=int, default=0, help="smoke runs: every arm this many rounds")
    parser.add_argument("--max-steps", type=int, default=0, help="smoke runs: at most this many steps a round")
    parser.add_argument("--sites", type=int, default=0, help="smoke runs: this many sites")
    parser.add_argument("--worker", nargs=3, metavar=("METHOD", "ARM", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.seeds = sorted(dict.fromkeys(args.seeds), key=lambda seed: seed != 0)  # seed 0 first, the rest as given
    opts = RunOptions(args.out, args.results, Tiny(args.rounds, args.max_steps, args.sites), args.stop_after_rounds,
                      args.checkpoint_seconds)
    if args.worker:
        method, name, seed = args.worker
        arm = next(arm for arm in lease_plan(method).arms if arm.name == name)
        run_arm(method, arm, int(seed), opts)
        return 0
    jobs = arms_of(args.methods, args.arms)
    try:
        runs = {(method, arm.name): lease_run(method, arm, args.seeds[0], opts.tiny) for method, arm in jobs}
    except ConfigError as exc:
        print(f"bench-paper-lease: error: {exc}", file=sys.stderr)
        return 2
    device, name = device_name()
    if args.dry_run:
        label = f"{name}, full batch" if device == "cuda" else f"{cpu_model()}, one thread, batch {CPU_PROBE_BATCH} scaled"
        model = CostModel(calibrated_rates())
        costs = cost_arms(runs, model, measure_device=device)
        print("\n".join(plan_lines(args.methods, runs, costs, label, args.seeds,
                                   model)))
        return 0
    print(f"bench-paper-lease: {len(jobs)} arms x seeds {args.seeds} on {name}, into {args.out}", flush=True)
    failed = 0
    for seed in args.seeds:
        if args.parallel == 1:
            for method, arm in jobs:
                run_arm(method, arm, seed, opts)
        else:
            forwarded = [a for a in argv if a != "--dry-run"]
            failed += run_in_processes(jobs, seed, forwarded, args.parallel or len(jobs), args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    from medflare.console.processes import stop_on_signals

    with stop_on_signals():
        sys.exit(main())
