"""Where a round's seconds go in FLARE's simulator or a POC, from the server's and the sites' own log lines.

FLARE logs, per site and round: the task assigned (server), the model downloaded (site), the task processed
(site), the result sent and received (server). This script merges those lines of a kept simulator workspace and
prints, per round (2..R), the mean seconds of each step, so the coordination overhead of
``benchmarks/overhead.py`` can be split into FLARE's parts (task pickup, model download, result upload) and the
server's (after the last result until the next round starts).

Usage (a 12-round ResNet-18 job with 3 local steps, about 1 min):
    medflare run fedavg --model resnet18 --clients 2 --rounds 12 --max-steps 3 --out /tmp/rt
    nvflare simulator /tmp/rt/job/fedavg -w /tmp/rt-ws -n 2 -t 2
    python benchmarks/round_timeline.py /tmp/rt-ws
The same job in a POC (its output folder keeps the server's and the sites' FLARE logs of the job):
    medflare run fedavg --model resnet18 --clients 2 --rounds 12 --max-steps 3 --env poc --out /tmp/rt-poc
    python benchmarks/round_timeline.py /tmp/rt-poc
"""

from __future__ import annotations

import argparse
import re
import statistics
from datetime import datetime
from pathlib import Path

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
ROUND_START = re.compile(r"medflare: round (\d+)/\d+ \(\w+\) started")
ROUND_DONE = re.compile(r"medflare: round (\d+)/\d+ done")
SERVER_EVENTS = {
    "assigned": re.compile(r"assigned task to client ([\w.-]+): name=train"),
    "received": re.compile(r"got result from client ([\w.-]+) for task: name=train"),
}
SITE_EVENTS = {
    "downloaded": re.compile(r"\[client\] download ref=\S+ done"),
    "processed": re.compile(r"ClientRunner - .*finished processing task"),
}
STEPS = ("pickup", "download", "work", "upload", "server after last result", "round wall")


def stamp_seconds(line: str) -> float | None:
    """The time (``time.time()`` scale) a FLARE log line starts with; None for a line without one."""
    match = STAMP.match(line)
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if match else None


def stamped(path: Path) -> list[tuple[float, str]]:
    """(seconds, line) of every timestamped line of a FLARE log."""
    lines = [(stamp_seconds(line), line) for line in path.read_text(errors="replace").splitlines()]
    return [(when, line) for when, line in lines if when is not None]


def round_windows(server: list[tuple[float, str]]) -> dict[int, tuple[float, float]]:
    """Round number -> (start, done) from the controller's lines."""
    starts, dones = {}, {}
    for when, line in server:
        if match := ROUND_START.search(line):
            starts[int(match.group(1))] = when
        elif match := ROUND_DONE.search(line):
            dones[int(match.group(1))] = when
    return {r: (starts[r], dones[r]) for r in starts if r in dones}


def first_after(
    lines: list[tuple[float, str]], pattern: re.Pattern, after: float, before: float, site: str | None = None
) -> float | None:
    """The first line matching ``pattern`` (and naming ``site`` as its group 1, when given) in [after, before]."""
    for when, line in lines:
        match = pattern.search(line) if after <= when <= before else None
        if match and (site is None or match.group(1) == site):
            return when
    return None


def log_files(folder: Path) -> tuple[Path, dict[str, Path]]:
    """The server's and each site's FLARE log of the job: a kept simulator workspace (``server/log.txt``,
    ``site-*/log.txt``) or the output folder of ``medflare run --env poc`` (``poc_server.log``,
    ``sites/*/flare_job_log.txt``)."""
    if (folder / "poc_server.log").is_file():
        return folder / "poc_server.log", {p.parent.name: p for p in sorted(folder.glob("sites/*/flare_job_log.txt"))}
    return folder / "server" / "log.txt", {p.parent.name: p for p in sorted(folder.glob("site-*/log.txt"))}


def round_steps(workspace: Path) -> dict[int, dict[str, float]]:
    """Per round: the slowest site's pickup, download, work, upload, and the server's time after its result."""
    server_log, site_logs = log_files(workspace)
    server = stamped(server_log)
    sites = {site: stamped(path) for site, path in site_logs.items()}
    steps = {}
    windows = sorted(round_windows(server).items())
    next_start = {number: start for number, (start, _) in windows}
    for number, (start, done) in windows:
        per_site = {}
        for site, lines in sites.items():
            assigned = first_after(server, SERVER_EVENTS["assigned"], start, done, site)
            received = first_after(server, SERVER_EVENTS["received"], start, done, site)
            downloaded = first_after(lines, SITE_EVENTS["downloaded"], start, done)
            processed = first_after(lines, SITE_EVENTS["processed"], start, done)
            if None not in (assigned, received, downloaded, processed):
                per_site[site] = (assigned - start, downloaded - assigned, processed - downloaded,
                                  received - processed, received)
        if per_site:
            slowest = max(per_site.values(), key=lambda s: s[4])
            # the wall runs to the next round's start (the last round: to its end), as the benchmarks count it
            wall = next_start.get(number + 1, done) - start
            steps[number] = dict(zip(STEPS, (*slowest[:4], done - slowest[4], wall)))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workspace", type=Path,
                        help="a kept `nvflare simulator -w` workspace, or a `medflare run --env poc` output folder")
    args = parser.parse_args()
    steps = round_steps(args.workspace)
    later = [s for number, s in steps.items() if number > 1]
    if not later:
        server_log, site_logs = log_files(args.workspace)
        raise SystemExit(f"no complete round (2..R) found in {server_log} and {len(site_logs)} site log(s) under "
                         f"{args.workspace}: give a kept simulator workspace or a POC run's output folder")
    print(f"{len(later)} rounds (2..R), mean seconds of the site whose result came last:")
    print("| " + " | ".join(STEPS) + " |\n|" + "---|" * len(STEPS))
    print("| " + " | ".join(f"{statistics.mean(s[k] for s in later):.3f}" for k in STEPS) + " |")


if __name__ == "__main__":
    main()
