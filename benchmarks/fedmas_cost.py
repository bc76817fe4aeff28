"""What Fed-MAS costs a site per round, where that time goes, and what its three shortcuts buy (issue 15).

Two parts (``--part``):

``timing``  one site of the demo setting, in this process (no FLARE; the site runtime FLARE runs), several
            rounds per variant: seconds per round of each part: the prior's forward passes, the w pass (which
            holds prior forwards of its own), the student's training steps (training minus the prior's share),
            and the evaluation of the received model; BSM-FL's round on the same site for reference.
``accuracy`` the federated job in FLARE's simulator per variant and seed: balanced accuracy of the final model
            (mean ± std over ``--seeds``) and the sites' mean local work per round (``train_seconds``, round 1
            left out), so the Fed-MAS / BSM-FL cost ratio with the shortcuts off and on comes from one run.

Variants: the paper (``fedmas``), each shortcut alone, all three, and BSM-FL. The feature cache needs training
images with a fixed set of views, so the variants that use it train with ``data.augment=weak`` (flip only), and
BSM-FL and the paper's Fed-MAS run with that augmentation too as their references (``*-weak`` rows).

Demo setting: the ``hyperkvasir-like`` scenario (8 long-tailed classes) over 4 sites, 8 rounds, ``cnn``, as
``make demo``; ``--model resnet18`` for the issue's second setting. Results: ``results.md`` and ``results.json``.

Usage:
    python benchmarks/fedmas_cost.py [--part timing|accuracy|all] [--model cnn] [--seeds 0 1 2] [--out DIR]
    python benchmarks/fedmas_cost.py --quick        # a few minutes: timing only, 2 rounds, 10 steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarking import mean_std, versus

from medflare.plan import task_of
from medflare.registry import get_method

W_PASS_PER_CLASS = 32  # images per class in the shortcut's w pass
SHORTCUTS = {"cache_prior_features": True, "prior_precision": "reduced", "w_pass_per_class": W_PASS_PER_CLASS}
WEAK = {"augment": "weak"}
# name -> (method, method options, data options)
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "bsm-fl": ("bsm-fl", {}, {}),
    "fedmas (paper)": ("fedmas", {}, {}),
    "fedmas +reduced precision": ("fedmas", {"prior_precision": "reduced"}, {}),
    f"fedmas +w pass {W_PASS_PER_CLASS}/class": ("fedmas", {"w_pass_per_class": W_PASS_PER_CLASS}, {}),
    "bsm-fl-weak": ("bsm-fl", {}, WEAK),
    "fedmas-weak (paper)": ("fedmas", {}, WEAK),
    "fedmas-weak +cache": ("fedmas", {"cache_prior_features": True}, WEAK),
    "fedmas-weak +all three": ("fedmas", SHORTCUTS, WEAK),
}
# a variant -> the run it is read against (same augmentation; Fed-MAS itself against BSM-FL)
REFERENCES = {name: ("fedmas-weak (paper)" if "weak" in name else "fedmas (paper)")
              for name, (method, options, _) in VARIANTS.items() if method == "fedmas" and options}
REFERENCES.update({"fedmas (paper)": "bsm-fl", "fedmas-weak (paper)": "bsm-fl-weak"})
PARTS = ("prior_forward", "w_pass", "student", "evaluate")


def run_config(args: argparse.Namespace, variant: str, seed: int) -> Any:
    """The demo job of one variant and seed (``make demo``'s scenario, sites and rounds)."""
    from medflare.console.scenarios import load_scenario
    from medflare.run_config import RunConfig, merge_sections

    method, method_args, data = VARIANTS[variant]
    train = {"max_steps": args.steps} if args.steps else {}
    override = {"method": method, "seed": seed, "rounds": args.rounds, "clients": args.clients, "model": args.model,
                "method_args": method_args, "data": data, "train": train, "name": f"cost-{seed}"}
    return RunConfig(**merge_sections(load_scenario("hyperkvasir-like"), override))


# ----- part 1: where a site's round goes ----------------------------------------------------------------------
def timed_calls(owner: Any, name: str, seconds: list[float], inner: list[float] | None = None) -> None:
    """Wrap ``owner.name`` so that every call adds its wall time to ``seconds[0]`` and, when ``inner`` is given,
    what ``inner[0]`` grew by during the call (another timed part nested in it) to ``inner[1]``."""
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started, inner_before = time.perf_counter(), inner[0] if inner else 0.0
        try:
            return original(*args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - started
            if inner:
                inner[1] += inner[0] - inner_before

    setattr(owner, name, wrapper)


def site_round_parts(run: Any, rounds: int) -> dict[str, float]:
    """Mean seconds per round (rounds 2..R) of each part at the largest site, training on its own returned
    weights round after round (the site's work does not depend on what the others send)."""
    from medflare.methods.base import RoundContext
    from medflare.plan import describe_sites, resolve
    from medflare.site_config import SiteSettings
    from medflare.site_runtime import SiteRuntime

    task = task_of(run)
    sites, _ = describe_sites(resolve(run, "byoc", task=task))
    index = max(range(run.clients), key=lambda i: sum(sites[run.site_names[i]]["class_counts"]))
    settings = SiteSettings(get_method(run.method), task, run.site_data(), run.model, run.method_args, run.train, run.seed)
    runtime = SiteRuntime(settings, run.site_names[index], index, log=lambda message: None)
    trainer, records = runtime.trainer, []
    trainer.local_log = records.append
    prior, w_pass = [0.0, 0.0], [0.0]  # prior: [all its forwards (cache look-ups included), those in the w pass]
    if hasattr(trainer, "prior_features"):
        timed_calls(trainer, "prior_features", prior)
        timed_calls(trainer, "global_divergence", w_pass, inner=prior)
    cache = getattr(trainer, "prior_cache", None)
    params: dict[str, Any] = {}
    rows = []
    for round_index in range(rounds):
        prior[:], w_pass[0] = [0.0, 0.0], 0.0
        misses_before = cache.misses if cache else 0
        params, _ = runtime.train(params, RoundContext(round_index, rounds))
        spans = next(r["seconds"] for r in reversed(records) if r.get("event") == "task_seconds")
        in_training = prior[0] - prior[1]  # the w pass's own prior forwards are part of w_pass
        rows.append({"prior_forward": in_training, "w_pass": w_pass[0], "evaluate": spans["evaluate"],
                     "student": spans["train"] - w_pass[0] - in_training, "site_round": sum(spans.values()),
                     # images the prior still had to see this round (the cache fills over the first rounds)
                     "prior_cache_misses": float(cache.misses - misses_before) if cache else float("nan")})
    later = rows[1:] if len(rows) > 1 else rows
    return {key: statistics.mean(row[key] for row in later) for key in rows[0]}


# ----- part 2: accuracy and local work in FLARE's simulator -------------------------------------------------------
def simulated(run: Any, out: Path) -> dict[str, float]:
    """One cell's accuracy and local work (an identical finished run in ``out`` is reused)."""
    from benchmarking import run_cell

    summary, _ = run_cell(run, out)
    seconds = [t for facts in summary["clients"].values() for t in facts.get("train_seconds", [])[1:] if t]
    return {"balanced_accuracy": summary["final"]["balanced_accuracy"],
            "train_seconds": statistics.mean(seconds) if seconds else float("nan")}


def ratio_rows(seconds: dict[str, float]) -> list[str]:
    """Fed-MAS over BSM-FL per-round site time with the shortcuts off and on (goal <= 2x)."""
    pairs = [("fedmas (paper)", "bsm-fl"), ("fedmas-weak (paper)", "bsm-fl-weak"),
             ("fedmas-weak +all three", "bsm-fl-weak")]
    return [f"- {a} / {b}: **{seconds[a] / seconds[b]:.2f}x** (goal <= 2x)" for a, b in pairs
            if a in seconds and b in seconds and seconds[b] > 0]


def against_reference(variant: str, accuracy: dict[str, list[dict]]) -> str:
    """A shortcut's effect on balanced accuracy: its gap to the paper's Fed-MAS on the same augmentation."""
    reference = REFERENCES.get(variant)
    if reference not in accuracy:
        return "-"
    values = [[c["balanced_accuracy"] for c in accuracy[name]] for name in (variant, reference)]
    return f"{versus(*values)} vs {reference}"


def markdown(args: argparse.Namespace, timing: dict[str, dict[str, float]], accuracy: dict[str, list[dict]]) -> str:
    lines = [f"# Fed-MAS cost: hyperkvasir-like, {args.clients} sites, model {args.model}", ""]
    if timing:
        lines += ["## Where a site's round goes (s per round, largest site, rounds 2..R, in-process)", "",
                  "| variant | site round | prior forward (training) | w pass | student | evaluation | "
                  "prior cache misses (images/round) |",
                  "|---|---|---|---|---|---|---|"]
        for name, t in timing.items():
            misses = t.get("prior_cache_misses", float("nan"))  # absent from runs before this column existed
            lines.append(f"| {name} | {t['site_round']:.2f} | {t['prior_forward']:.2f} | {t['w_pass']:.2f} | "
                         f"{t['student']:.2f} | {t['evaluate']:.2f} | {'-' if misses != misses else f'{misses:.0f}'} |")
        lines += ["", *ratio_rows({name: t["site_round"] for name, t in timing.items()}), ""]
    if accuracy:
        lines += [f"## Balanced accuracy and local work in FLARE's simulator (seeds {args.seeds}, {args.rounds} rounds)",
                  "", "| variant | balanced accuracy | vs its reference | local work s/site/round |", "|---|---|---|---|"]
        means = {}
        for name, cells in accuracy.items():
            bacc = mean_std([c["balanced_accuracy"] for c in cells]) or (float("nan"), float("nan"))
            means[name] = statistics.mean(c["train_seconds"] for c in cells)
            lines.append(f"| {name} | {bacc[0]:.4f} ± {bacc[1]:.4f} | {against_reference(name, accuracy)} | "
                         f"{means[name]:.2f} |")
        lines += ["", *ratio_rows(means), ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["timing", "accuracy", "all"], default="all")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=0, help="cap on optimizer steps per site and round (0 = epoch)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT")
    parser.add_argument("--quick", action="store_true", help="timing only, 2 rounds, 10 steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.part, args.rounds, args.steps = "timing", 2, 10
    args.out = Path(args.out or f"runs/bench-fedmas-cost-{args.model}")
    return args


def earlier_parts(args: argparse.Namespace) -> dict[str, Any]:
    """The parts an earlier run wrote to ``--out`` with the same job settings: a part run alone keeps the other's."""
    record = args.out / "results.json"
    if not record.is_file():
        return {}
    earlier = json.loads(record.read_text())
    settings = ("model", "clients", "rounds", "steps")
    if any(earlier.get("config", {}).get(key) != getattr(args, key) for key in settings):
        print(f"{record}: written with other settings ({', '.join(settings)}); its parts are not kept", flush=True)
        return {}
    return {part: earlier.get(part, {}) for part in ("timing", "accuracy")}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = earlier_parts(args)
    timing: dict[str, dict[str, float]] = {} if args.part != "accuracy" else earlier.get("timing", {})
    accuracy: dict[str, list[dict]] = {} if args.part != "timing" else earlier.get("accuracy", {})
    for variant in args.variants:
        if args.part in ("timing", "all"):
            timing[variant] = site_round_parts(run_config(args, variant, args.seeds[0]), args.rounds)
            print(f"{variant}: {timing[variant]}", flush=True)
        if args.part in ("accuracy", "all"):
            for seed in args.seeds:
                folder = args.out / f"{variant.replace(' ', '_').replace('/', '-')}-seed{seed}"
                accuracy.setdefault(variant, []).append({"seed": seed, **simulated(run_config(args, variant, seed), folder)})
                print(f"{variant} seed {seed}: {accuracy[variant][-1]}", flush=True)
    report = markdown(args, timing, accuracy)
    (args.out / "results.md").write_text(report)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "results.json").write_text(json.dumps({"config": config, "timing": timing, "accuracy": accuracy},
                                                      indent=2) + "\n")
    print(report)


if __name__ == "__main__":
    from medflare.console.processes import stop_on_signals

    with stop_on_signals():
        main()
