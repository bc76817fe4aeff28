"""What the scripts in ``benchmarks/`` share: one simulator run per table cell, reused when it already finished with
the same configuration, the mean ± std of a cell's seeds, and the sizes the cost benchmarks divide by (images one
local epoch trains on, the model's float32 bytes).

A benchmark is hours of CPU on a small machine and is often run one seed per process, or stopped and restarted;
reuse lets a later call (say ``--seeds 0 1 2`` for the report) pick up the runs that finished instead of
redoing them. A run is reused only when its recorded configuration equals the requested one, byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from medflare.plan import resolve, task_of
from medflare.run_config import RunConfig


def run_fingerprint(run: RunConfig) -> str:
    """The run's whole configuration as canonical JSON: two runs with equal fingerprints train the same job."""
    return json.dumps(dataclasses.asdict(run), sort_keys=True, default=str)


def fingerprint_file(run_dir: Path) -> Path:
    """Beside the run's folder, not in it: the folder holds only what the run itself wrote."""
    return run_dir.with_name(run_dir.name + ".run.json")


def finished_summary(run: RunConfig, run_dir: Path) -> dict[str, Any] | None:
    """The ``summary.json`` of an earlier run of exactly this configuration in ``run_dir``, else None."""
    record, summary = fingerprint_file(run_dir), run_dir / "summary.json"
    if not (record.is_file() and summary.is_file()) or record.read_text() != run_fingerprint(run):
        return None
    return json.loads(summary.read_text())


def run_cell(
    run: RunConfig, run_dir: Path, reuse: bool = True, echo: Callable[[str], None] = print
) -> tuple[dict[str, Any], bool]:
    """Run ``run`` in FLARE's simulator into ``run_dir``, or reuse an identical finished run.

    Args:
        run: the cell's configuration.
        run_dir: the cell's result folder (replaced when the run is redone).
        reuse: False redoes the run even when an identical one finished.
        echo: where the one-line "reused" notice goes.

    Returns:
        The run's summary, and whether it was reused.
    """
    if reuse and (summary := finished_summary(run, run_dir)) is not None:
        echo(f"         reused the finished run in {run_dir}")
        return summary, True
    from medflare.console.simulate import run_simulation  # FLARE is imported only when something runs

    fingerprint_file(run_dir).unlink(missing_ok=True)  # a stopped rerun must not leave the old record valid
    summary = run_simulation(resolve(run, "byoc"), run_dir, echo=lambda line: None, overwrite=True)
    fingerprint_file(run_dir).write_text(run_fingerprint(run))
    return summary, False


def mean_std(values: list[float]) -> tuple[float, float] | None:
    """Mean and sample standard deviation (0 for one value); None for no values."""
    if not values:
        return None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def versus(values: list[float], baseline: list[float]) -> str:
    """The docs' reading of a gap between two cells' seeds: within one standard deviation is "no difference".

    The gap of the means counts only when it exceeds the larger of the two sample standard deviations; one seed
    per side gives no spread, so nothing can be read from it.
    """
    ours, theirs = mean_std(values), mean_std(baseline)
    if ours is None or theirs is None:
        raise ValueError("versus needs at least one value on each side")
    gap = ours[0] - theirs[0]
    if min(len(values), len(baseline)) < 2:
        return f"{gap:+.3f} (one seed: not a result)"
    if abs(gap) <= max(ours[1], theirs[1]):
        return f"{gap:+.3f} (no difference)"
    return f"{gap:+.3f} ({'above' if gap > 0 else 'below'})"


def goal_verdict(name: str, value: float | None, goal: float, at_most: bool = True, unit: str = "") -> str:
    """One goal of a benchmark, marked met or missed and by how much: "ratio 1.104 (goal <= 1.05): **missed** by
    0.054". ``at_most`` False: the value must reach the goal (a throughput)."""
    sign = "<=" if at_most else ">="
    if value is None:
        return f"{name} (goal {sign} {goal:g}{unit}): not measured"
    gap = value - goal if at_most else goal - value
    verdict = f"**missed** by {gap:.3g}{unit}" if gap > 0 else f"met, {abs(gap):.3g}{unit} to spare"
    return f"{name} {value:.4g}{unit} (goal {sign} {goal:g}{unit}): {verdict}"


def later_rounds(rows: list[Any]) -> list[Any]:
    """Rounds 2..R (round 1 holds the sites' start-up: process launch, imports, data); the only round if there is
    one."""
    return rows[1:] if len(rows) > 1 else rows


def mean_later_rounds(values: list[float]) -> float:
    """Mean of a per-round figure over rounds 2..R."""
    return statistics.mean(later_rounds(values))


def trained_images(n_samples: int, batch: int, steps: int) -> int:
    """Images one medflare epoch trains on: full batches (drop_last when that leaves one), capped at ``steps``."""
    batches = n_samples // batch if n_samples > batch else 1
    size = batch if n_samples > batch else n_samples
    return (min(batches, steps) if steps else batches) * size


def model_fp32_bytes(run: RunConfig) -> int:
    """Bytes of the model's state with every float at float32 (integer buffers at their own size): what the
    wire carries per model when weights travel in float32."""
    from medflare.models import create_model  # torch is imported only when a size is asked for

    task = task_of(run)
    state = create_model(run.model, task.num_classes, task.in_channels, image_size=task.image_size).state_dict()
    return int(sum(v.numel() * (4 if v.is_floating_point() else v.element_size()) for v in state.values()))


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name and the cores this process may use, for the tables that name their device: figures
    differ between CPUs (an AMD EPYC's float kernels move the demo's third decimal against an Intel's, and its
    speed is another)."""
    name = platform.processor() or platform.machine() or "unknown CPU"
    try:
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")]
        name = models[0] if models else name
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores"
