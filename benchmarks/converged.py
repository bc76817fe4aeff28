"""Evidence at convergence (issue 63): each seed paper's claim on CPU, every arm run until its validation metric
stops improving, against FedAvg, FedAdam and the paper's own baselines, each tuned on the same learning-rate grid.

Protocol (the same for every claim and arm, stated in docs/benchmarks.md):
  data      the real MedMNIST files (../shared/data, MD5-checked) with the paper's problem set up as the paper sets
            it (a long-tail cut with a stated imbalance factor, Dirichlet label skew, label noise, label-set masks,
            missing classes); a synthetic scenario where the claim needs an image attribute. Simulated splits.
  budget    every round's received model is scored by the sites (site_evaluation=every_round); a run stops after
            PATIENCE scored rounds without a better pooled validation score (the controller's own early stopping,
            RunResults) or at ROUNDS_CAP; the model chosen is the best on validation, and its test figures are
            the ones reported (nothing is selected on test).
  tuning    each arm's client learning rate is chosen from LR_GRID by its best validation score on TUNING_SEED, a
            seed none of the scored runs uses; the same grid, cap and data for every arm.
  seeds     SEEDS (5), paired: a seed fixes the split, the noise and the initialisation for every arm alike.
  reading   per comparison, the paired per-seed difference of the claim's figure (method minus baseline): its
            mean, std and sign count; within one std is "no difference" (the project's rule).

Every arm goes through the in-process engine (``inprocess.run_rounds``: the job's plan, each site as the executor
builds it, the server's round core and its checks). Rows are appended to ``--results`` (default
``benchmarks/results/converged.json``) as each arm and seed finishes, with the commit and the CPU; a rerun skips
every row already there with the same configuration, so the pack resumes where it stopped. ``--report`` writes the
tables, readings and curves (``converged.md`` and ``converged-<claim>.png`` beside the results).

Usage:
    python benchmarks/converged.py --dry-run              # the plan and its CPU estimate, runs nothing
    python benchmarks/converged.py [--claims NAME ...] [--workers 2]   # run (resumes), then report
    python benchmarks/converged.py --report               # tables and plots from the rows only
    python benchmarks/converged.py --smoke --results /tmp/x.json   # one arm, 2 rounds (the heavy test)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable, Mapping

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # benchmarks/ is not a package: the sibling scripts are imported by name
    sys.path.insert(0, str(HERE))

from benchmarking import cpu_model  # noqa: E402

from medflare.data.checksums import verify_medmnist_file  # noqa: E402
from medflare.run_config import RunConfig, merge_sections  # noqa: E402

ROOT = HERE.parent
DATA = ROOT.parent / "shared" / "data" / "medmnist"
RETINA = DATA / "retinamnist.npz"
RESULTS = HERE / "results" / "converged.json"
LR_GRID = (3e-4, 1e-3, 3e-3)  # Adam's client learning rate, every arm
SEEDS = (0, 1, 2, 3, 4)
TUNING_SEED = 100  # the learning rate is chosen on this seed's validation split only
PATIENCE = 6  # scored rounds without a better validation score before a run stops
ROUNDS_CAP = 40
# rounds a run is expected to take, for the estimate (Claim.typical_rounds): the first 71 runs at patience 6 and the
# 40-round cap (2026-12-04, the lr grids of five claims) took 13.5-19.6 rounds on average per claim, the attribute
# claim's 27.1
TYPICAL_ROUNDS = 18
RUN_SECONDS = 8.0  # one run's own cost besides its rounds (data, sites, model, final validation), measured 0-17 s
FEDADAM = {"name": "fedadam", "lr": 0.01}  # η 0.01, β₁ 0.9, β₂ 0.99, τ 1e-3 (docs/server-optimizers.md)
CPU_BUDGET_SECONDS = 5 * 3600


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm of a claim: a registered method, its options and any sections merged over the claim's base."""

    name: str
    method: str
    method_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sections: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    pretrain: str = ""  # SSL-FL: the method whose federated pre-training gives this arm's encoder


@dataclasses.dataclass(frozen=True)
class Claim:
    """A paper's claim: its problem (``base`` sections), its arms, the figure the reading compares and the
    comparisons (method arm, baseline arm) it is read on; ``table`` turns a chosen model's evaluation summary into
    the paper's own figures. ``round_seconds``: seconds of one round per arm on one core of the 2-core machine
    (measured 2026-12-04 over 3 rounds with the other core busy; site evaluation every round included), for the
    estimate."""

    name: str
    paper: str
    statement: str
    base: Callable[[], dict[str, Any]]
    arms: tuple[Arm, ...]
    figure: str
    comparisons: tuple[tuple[str, str], ...]
    table: Callable[[Mapping[str, Any]], dict[str, float | None]]
    round_seconds: Mapping[str, float]
    references: tuple[str, ...] = ()  # arms shown for scale, not compared (an upper bound)
    typical_rounds: int = TYPICAL_ROUNDS  # rounds a run is expected to take (the dry run's estimate)

    def arm(self, name: str) -> Arm:
        return next(arm for arm in self.arms if arm.name == name)


# ----- the paper tables ---------------------------------------------------------------------------------------
def pooled(summary: Mapping[str, Any], *keys: str) -> dict[str, float | None]:
    """The chosen model's pooled test metrics ``keys``."""
    test = summary.get("test", {})
    return {key: test.get(key) for key in keys}


def fedmas_table(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """Fed-MAS's Table 1: balanced accuracy and the head / medium / tail accuracies."""
    return pooled(summary, "balanced_accuracy", "head_accuracy", "medium_accuracy", "tail_accuracy", "accuracy")


def attribute_table(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """Fed-MAS's Table 2: balanced accuracy per attribute group and their mean ("Avg")."""
    groups = {f"bacc_attr_{a}": m.get("balanced_accuracy") for a, m in summary.get("test_by_attribute", {}).items()}
    values = [v for v in groups.values() if v is not None]
    return {**pooled(summary, "balanced_accuracy"), **groups,
            "attr_avg": sum(values) / len(values) if values else None}


def fca_table(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """FCA's Table 2: generalization, specialization and their mean, in bACC and bAUC."""
    from fca_vs_baselines import figures_of  # noqa: PLC0415  (imports the FCA script only when needed)

    from medflare.evaluation import personalization_figures  # noqa: PLC0415

    if "specialization" in summary.get("extra", {}):
        figures = personalization_figures(summary, global_classifier="test" in summary,
                                          generalization="generalization")
    else:
        figures = figures_of({**summary.get("test", {}), "by_site": summary.get("by_site", {}),
                              "site_mean": summary.get("site_mean", {})})
    return {k: figures.get(k) for k in ("generalization_bacc", "specialization_bacc", "gs_mean_bacc",
                                         "generalization_bauc", "specialization_bauc", "gs_mean_bauc")}


def site_table(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """MDH-FL's Table 2: each site's (architecture's) accuracy on its clean test share, and their mean."""
    by_site = {f"accuracy_{site}": m.get("accuracy") for site, m in summary.get("by_site", {}).items()}
    return {"site_mean_accuracy": summary.get("site_mean", {}).get("accuracy"), **by_site}


def classification_table(summary: Mapping[str, Any]) -> dict[str, float | None]:
    return pooled(summary, "balanced_accuracy", "accuracy", "auc_macro_ovr", "macro_f1")


# ----- the claims ---------------------------------------------------------------------------------------------
@functools.cache
def verified_retina() -> Path:
    """RetinaMNIST, its MD5 checked once per process (every run's configuration names it)."""
    return verify_medmnist_file(RETINA)


def retina(**data: Any) -> dict[str, Any]:
    return {"source": f"medmnist:{verified_retina()}", **data}


CNN_TRAIN = {"optimizer": "adam", "batch_size": 64, "local_epochs": 1}
WEIGHT_AVERAGING = (Arm("fedavg", "fedavg"), Arm("fedadam", "fedavg", sections={"server_optimizer": FEDADAM}))
IMBALANCE = 10  # the Fed-MAS long-tail cut: largest / smallest training class after subsampling
FCA_BSM = {"eps": 1e-9}  # FCA trains its baselines with balanced softmax at its prior floor
IDENTIFIED_RETINA = [[0, 1], [1, 2, 3], [3, 4], [0, 2, 4], [2, 3]]  # FedLSM: the grades each site annotates
# MDH-FL's sites: the paper's MobileNetV2 and ShuffleNetV2, and the small CNN in place of its ResNet-12 (a ResNet
# step at 28 px takes 15x the CNN's on this CPU, 3x MobileNetV2's)
MDHFL_MODELS = {"site-1": "mobilenet_v2", "site-2": "shufflenet", "site-3": "cnn"}


def fedmas_base() -> dict[str, Any]:
    return {"clients": 4, "model": "cnn", "shot_thresholds": [200, 100], "train": CNN_TRAIN,
            "data": retina(partition="dirichlet:0.5", imbalance=IMBALANCE, augment="weak")}


def attribute_base() -> dict[str, Any]:
    """The isic-attribute-like scenario (Fed-MAS §3.2): 4 sites mixing a dark attribute 5 / 20 / 50 / 80 %, with
    1,600 training images instead of the scenario's 2,400 (its runs go to 40-50 rounds: the CPU budget)."""
    return {"clients": 4, "model": "cnn", "train": CNN_TRAIN,
            "data": {"source": "synthetic:n=1600,classes=5,imbalance=10,dark_fraction=0.35",
                     "partition": "attribute:0.05/0.2/0.5/0.8", "augment": "weak"}}


# Fed-MAS's arms train with the weak view (a flip) in both of its claims, so its prior's features of an image are
# computed once and reused (cache_prior_features: the same features, not an approximation)
FEDMAS = Arm("fedmas", "fedmas", {"cache_prior_features": True})


def mdhfl_base() -> dict[str, Any]:
    return {"clients": 3, "model": "cnn", "site_model": MDHFL_MODELS, "train": {"batch_size": 16, "local_epochs": 1},
            "data": retina(partition="dirichlet:0.5", public_fraction=0.2, augment="none", label_noise=0.2,
                           noise_kind="pairflip")}


def fca_base() -> dict[str, Any]:
    return {"clients": 5, "model": "cnn", "train": {**CNN_TRAIN, "weight_decay": 5e-4},
            "data": retina(partition="class-dirichlet:50/5/30/10/0.5:0.3", eval_split="like_train")}


def fedlsm_base() -> dict[str, Any]:
    return {"clients": 5, "model": "cnn", "train": {**CNN_TRAIN, "betas": [0.9, 0.99], "weight_decay": 5e-4},
            "data": retina(partition="iid", identified=IDENTIFIED_RETINA)}


def fedlsm_upper_bound() -> Arm:
    """FedAvg on the same samples with every label (simulation only): the data section without the masks."""
    return Arm("fedavg, every label (upper bound)", "fedavg", sections={"data": {"identified": None}})


# SSL-FL's local epochs a round at each label fraction: a site holds about 22 labelled images at 10 % (one batch of
# 32) and 65 at 30 % (two), so one epoch is one or two steps, and a run at chance stopped by the patience rule after
# 7-9 steps in all (the first tuning runs, fed-mae at 0.200 on every lr); these give 4-5 steps a site a round
SSL_LOCAL_EPOCHS = {0.1: 5, 0.3: 2}


def ssl_base(fraction: float) -> Callable[[], dict[str, Any]]:
    def base() -> dict[str, Any]:
        from ssl_fl import FINETUNE_ARGS, FINETUNE_DATA, MODEL  # noqa: PLC0415

        data = retina(partition="dirichlet:0.5", **FINETUNE_DATA,
                      **({"label_fraction": fraction} if fraction < 1 else {}))
        return {"clients": 5, "model": MODEL, "data": data, "method_args": {"pretrain_rounds": 0, **FINETUNE_ARGS},
                "train": {"batch_size": 32, "local_epochs": SSL_LOCAL_EPOCHS[fraction], "base_batch": 0}}
    return base


def ssl_arms() -> tuple[Arm, ...]:
    beit = {"tokenizer_rounds": 0}
    return (Arm("fed-mae", "fed-mae", pretrain="fed-mae"), Arm("fed-beit", "fed-beit", beit, pretrain="fed-beit"),
            Arm("scratch (FedAvg, MAE recipe)", "fed-mae"), Arm("scratch (FedAvg, BEiT recipe)", "fed-beit", beit),
            Arm("scratch (FedAdam, MAE recipe)", "fed-mae", sections={"server_optimizer": FEDADAM}))


def ssl_claim(fraction: float) -> Claim:
    scratch, beit_scratch, adam = "scratch (FedAvg, MAE recipe)", "scratch (FedAvg, BEiT recipe)", \
        "scratch (FedAdam, MAE recipe)"
    return Claim(
        f"ssl-fl-retina-f{fraction:g}", "SSL-FL (Yan et al. 2023)",
        f"Fed-MAE and Fed-BEiT pre-training beats training from scratch ({fraction:.0%} of the labels)",
        ssl_base(fraction), ssl_arms(), "balanced_accuracy",
        (("fed-mae", scratch), ("fed-mae", adam), ("fed-beit", beit_scratch), ("fed-beit", adam)),
        # measured on 1 core: 1.2 s a round at one step a site, 0.45 s each further step (5 sites)
        classification_table, {arm.name: {0.1: 3.0, 0.3: 3.1}[fraction] for arm in ssl_arms()})


CLAIMS: tuple[Claim, ...] = (
    Claim("fedmas-retina-lt", "Fed-MAS (Elbatel et al. 2023)",
          "Fed-MAS beats BSM-FL and FedAvg on a long tail (balanced accuracy)", fedmas_base,
          (FEDMAS, Arm("bsm-fl", "bsm-fl"), *WEIGHT_AVERAGING), "balanced_accuracy",
          (("fedmas", "bsm-fl"), ("fedmas", "fedavg"), ("fedmas", "fedadam")), fedmas_table,
          {"fedmas": 3.0, "bsm-fl": 1.0, "fedavg": 1.0, "fedadam": 1.0}),
    Claim("fedmas-attribute", "Fed-MAS (Elbatel et al. 2023)",
          "Fed-MAS beats BSM-FL and FedAvg under an inter-site attribute shift (mean bACC over attributes)",
          attribute_base, (FEDMAS, Arm("bsm-fl", "bsm-fl"), *WEIGHT_AVERAGING), "attr_avg",
          (("fedmas", "bsm-fl"), ("fedmas", "fedavg"), ("fedmas", "fedadam")), attribute_table,
          # Fed-MAS: 8.9 s its first round (the prior's features of every image, then cached), 2.7-3.5 s from the
          # third on (an idle core, 8 rounds), so about 4 s a round over a run with the other core busy
          {"fedmas": 4.0, "bsm-fl": 2.4, "fedavg": 2.2, "fedadam": 2.1}, typical_rounds=30),
    Claim("mdhfl-retina-pairflip", "MDH-FL (Meng et al. 2023)",
          "MDH-FL beats FedMD and local training under label noise, one architecture per site (mean site accuracy)",
          mdhfl_base, (Arm("mdhfl", "mdhfl"), Arm("fedmd", "fedmd"), Arm("local-only", "local-only", {"loss": "sce"}),
                       Arm("fedavg (cnn at every site)", "fedavg", sections={"site_model": None}),
                       Arm("fedadam (cnn at every site)", "fedavg",
                           sections={"site_model": None, "server_optimizer": FEDADAM})),
          "site_mean_accuracy",
          (("mdhfl", "fedmd"), ("mdhfl", "local-only"), ("mdhfl", "fedavg (cnn at every site)"),
           ("mdhfl", "fedadam (cnn at every site)")), site_table,
          {"mdhfl": 6.2, "fedmd": 5.2, "local-only": 3.6, "fedavg (cnn at every site)": 1.2,
           "fedadam (cnn at every site)": 1.2}),
    Claim("fca-retina", "FCA (Wicaksana et al. 2023)",
          "FCA improves generalization and specialization together (mean of the two, bACC)", fca_base,
          (Arm("fca", "fca"), Arm("fedavg-bsm", "bsm-fl", FCA_BSM), *WEIGHT_AVERAGING,
           Arm("local-only", "local-only", {"loss": "bsm", **FCA_BSM})), "gs_mean_bacc",
          (("fca", "fedavg-bsm"), ("fca", "fedavg"), ("fca", "fedadam"), ("fca", "local-only")), fca_table,
          {"fca": 1.9, "fedavg-bsm": 1.5, "fedavg": 1.6, "fedadam": 1.5, "local-only": 2.8}),
    Claim("fedlsm-retina", "FedLSM (Deng et al. 2023)",
          "FedLSM recovers what missing labels cost: above its lower bound, towards its upper bound (bACC)",
          fedlsm_base, (Arm("fedlsm", "fedlsm", {"local_iterations": 0}),
                        Arm("fedavg, labelled only (lower bound)", "fedavg"),
                        Arm("fedavg-masked (FedAvg*)", "fedavg-masked"),
                        Arm("fedadam, labelled only", "fedavg", sections={"server_optimizer": FEDADAM}),
                        fedlsm_upper_bound()),
          "balanced_accuracy",
          (("fedlsm", "fedavg, labelled only (lower bound)"), ("fedlsm", "fedavg-masked (FedAvg*)"),
           ("fedlsm", "fedadam, labelled only")), classification_table,
          {"fedlsm": 4.4, "fedavg, labelled only (lower bound)": 1.5, "fedavg-masked (FedAvg*)": 1.5,
           "fedadam, labelled only": 1.5, "fedavg, every label (upper bound)": 1.5},
          references=("fedavg, every label (upper bound)",)),
    ssl_claim(0.1),
    ssl_claim(0.3),
)
CLAIM = {claim.name: claim for claim in CLAIMS}


# ----- one run ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RunKey:
    """One run of the pack: a claim's arm at a seed and learning rate (``tuning``: a grid run on TUNING_SEED)."""

    claim: str
    arm: str
    seed: int
    lr: float

    @property
    def tuning(self) -> bool:
        return self.seed == TUNING_SEED

    def label(self) -> str:
        return f"{self.claim} | {self.arm} | seed {self.seed} | lr {self.lr:g}"


def run_config(key: RunKey, rounds_cap: int = ROUNDS_CAP, patience: int = PATIENCE,
               extra_train: Mapping[str, Any] | None = None, encoder: str | None = None) -> RunConfig:
    """The job of one run: the claim's base, the arm's sections, its seed, learning rate and the budget."""
    claim = CLAIM[key.claim]
    arm = claim.arm(key.arm)
    sections = merge_sections(claim.base(), dict(arm.sections))
    sections = {name: value for name, value in sections.items() if value is not None}  # None: the arm drops it
    method_args = {**sections.pop("method_args", {}), **arm.method_args}
    train = {**sections.pop("train", {}), "lr": key.lr, **(extra_train or {})}
    return RunConfig(**sections, method=arm.method, method_args=method_args, train=train, seed=key.seed,
                     rounds=rounds_cap, patience=patience, site_evaluation="every_round", pretrained=encoder,
                     name=f"{key.claim}-{arm.method}-s{key.seed}-lr{key.lr:g}")


def config_digest(run: RunConfig) -> str:
    """sha256 of the run's configuration as JSON: a stored row is reused only for the very same job."""
    return _digest(dataclasses.asdict(run))


def _digest(config: Mapping[str, Any]) -> str:
    """sha256 of ``config`` as JSON, a MedMNIST file named without its folder: where ../shared lies differs
    between clones and machines, and the file's content is fixed by the MD5 that every run checks."""
    text = _portable(json.dumps(config, sort_keys=True, default=str))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _portable(text: str) -> str:
    return re.sub(r'medmnist:[^"]*/([^"/]+\.npz)', r"medmnist:\1", text)


def key_digest(key: RunKey, rounds_cap: int = ROUNDS_CAP, patience: int = PATIENCE,
               extra_train: Mapping[str, Any] | None = None) -> str:
    """The digest a run of ``key`` stores and is found by: its job with the encoder named by its pre-training
    job's configuration, not by the file's path (which depends on ``--out``, and which the pack's planner, choosing
    what is left to run, has not built yet)."""
    arm = CLAIM[key.claim].arm(key.arm)
    return config_digest(run_config(key, rounds_cap, patience, extra_train, pretraining_label(arm, key.seed)))


def pretraining_label(arm: Arm, seed: int) -> str | None:
    """SSL-FL: the pre-training job behind an arm's encoder on ``seed``, as its name and configuration's sha256."""
    if not arm.pretrain:
        return None
    from ssl_fl import job_config, pretrain_run  # noqa: PLC0415

    job = pretrain_run(arm.pretrain, "retina", 0.5, seed)
    return f"pre-training {job.name} {_digest(job_config(job))}"


def encoder_for(arm: Arm, seed: int, out: Path) -> str | None:
    """SSL-FL: the exported encoder of the arm's federated pre-training on this seed's split (run once, cached
    under ``out``; the pre-training budget is ssl_fl.py's, fixed, not run to convergence)."""
    if not arm.pretrain:
        return None
    from ssl_fl import Grid  # noqa: PLC0415

    return Grid(out / "pretrain", "inprocess").encoder(arm.pretrain, "retina", 0.5, seed)


def run_one(key: RunKey, out: Path, rounds_cap: int = ROUNDS_CAP, patience: int = PATIENCE,
            extra_train: Mapping[str, Any] | None = None, threads: int = 1) -> dict[str, Any]:
    """Run ``key`` to convergence and return its row: the validation curve, the chosen model version, the test
    figures of that version (the claim's table), rounds run, seconds, commit and CPU."""
    import torch  # noqa: PLC0415
    from inprocess import run_rounds, selecting  # noqa: PLC0415

    torch.set_num_threads(threads)
    claim = CLAIM[key.claim]
    encoder = encoder_for(claim.arm(key.arm), key.seed, out)
    run = run_config(key, rounds_cap, patience, extra_train, encoder)
    results, started = selecting(run), time.perf_counter()

    def progress(done: Any) -> None:
        best = results.data.get("best", {})
        score = results.data["evaluations"].get(str(done.plan.round), {}).get("val", {}).get(results.key_metric)
        print(f"  {key.label()}: round {done.plan.round + 1}/{rounds_cap} val {_fmt(score)} best "
              f"{_fmt(best.get(results.key_metric))} (model {best.get('model_version', '-')}) "
              f"{done.seconds:.1f}s", flush=True)

    run_rounds(run, on_round=progress, results=results)
    return row_of(key, key_digest(key, rounds_cap, patience, extra_train), results.data,
                  time.perf_counter() - started, results.key_metric)


def row_of(key: RunKey, digest: str, data: Mapping[str, Any], seconds: float, metric: str) -> dict[str, Any]:
    """The stored row of a finished run (``digest``: key_digest; ``data``: the controller's record, RunResults.data)."""
    evaluations, best = data["evaluations"], data.get("best")
    if not best:
        raise RuntimeError(f"{key.label()}: no round was scored on validation")
    chosen = evaluations[str(best["model_version"])]
    return {
        "claim": key.claim, "arm": key.arm, "seed": key.seed, "lr": key.lr, "tuning": key.tuning,
        "config": digest, "metric": metric, "best_version": best["model_version"], "val_best": best[metric],
        "curve": [[int(v), e.get("val", {}).get(metric)] for v, e in sorted(evaluations.items(), key=lambda i: int(i[0]))],
        "rounds_run": len(evaluations), "stopped_early": "stopped_early" in data,
        "figures": CLAIM[key.claim].table(chosen), "seconds": round(seconds, 1),
        "commit": commit(), "cpu": cpu_model(), "torch_threads": _threads(), "finished_at": time.time(),
    }


def _threads() -> int:
    import torch  # noqa: PLC0415

    return torch.get_num_threads()


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def commit() -> str:
    """The commit the run was made at (+dirty when the tree had changes), or "unknown" outside a checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


# ----- the pack ----------------------------------------------------------------------------------------------
class Store:
    """The rows of ``path`` (a JSON list), appended one finished run at a time, atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = json.loads(path.read_text()) if path.is_file() else []

    def find(self, key: RunKey, config: str) -> dict[str, Any] | None:
        return next((r for r in self.rows if (r["claim"], r["arm"], r["seed"], r["lr"], r["config"]) ==
                     (key.claim, key.arm, key.seed, key.lr, config)), None)

    def current(self, claims: list[Claim]) -> list[dict[str, Any]]:
        """The rows of ``claims`` run with today's configuration of their key (a row of an earlier configuration
        stays in the file, as a record, but is not read)."""
        names = {claim.name for claim in claims}
        return [r for r in self.rows if r["claim"] in names and r["arm"] in {a.name for a in CLAIM[r["claim"]].arms}
                and r["config"] == key_digest(RunKey(r["claim"], r["arm"], r["seed"], r["lr"]))]

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.rows, indent=1) + "\n")
        os.replace(tmp, self.path)


def pretrainings(claims: list[Claim]) -> list[tuple[str, int]]:
    """SSL-FL's pre-training jobs of ``claims``: one per (method, seed), shared by the label fractions."""
    return sorted({(arm.pretrain, seed) for claim in claims for arm in claim.arms if arm.pretrain
                   for seed in (TUNING_SEED, *SEEDS)})


def tuning_keys(claim: Claim) -> list[RunKey]:
    return [RunKey(claim.name, arm.name, TUNING_SEED, lr) for arm in claim.arms for lr in LR_GRID]


def chosen_lr(store: Store, claim: Claim, arm: str) -> float | None:
    """The grid's learning rate with the best validation score on the tuning seed (None until all have run)."""
    found = {}
    for key in tuning_keys(claim):
        if key.arm == arm:
            row = store.find(key, key_digest(key))
            if row is None:
                return None
            found[key.lr] = row["val_best"]
    return max(sorted(found), key=lambda lr: found[lr])


def planned_runs(claims: list[Claim]) -> list[tuple[RunKey, str]]:
    """Every run of the pack as (key, phase): the tuning grid, then the seeds (their lr fixed once tuned)."""
    runs = [(key, "tune") for claim in claims for key in tuning_keys(claim)]
    runs += [(RunKey(claim.name, arm.name, seed, float("nan")), "seeds")
             for claim in claims for arm in claim.arms for seed in SEEDS]
    return runs


def estimate(claims: list[Claim], store: Store | None = None) -> tuple[str, float, float]:
    """The dry run's plan text, its expected CPU seconds and its bound (every run to the cap). A run ``store``
    holds at today's configuration counts what it took; one still to run counts its claim's ``typical_rounds``
    rounds of its arm's measured ``round_seconds``. SSL-FL's pre-training jobs are counted once per (method, seed),
    as the label fractions share them."""
    lines, expected, bound = [], 0.0, 0.0
    jobs = pretrainings(claims)
    runs = len(LR_GRID) + len(SEEDS)
    for claim in claims:
        finished = {(r["arm"], r["seed"], r["lr"]): r["seconds"] for r in (store.current([claim]) if store else [])}
        left = {arm.name: runs - sum(1 for a, _, _ in finished if a == arm.name) for arm in claim.arms}
        model = {arm.name: claim.round_seconds[arm.name] * claim.typical_rounds + RUN_SECONDS for arm in claim.arms}
        measured = sum(finished.values())
        claim_expected = measured + sum(model[name] * count for name, count in left.items())
        expected += claim_expected
        bound += sum((claim.round_seconds[arm.name] * ROUNDS_CAP + RUN_SECONDS) * runs for arm in claim.arms)
        lines.append(f"  {claim.name}: {len(claim.arms)} arms x ({len(LR_GRID)} lr on seed {TUNING_SEED} + "
                     f"{len(SEEDS)} seeds) = {len(claim.arms) * runs} runs, ~{claim_expected / 60:.0f} CPU-min "
                     f"({len(finished)} done in {measured / 60:.0f} CPU-min; every run to the cap: "
                     f"{sum(claim.round_seconds[a.name] for a in claim.arms) * runs * ROUNDS_CAP / 60:.0f})")
    extra = sum(PRETRAIN_SECONDS[method] for method, _ in jobs)
    if jobs:
        lines.append(f"  SSL-FL pre-training: {len(jobs)} jobs, ~{extra / 60:.0f} CPU-min")
    return "\n".join(lines), expected + extra, bound + extra


# one SSL-FL pre-training job (ssl_fl.py's budget: 20 rounds x 10 steps x 5 sites), measured on 1 core
PRETRAIN_SECONDS = {"fed-mae": 50.0, "fed-beit": 100.0}


def run_pack(claims: list[Claim], store: Store, out: Path, workers: int) -> None:
    """SSL-FL's pre-training jobs, then the tuning grid of every claim, then its seeds at each arm's chosen lr;
    finished rows (and cached encoders) are skipped, so a stopped pack resumes."""
    jobs = pretrainings(claims)
    print(f"converged: pre-training: {len(jobs)} encoders (cached ones are reused)", flush=True)
    _in_pool(workers, [(pretrain_encoder, (method, seed, out), f"pre-training {method} seed {seed}")
                       for method, seed in jobs], lambda label, result: None)
    for phase in ("tune", "seeds"):
        todo = []
        for key, planned in planned_runs(claims):
            if planned != phase:
                continue
            if phase == "seeds":
                lr = chosen_lr(store, CLAIM[key.claim], key.arm)
                if lr is None:
                    raise SystemExit(f"converged: {key.claim} {key.arm}: the tuning grid has not finished")
                key = dataclasses.replace(key, lr=lr)
            if store.find(key, key_digest(key)) is None:
                todo.append(key)
        print(f"converged: {phase}: {len(todo)} runs to go", flush=True)
        _in_pool(workers, [(run_one, (key, out), key) for key in todo], lambda key, row: _store(store, key, row))


def pretrain_encoder(method: str, seed: int, out: Path) -> str:
    """One SSL-FL encoder (cached under ``out``), on one torch thread."""
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    return encoder_for(Arm(method, method, pretrain=method), seed, out) or ""


def _in_pool(workers: int, jobs: list[tuple[Callable[..., Any], tuple, Any]], done: Callable[[Any, Any], None]) -> None:
    """Run ``jobs`` (function, arguments, label) in ``workers`` processes, handing each result to ``done`` as it
    finishes; a failed job is reported and the others go on; the pack stops after them, naming the failures."""
    failed: list[str] = []
    with ProcessPoolExecutor(max(workers, 1)) as pool:
        futures = {pool.submit(function, *arguments): label for function, arguments, label in jobs}
        for future in as_completed(futures):
            label = futures[future]
            try:
                result = future.result()
            except Exception as exc:  # noqa: BLE001  (one failed run must not lose the others' rows)
                failed.append(f"{label.label() if isinstance(label, RunKey) else label}: {exc}")
                print(f"converged: FAILED {failed[-1]}", flush=True)
                continue
            done(label, result)
    if failed:
        raise SystemExit(f"converged: {len(failed)} runs failed (the finished ones are stored; rerun to resume): "
                         + "; ".join(failed))


def _store(store: Store, key: RunKey, row: dict[str, Any]) -> None:
    store.add(row)
    print(f"converged: {key.label()}: best val {row['val_best']:.4f} at model {row['best_version']} of "
          f"{row['rounds_run']} ({'stopped' if row['stopped_early'] else 'cap'}), {row['seconds']:.0f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--claims", nargs="+", choices=list(CLAIM), default=list(CLAIM))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-converged",
                        help="SSL-FL's pre-training jobs (cached)")
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel, one torch thread each")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its CPU estimate, run nothing")
    parser.add_argument("--report", action="store_true", help="only write the tables and plots from --results")
    parser.add_argument("--smoke", action="store_true", help="one arm of the first claim, 2 rounds, 4 steps")
    args = parser.parse_args(argv)
    claims = [CLAIM[name] for name in args.claims]
    if args.dry_run:
        text, expected, bound = estimate(claims, Store(args.results))
        print(f"converged: {len(planned_runs(claims))} runs; lr grid {list(LR_GRID)} on seed {TUNING_SEED}, seeds "
              f"{list(SEEDS)}, patience {PATIENCE}, cap {ROUNDS_CAP} rounds\n{text}\n"
              f"converged: estimate {expected / 3600:.1f} CPU-hours ({expected / 3600 / max(args.workers, 1):.1f} h "
              f"on {args.workers} cores); every run to the cap: {bound / 3600:.1f} CPU-hours; budget "
              f"{CPU_BUDGET_SECONDS / 3600:.0f}")
        return 0 if expected <= CPU_BUDGET_SECONDS else 1
    store = Store(args.results)
    if args.smoke:
        claim = claims[0]
        key = RunKey(claim.name, claim.arms[-1].name, SEEDS[0], LR_GRID[1])
        row = run_one(key, args.out, rounds_cap=2, patience=1, extra_train={"max_steps": 4})
        store.add(row)
        print(f"converged: smoke {key.label()}: {row['rounds_run']} rounds, figures {row['figures']}")
        return 0
    if not args.report:
        run_pack(claims, store, args.out, args.workers)
    from converged_report import write_report  # noqa: PLC0415

    print(write_report(store.current(claims), claims, args.results.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
