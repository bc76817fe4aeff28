"""The fixed seconds a run pays besides its rounds: FLARE's simulator start and end, a POC's start and removal.

Three timings, each ``--repeats`` times (mean, min and max printed):

- ``simulator``: ``medflare run fedavg`` (2 sites, 2 rounds of 2 steps, synthetic data) through
  :func:`medflare.console.simulate.run_simulation`: launch to the first round's start, the job's last round line to the
  simulator's exit (FLARE's end of run and shutdown), and the whole call;
- ``poc-start``: :meth:`PocSession.prepare` and :meth:`PocSession.start` of a 2-site POC (FLARE's ``poc start``
  returns once every site is connected);
- ``poc-discard``: :meth:`PocSession.discard` of that POC (its processes ended, its workspace deleted).

Usage:
    python benchmarks/fixed_costs.py --repeats 3 --out runs/bench-fixed
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # benchmarks/ is not a package: the sibling scripts are imported by name
    sys.path.insert(0, str(HERE))

from he_cost import free_port  # noqa: E402

import medflare.console.simulate as simulate  # noqa: E402
from medflare.console.deploy.poc import PocSession  # noqa: E402
from medflare.plan import resolve  # noqa: E402
from medflare.run_config import RunConfig  # noqa: E402


def timed_simulator_run(workdir: Path) -> dict[str, float]:
    """Seconds of one short simulated run, split at its first round line and its last one."""
    marks: dict[str, float] = {}
    launch = simulate._launch

    def launch_timed(*args, **kwargs) -> None:
        marks["launch"] = time.monotonic()
        launch(*args, **kwargs)
        marks["exited"] = time.monotonic()

    def echo(line: str) -> None:
        if "round 1/" in line and "started" in line:
            marks.setdefault("first_round", time.monotonic())
        if "finished" in line and "rounds" in line:
            marks["last_line"] = time.monotonic()

    simulate._launch = launch_timed
    try:
        started = time.monotonic()
        run = RunConfig(method="fedavg", rounds=2, clients=2, train={"max_steps": 2})
        simulate.run_simulation(resolve(run, "byoc"), workdir / f"run-{started:.0f}", echo=echo)
        whole = time.monotonic() - started
    finally:
        simulate._launch = launch
    return {"start_to_round_1": marks["first_round"] - marks["launch"],
            "last_round_to_exit": marks["exited"] - marks["last_line"], "whole_run": whole}


def timed_poc(workdir: Path) -> dict[str, float]:
    session = PocSession(workdir / f"poc-{time.monotonic():.0f}", port=free_port(), echo=lambda line: None)
    started = time.monotonic()
    try:
        session.prepare(2, allow_job_data=True)
        session.start()
        ready = time.monotonic()
    finally:
        session.discard()
    return {"poc_prepare_and_start": ready - started, "poc_discard": time.monotonic() - ready}


def summarise(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {key: {"mean": statistics.mean(s[key] for s in samples), "min": min(s[key] for s in samples),
                  "max": max(s[key] for s in samples)} for key in samples[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-fixed"))
    args = parser.parse_args(argv)
    measures: dict[str, Callable[[Path], dict[str, float]]] = {"simulator": timed_simulator_run, "poc": timed_poc}
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, measure in measures.items():
            samples = []
            for repeat in range(args.repeats):
                samples.append(measure(Path(scratch)))
                spans = ", ".join(f"{key} {seconds:.2f} s" for key, seconds in samples[-1].items())
                print(f"{name} {repeat + 1}/{args.repeats}: {spans}", flush=True)
            results.update(summarise(samples))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    lines = ["| seconds | mean | min | max |", "|---|---|---|---|"]
    lines += [f"| {key} | {v['mean']:.2f} | {v['min']:.2f} | {v['max']:.2f} |" for key, v in results.items()]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
