"""Seconds per round of FedAvg with ResNet-18 over a rate-limited hospital link, against the floor the link sets
(issue 29, item 3). Needs root: it runs ``medflare rehearse``.

Each speed is one rehearsal (:mod:`medflare.console.deploy.rehearse`): the consortium provisioned, the server and 2
hospitals started from their own kits, each in its own network namespace, the lead's job over mTLS to the server's
FQDN; every hospital's link is shaped with ``tc tbf`` at the speed, both ways (the server's own link is not
shaped). Per speed it reports:

- s/round: the mean over rounds 2..R (round 1 holds the sites' start-up) of each round's start to the next
  round's start (the last round: the controller's recorded wall);
- floor: per round, (bytes down + bytes up of one site) × 8 / the link rate + the slowest site's local work, and
  its mean over the same rounds. Bytes down: the train task one site received (the server's ``task_bytes`` record:
  arrays + meta); bytes up: the largest result a site sent (``payload``). Local work: the spans of each site's own
  ``task_seconds`` record of the round (scoring the received model, loading it, training, encoding, state save);
- ratio: s/round over the floor. Goal at 100 Mbit/s: <= 1.15.

The floor counts payload bytes only: TCP/IP and TLS framing and FLARE's own message headers add a few per cent
on the wire, and the server's aggregation and the task pickup are not in it, so a ratio of 1 is out of reach.
Every participant shares this machine's CPU, so the sites' local work is slower than on hospitals' own machines.

Usage:
    sudo python benchmarks/link_speed.py                          # 1000, 100 and 20 Mbit/s, 5 rounds each
    sudo python benchmarks/link_speed.py --speeds 100 --rounds 2  # one quick cell
    sudo python benchmarks/link_speed.py --dtype float16          # the weights in float16 both ways
Results: ``results.json`` and ``results.md`` under ``--out``; each speed's rehearsal (report, logs) in
``<out>/<speed>mbit``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Iterator

from benchmarking import later_rounds

from medflare.site_runtime import SITE_LOG_FILE, TASK_SECONDS_EVENT

SPEEDS = (1000.0, 100.0, 20.0)
GOAL_AT_100 = 1.15
PHASES = ("download", "site", "upload", "server")  # a round's time, in order (:func:`round_phases`)


# ----- pure parts: the floor and the table ------------------------------------------------------------------
def floor_seconds(bytes_down: int, bytes_up: int, mbit: float, work_seconds: float) -> float:
    """The least a round can take on a link of ``mbit`` Mbit/s each way: one site's download and upload at the
    link's rate, one after the other, plus the slowest site's local work."""
    if mbit <= 0:
        raise ValueError(f"the link rate must be > 0 Mbit/s, got {mbit}")
    return (bytes_down + bytes_up) * 8 / (mbit * 1e6) + work_seconds


def task_records(logs: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(site, record) for every ``task_seconds`` record in each site's own log of the speed's job
    (``<site>.<job>.<SITE_LOG_FILE>``, as the rehearsal keeps them)."""
    for log in sorted(logs.glob(f"*.{SITE_LOG_FILE}")):
        site = log.name.split(".", 1)[0]
        for line in log.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if record.get("event") == TASK_SECONDS_EVENT:
                yield site, record


def site_spans(logs: Path) -> dict[str, dict[int, dict[str, float]]]:
    """site -> round -> the spans of its train task."""
    spans: dict[str, dict[int, dict[str, float]]] = {}
    for site, record in task_records(logs):
        spans.setdefault(site, {})[int(record["round"])] = record["seconds"]
    return spans


def site_walls(logs: Path) -> dict[str, dict[int, dict[str, float]]]:
    """site -> round -> the wall-clock times its train task began and ended at the site (``wall`` of its
    ``task_seconds`` record; every participant shares this machine's clock)."""
    walls: dict[str, dict[int, dict[str, float]]] = {}
    for site, record in task_records(logs):
        if "wall" in record:
            walls.setdefault(site, {})[int(record["round"])] = record["wall"]
    return walls


def round_phases(record: dict[str, Any], walls: dict[str, dict[int, dict[str, float]]]) -> dict[str, float] | None:
    """Where the round's time went for the site whose result reached the server last: ``download`` (round start
    to the task's start at the site: the server's send, the link, FLARE's receive), ``site`` (the task at the
    site), ``upload`` (the task's end to the server holding the result: FLARE's send, the link, the server's
    receive and checks) and ``server`` (the last result to the round's end). None without the sites' wall times."""
    arrivals = {site: entry["result_at"] for site, entry in record.get("sites", {}).items() if "result_at" in entry}
    last = max(arrivals, key=arrivals.get) if arrivals else None
    wall = walls.get(last or "", {}).get(record["round"])
    if wall is None:
        return None
    start = record["started_at"]
    return {"download": wall["began"] - start, "site": wall["ended"] - wall["began"],
            "upload": arrivals[last] - (wall["ended"] - start), "server": record["wall_seconds"] - arrivals[last]}


def round_rows(results: dict[str, Any], spans: dict[str, dict[int, dict[str, float]]],
               walls: dict[str, dict[int, dict[str, float]]] | None = None) -> list[dict[str, Any]]:
    """Per round: its wall (start to the next round's start; the last: its recorded wall), the bytes one site
    received and the most one sent, and the slowest site's local work.

    Raises:
        ValueError: a round without the server's byte records or without any site's timing (nothing to compare).
    """
    records = results["rounds"]
    rows = []
    for index, record in enumerate(records):
        following = records[index + 1]["started_at"] if index + 1 < len(records) else None
        wall = following - record["started_at"] if following is not None else record["wall_seconds"]
        work = [sum(by_round[record["round"]].values()) for by_round in spans.values() if record["round"] in by_round]
        down = record.get("task_bytes", {}).get("train")
        up = [entry["bytes"] for entry in record.get("payload", {}).values()]
        if down is None or not up or not work:
            raise ValueError(f"round {record['round'] + 1} has no download bytes, result bytes or site timing: the "
                             "server or the sites ran a medflare without them")
        rows.append({"round": record["round"] + 1, "wall": wall, "bytes_down": int(down), "bytes_up": int(max(up)),
                     "work": max(work), "phases": round_phases(record, walls or {})})
    return rows


def speed_row(mbit: float, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One line of the table: s/round and the floor over rounds 2..R, and their ratio."""
    measured = later_rounds(rounds)
    per_round = statistics.mean(r["wall"] for r in measured)
    floor = statistics.mean(floor_seconds(r["bytes_down"], r["bytes_up"], mbit, r["work"]) for r in measured)
    transfer = statistics.mean((r["bytes_down"] + r["bytes_up"]) * 8 / (mbit * 1e6) for r in measured)
    phases = [r["phases"] for r in measured if r.get("phases")]
    return {"mbit": mbit, "s_per_round": per_round, "floor": floor, "ratio": per_round / floor,
            "transfer_floor": transfer, "work": statistics.mean(r["work"] for r in measured),
            "bytes_down": measured[-1]["bytes_down"], "bytes_up": measured[-1]["bytes_up"],
            "rounds_measured": [r["round"] for r in measured],
            "phases": {key: statistics.mean(p[key] for p in phases) for key in PHASES} if phases else None,
            "phase_floors": {"download": statistics.mean(r["bytes_down"] * 8 / (mbit * 1e6) for r in measured),
                             "site": statistics.mean(r["work"] for r in measured),
                             "upload": statistics.mean(r["bytes_up"] * 8 / (mbit * 1e6) for r in measured),
                             "server": 0.0}}


def markdown(rows: list[dict[str, Any]], config: dict[str, Any]) -> str:
    lines = ["# Round time over a rate-limited link (issue 29)", "", f"Config: `{json.dumps(config)}`", "",
             "| Mbit/s per hospital | s/round | floor s | ratio | of it: transfer s | slowest site's work s | "
             "bytes down / up per site | rounds |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['mbit']:g} | {row['s_per_round']:.2f} | {row['floor']:.2f} | {row['ratio']:.3f} | "
                     f"{row['transfer_floor']:.2f} | {row['work']:.2f} | {row['bytes_down']:,} / "
                     f"{row['bytes_up']:,} | {', '.join(map(str, row['rounds_measured']))} |")
    timed = [row for row in rows if row.get("phases")]
    if timed:
        lines += ["", "Where a round's time goes, for the site whose result arrived last (mean s over the same rounds; "
                  "measured / floor):", "", "| Mbit/s | " + " | ".join(PHASES) + " |", "|---" * (len(PHASES) + 1) + "|"]
        for row in timed:
            cells = [f"{row['phases'][key]:.2f} / {row['phase_floors'][key]:.2f}" for key in PHASES]
            lines.append(f"| {row['mbit']:g} | " + " | ".join(cells) + " |")
    at_100 = [row for row in rows if row["mbit"] == 100]
    if at_100:
        met = "met" if at_100[0]["ratio"] <= GOAL_AT_100 else "missed"
        lines += ["", f"Goal at 100 Mbit/s: ratio <= {GOAL_AT_100} ({met}: {at_100[0]['ratio']:.3f})."]
    return "\n".join(lines) + "\n"


# ----- running it ---------------------------------------------------------------------------------------------
def hospitals(count: int) -> list[str]:
    """The names the rehearsal gives its first ``count`` hospitals (from provisioning/project.yml)."""
    from medflare.console.deploy.provision import load_project, participants
    from medflare.console.deploy.rehearse import DEFAULT_PROJECT, consortium

    return [c["name"] for c in participants(consortium(load_project(DEFAULT_PROJECT), count), "client")]


def rehearsal(args: argparse.Namespace, mbit: float) -> Any:
    from medflare.console.deploy.rehearse import Rehearsal

    rates = {name: mbit for name in hospitals(args.hospitals)}
    return Rehearsal(hospitals=args.hospitals, model=args.model, rounds=args.rounds, max_steps=args.steps,
                     batch_size=args.batch, images=args.images, rates=rates, job_timeout=args.timeout,
                     transfer_dtype=args.dtype, download_dtype=args.dtype)


def measure(args: argparse.Namespace, mbit: float) -> dict[str, Any]:
    """One rehearsal at ``mbit``; its table line, the job's status and whether the rehearsal's checks passed."""
    from medflare.console.deploy.rehearse import rehearse
    from medflare.flare.controller import RESULTS_FILE

    out = args.out / f"{mbit:g}mbit"
    record = rehearse(rehearsal(args, mbit), out, echo=lambda line: print(f"  [{mbit:g} Mbit/s] {line}", flush=True),
                      overwrite=True)
    results = json.loads((out / RESULTS_FILE).read_text())
    row = speed_row(mbit, round_rows(results, site_spans(out / "logs"), site_walls(out / "logs")))
    return {**row, "status": record["status"], "checks_ok": record["ok"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speeds", type=float, nargs="+", default=list(SPEEDS), help="Mbit/s per hospital link")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per speed (rounds 2..R are measured)")
    parser.add_argument("--hospitals", type=int, default=2)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--steps", type=int, default=5, help="local optimizer steps per round")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--images", type=int, default=200, help="synthetic training images per hospital")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                        help="how the weights travel, both ways")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one speed's job may take")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-link"))
    args = parser.parse_args(argv)
    if args.rounds < 2 or any(speed <= 0 for speed in args.speeds):
        parser.error("--rounds must be >= 2 (round 1 is not measured) and every speed > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    from medflare.console.processes import Interrupted, stop_on_signals
    from medflare.errors import MedflareError

    args = parse_args(argv)
    rows = []
    try:
        with stop_on_signals():  # a rehearsal removes its namespaces and processes on SIGTERM too
            for mbit in args.speeds:
                rows.append(measure(args, mbit))
                print(f"{mbit:g} Mbit/s: {rows[-1]['s_per_round']:.2f} s/round, floor {rows[-1]['floor']:.2f} s, "
                      f"ratio {rows[-1]['ratio']:.3f}", flush=True)
    except (MedflareError, ValueError) as exc:
        print(f"link_speed: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"link_speed: interrupted by {exc}", file=sys.stderr)
        return exc.exit_code
    config = {key: getattr(args, key) for key in ("rounds", "hospitals", "model", "steps", "batch", "images", "dtype")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"config": config, "speeds": rows}, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(rows, config))
    print(markdown(rows, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
