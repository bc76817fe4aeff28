"""The report of ``converged.py``: per claim, each arm's chosen learning rate, its figures (mean ± std over the
seeds), the paired readings and one plot of the validation curves. Pure functions of the stored rows.

Reading rule (the project's): the paired per-seed difference d_s = method_s − baseline_s on the claim's figure;
with mean m and sample std s over the seeds, |m| ≤ s is "no difference", m > s "above", m < −s "below". A claim is
"reproduced" when its method is above every compared baseline, "not reproduced" when it is below one, and
"no difference" otherwise (each comparison's reading is given beside it).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from benchmarking import mean_std
from converged import CPU_BUDGET_SECONDS, LR_GRID, PATIENCE, ROUNDS_CAP, SEEDS, TUNING_SEED, Claim

REPRODUCED, NOT_REPRODUCED, NO_DIFFERENCE = "reproduced", "not reproduced", "no difference"


def paired(method: Sequence[float], baseline: Sequence[float]) -> dict[str, Any]:
    """The paired reading of one comparison: mean and std of the per-seed differences, the seeds where the method
    is above (of all), and the word."""
    diffs = [a - b for a, b in zip(method, baseline, strict=True)]
    if len(diffs) < 2:
        return {"mean": diffs[0] if diffs else math.nan, "std": math.nan, "above": sum(d > 0 for d in diffs),
                "seeds": len(diffs), "reading": "one seed: not a result"}
    mean, std = statistics.mean(diffs), statistics.stdev(diffs)
    word = "no difference" if abs(mean) <= std else "above" if mean > 0 else "below"
    return {"mean": mean, "std": std, "above": sum(d > 0 for d in diffs), "seeds": len(diffs), "reading": word}


def claim_reading(readings: Iterable[str]) -> str:
    """The claim's word from its comparisons' words."""
    words = list(readings)
    if words and all(w == "above" for w in words):
        return REPRODUCED
    if "below" in words:
        return NOT_REPRODUCED
    return NO_DIFFERENCE


def chosen_lrs(rows: Sequence[Mapping[str, Any]], claim: Claim) -> dict[str, float | None]:
    """Each arm's learning rate: the grid value with the best tuning-seed validation score (None: not all run)."""
    chosen: dict[str, float | None] = {}
    for arm in claim.arms:
        scores = {r["lr"]: r["val_best"] for r in rows if r["claim"] == claim.name and r["arm"] == arm.name
                  and r["tuning"]}
        chosen[arm.name] = max(sorted(scores), key=lambda lr: scores[lr]) if len(scores) == len(LR_GRID) else None
    return chosen


def scored_rows(rows: Sequence[Mapping[str, Any]], claim: Claim, arm: str, lr: float | None) -> list[Mapping]:
    """The arm's seed rows at its chosen lr, in seed order (the latest row of a seed wins)."""
    found = {r["seed"]: r for r in rows if r["claim"] == claim.name and r["arm"] == arm and not r["tuning"]
             and r["lr"] == lr}
    return [found[seed] for seed in SEEDS if seed in found]


def claim_result(rows: Sequence[Mapping[str, Any]], claim: Claim) -> dict[str, Any]:
    """The claim's lrs, per-arm figures (mean, std, n), per-comparison paired readings and its word."""
    lrs = chosen_lrs(rows, claim)
    arms = {arm.name: scored_rows(rows, claim, arm.name, lrs[arm.name]) for arm in claim.arms}
    figures: dict[str, dict[str, tuple[float, float, int]]] = {}
    for name, picked in arms.items():
        keys = sorted({k for r in picked for k, v in r["figures"].items() if v is not None})
        figures[name] = {k: _mean_std([r["figures"][k] for r in picked if r["figures"].get(k) is not None])
                         for k in keys}
    comparisons = {}
    for method, baseline in claim.comparisons:
        by_seed = {r["seed"]: r["figures"].get(claim.figure) for r in arms[baseline]}
        pairs = [(r["figures"].get(claim.figure), by_seed.get(r["seed"])) for r in arms[method]]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
        comparisons[(method, baseline)] = paired([a for a, _ in pairs], [b for _, b in pairs])
    complete = all(len(picked) == len(SEEDS) for picked in arms.values())
    word = claim_reading(c["reading"] for c in comparisons.values()) if complete else "not run to the end"
    rounds = {name: _mean_std([r["rounds_run"] for r in picked]) for name, picked in arms.items()}
    at_cap = {name: sum(not r["stopped_early"] for r in picked) for name, picked in arms.items()}
    return {"lrs": lrs, "figures": figures, "comparisons": comparisons, "reading": word, "rounds": rounds,
            "at_cap": at_cap, "arms": arms, "complete": complete}


def _mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    """benchmarking.mean_std with the count, and no spread (nan) from one value."""
    found = mean_std(list(values))
    if found is None:
        return math.nan, math.nan, 0
    return found[0], found[1] if len(values) > 1 else math.nan, len(values)


def _cell(value: tuple[float, float, int] | None) -> str:
    if value is None or value[2] == 0:
        return "—"
    mean, std, n = value
    return f"{mean:.3f} ± {std:.3f}" + ("" if n == len(SEEDS) else f" ({n} seeds)")


def claim_markdown(claim: Claim, result: Mapping[str, Any], plot: str | None) -> str:
    """One claim's section: the protocol line, the paper's table, the readings."""
    columns = sorted({k for f in result["figures"].values() for k in f}, key=lambda k: (k != claim.figure, k))
    lines = [f"### {claim.name}: {claim.statement}", "",
             f"{claim.paper}. Reading figure: `{claim.figure}` (test, the model chosen on validation). "
             f"Reading: **{result['reading']}**.", "",
             "| arm | lr | rounds run | seeds at the cap | " + " | ".join(columns) + " |",
             "|---|---|---|---|" + "---|" * len(columns)]
    for arm in claim.arms:
        lr = result["lrs"][arm.name]
        label = arm.name + (" (reference)" if arm.name in claim.references else "")
        lines.append(f"| {label} | {_lr(lr)} | {_rounds(result['rounds'][arm.name])} | "
                     f"{result['at_cap'][arm.name]} | " + " | ".join(_cell(result["figures"][arm.name].get(k)) for k in columns) + " |")
    lines += ["", "| comparison (paired per seed) | mean difference | std | method above in | reading |",
              "|---|---|---|---|---|"]
    for (method, baseline), c in result["comparisons"].items():
        lines.append(f"| {method} − {baseline} | {c['mean']:+.3f} | {c['std']:.3f} | {c['above']} of {c['seeds']} "
                     f"| {c['reading']} |")
    if plot:
        lines += ["", f"Validation curves: [{plot}]({plot})"]
    return "\n".join(lines)


def _lr(lr: float | None) -> str:
    """The chosen lr; one at an end of the grid is marked, as a better one may lie beyond it."""
    if lr is None:
        return "—"
    return f"{lr:g}" + (" (grid edge)" if lr in (min(LR_GRID), max(LR_GRID)) else "")


def _rounds(value: tuple[float, float, int]) -> str:
    return "—" if value[2] == 0 else f"{value[0]:.0f}"


def plot_curves(claim: Claim, result: Mapping[str, Any], path: Path) -> None:
    """The claim's validation metric against model version for every arm: the mean over seeds (of the seeds
    still running at that version) and a band of their min-max."""
    from medflare.plotting import legend_outside, pyplot, save  # noqa: PLC0415

    plt = pyplot()
    figure, axes = plt.subplots(figsize=(7.5, 4.2))
    for arm in claim.arms:
        picked = result["arms"][arm.name]
        if not picked:
            continue
        curves = [dict((v, s) for v, s in r["curve"] if s is not None) for r in picked]
        versions = sorted({v for c in curves for v in c})
        means = [statistics.mean(c[v] for c in curves if v in c) for v in versions]
        low = [min(c[v] for c in curves if v in c) for v in versions]
        high = [max(c[v] for c in curves if v in c) for v in versions]
        (line,) = axes.plot(versions, means, label=arm.name)
        axes.fill_between(versions, low, high, alpha=0.15, color=line.get_color())
    metric = next((r["metric"] for picked in result["arms"].values() for r in picked), "validation metric")
    axes.set_xlabel("model version (rounds trained)")
    axes.set_ylabel(f"validation {metric.replace('_', ' ')}")
    axes.set_title(f"{claim.name}: mean over {len(SEEDS)} seeds, band = min-max", fontsize=10)
    legend_outside(axes)
    save(figure, path)


def cpu_line(rows: Sequence[Mapping[str, Any]], claims: Sequence[Claim]) -> str:
    """What the pack's runs took: the sum of their seconds (each on one torch thread), against the budget."""
    seconds = sum(r["seconds"] for r in rows if r.get("claim") in {c.name for c in claims})
    return (f"The {len(rows)} runs took {seconds / 3600:.2f} CPU-hours in all (each on one torch thread; SSL-FL's "
            f"pre-training jobs not included), budget {CPU_BUDGET_SECONDS / 3600:.0f}.")


def write_report(rows: Sequence[Mapping[str, Any]], claims: Sequence[Claim], folder: Path) -> str:
    """``converged.md`` (and one ``converged-<claim>.png`` per claim with rows) in ``folder``; returns the text."""
    sections = [f"# Evidence at convergence (issue 63)\n\nCommand: `make bench-converged`. Protocol: lr grid "
                f"{list(LR_GRID)} chosen per arm on seed {TUNING_SEED}'s validation score; seeds {list(SEEDS)} "
                f"paired; each run stops after {PATIENCE} scored rounds without a better validation score (cap "
                f"{ROUNDS_CAP}); the best model on validation is scored on test. Simulated splits. Commits: "
                f"{', '.join(sorted({r['commit'] for r in rows})) or 'none'}; CPU: "
                f"{', '.join(sorted({r['cpu'] for r in rows})) or 'none'}. {cpu_line(rows, claims)}"]
    for claim in claims:
        result = claim_result(rows, claim)
        plot = None
        if any(result["arms"].values()):
            plot = f"converged-{claim.name}.png"
            plot_curves(claim, result, folder / plot)
        sections.append(claim_markdown(claim, result, plot))
    text = "\n\n".join(sections) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "converged.md").write_text(text)
    return text
