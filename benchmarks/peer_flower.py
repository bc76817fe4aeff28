"""Peer benchmark: medflare against Flower on the same FedAvg work, and both against the bare PyTorch loop.

Five sides, one after another, per model and site count:

- ``bare``: the bare PyTorch FedAvg of ``overhead.py`` (one process per site, pipes, float64 average);
- ``medflare-sim``: medflare in FLARE's simulator; ``medflare-poc``: medflare in a FLARE POC on this machine (server
  and sites as separate FLARE processes, mTLS on loopback), both through ``overhead.flare_run``;
- ``flower-sim``: Flower 1.42's simulation engine (``flwr.simulation.run_simulation``, one Ray actor per site);
- ``flower-deploy``: Flower's deployment engine: a SuperLink and one SuperNode per site on loopback (insecure
  mode), the app submitted with ``flwr run``; each round's ClientApp is a new process, as Flower runs it;
- ``flare-sim``: the floor under medflare's simulator side: FLARE 2.9's own ``FedAvgRecipe`` (its ``FedAvg``
  controller and in-process Client API) in ``SimEnv``, the sites running ``flare_peer/client.py`` around the same
  site code, so FLARE moves the same model with nothing of medflare in between.

The same work everywhere: the model (``--models``, ResNet-18 and ``cnn``), the data (PneumoniaMNIST, or a
synthetic source), the IID partitions, one local epoch (or ``--steps``) of Adam lr 1e-3 at batch 64, scoring val
and test each round, every site every round. The bare loop's sites and Flower's clients run the very same code
(``fedavg_site.FedAvgSite``); Flower's side reads the sites' specs from a workload file and checks each
partition's sha256 against the one written here from medflare's own data code. Flower lives in its own virtual
environment (``--flower-venv``, made by ``make bench-peer``): ``flwr`` 1.42 needs protobuf < 7, medflare's
environment has protobuf 7. On a CUDA machine every side trains on the GPU (AMP, channels_last); the table names
the device.

Per side: seconds per round (mean of rounds 2..R; round 1 holds start-up), its ratio to bare, coordination per
round (round wall minus the slowest site's own work), the whole job from launch to exit, CPU-seconds of all the
side's processes, the peak of their summed resident memory, and the bytes a site sends and receives per round.
Each side runs under a keeper (``medflare.console.processes``) in its own process tree, so CPU-seconds count every process
it started (also a POC's), and nothing it started outlives it, also on failure or Ctrl-C. Goal (issue 32): medflare
at or below Flower's seconds per round, simulator against simulation engine and POC against deployment engine.

Usage:
    python benchmarks/peer_flower.py                     # ResNet-18 and cnn, 2 sites, all five sides
    python benchmarks/peer_flower.py --quick             # cnn, 2 sites, 3 rounds, 5 steps: a few minutes
    python benchmarks/peer_flower.py --sides bare flower-sim --models cnn --rounds 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # benchmarks/ is not a package: the sibling scripts are imported by name
    sys.path.insert(0, str(HERE))

import overhead  # noqa: E402
from benchmarking import cpu_model, later_rounds, mean_later_rounds  # noqa: E402
from fedavg_site import initial_state, site_specs  # noqa: E402

ROOT = HERE.parent
APP_DIR = HERE / "flower_peer"
DEFAULT_FLOWER_VENV = ROOT / ".venv-flower"
SIDES = ("bare", "medflare-sim", "medflare-poc", "flower-sim", "flower-deploy", "flare-sim")
MEDFLARE_ENV = {"medflare-sim": "sim", "medflare-poc": "poc"}
PAIRS = {"simulation": ("medflare-sim", "flower-sim"), "deployment": ("medflare-poc", "flower-deploy")}
FLOORS = {"medflare-sim": "flare-sim"}  # medflare's side -> FLARE's own FedAvg on the same engine
SIMULATOR_SERVERS = ("medflare-sim", "flare-sim")  # sides whose server is FLARE's simulator: its memory is measured
FLARE_CLIENT = HERE / "flare_peer" / "client.py"
FLARE_ROUND_START = re.compile(r"Round (\d+) started\.")
FLARE_FINISHED = re.compile(r"Finished FedAvg\.")
WORKLOAD_ENV, RESULT_ENV = "MEDFLARE_PEER_WORKLOAD", "MEDFLARE_PEER_RESULT"  # read by flower_peer/apps.py
SIDE_TIMEOUT = 1200.0  # default --side-timeout: a side that hangs (seen once: Flower's deployment) is ended
SUBMIT_TIMEOUT = 180.0
PR_SET_CHILD_SUBREAPER = 36


# ----- the workload both sides read ---------------------------------------------------------------------------
def workload(run: Any, steps: int) -> dict[str, Any]:
    """Rounds, each site's spec and the sha256 of its partition as medflare's data code builds it."""
    from fedavg_site import partition_digest, site_data

    specs = site_specs(run, steps)
    return {"rounds": run.rounds, "sites": [dataclasses.asdict(spec) for spec in specs],
            "digests": {spec.name: partition_digest(site_data(spec)) for spec in specs}}


def model_state_bytes(spec: dict[str, Any]) -> int:
    """Bytes of the model's state as the bare loop pipes it (each array at its own dtype)."""
    from fedavg_site import spec_from_dict

    return int(sum(array.nbytes for array in initial_state(spec_from_dict(spec)).values()))


# ----- one side: raw records to comparable figures ------------------------------------------------------------
def flower_walls(rounds: list[dict[str, Any]]) -> list[float]:
    """Round start to the next round's start; the last round: start to aggregated (medflare's definition)."""
    starts = [r["started_at"] for r in rounds]
    return [b - a for a, b in zip(starts, starts[1:])] + [rounds[-1]["aggregated_at"] - starts[-1]]


def flower_round_parts(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Where a Flower round goes (mean s, rounds 2..R, the site whose reply came last), from the clients' clocks:
    ``dispatch`` round start to the client's handler (deployment: the SuperNode's pull, a new ClientApp process,
    its imports), ``set_up`` the handler's time besides the site's work (building the site in a new process,
    Adam's state in and out of the context), ``work``, and ``return`` handler end to aggregated."""
    parts: dict[str, list[float]] = {}
    for r in later_rounds(rounds):
        last = max(r["sites"], key=lambda s: s["left_at"])
        entry = {"dispatch": last["entered_at"] - r["started_at"],
                 "set_up": last["left_at"] - last["entered_at"] - last["work"], "work": last["work"],
                 "return": r["aggregated_at"] - last["left_at"]}
        for name, value in entry.items():
            parts.setdefault(name, []).append(value)
    return {name: sum(values) / len(values) for name, values in parts.items()}


def normalise(side: str, raw: dict[str, Any], state_bytes: int) -> dict[str, Any]:
    """Per round walls and each site's work, and bytes per site and round up and down (None: not recorded)."""
    rounds = raw["rounds"]
    if side == "bare":
        return {"walls": [r["wall"] for r in rounds], "work": [[s["work"] for s in r["sites"]] for r in rounds],
                "bytes_up": state_bytes, "bytes_down": state_bytes}
    if side in MEDFLARE_ENV:
        sent = [b for entry in raw.get("payload", {}).values() for b in entry["bytes_per_round"]]
        return {"walls": [r["wall"] for r in rounds], "work": [list(r["work"].values()) for r in rounds],
                "bytes_up": max(sent) if sent else None, "bytes_down": None}
    if side.startswith("flare"):  # FLARE's own FedAvg: bytes are not recorded on that side
        return {"walls": flower_walls(rounds), "work": [[s["work"] for s in r["sites"]] for r in rounds],
                "bytes_up": None, "bytes_down": None, "parts": flower_round_parts(rounds)}
    errors = [e for r in rounds for e in r.get("errors", [])]
    if errors:
        raise RuntimeError(f"{side}: {len(errors)} client error(s), first: {errors[0]}")
    return {"walls": flower_walls(rounds), "work": [[s["work"] for s in r["sites"]] for r in rounds],
            "bytes_up": max(b for r in rounds for b in r["bytes_up"]),
            "bytes_down": max(b for r in rounds for b in r["bytes_down"]), "parts": flower_round_parts(rounds)}


def side_figures(rounds: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """One side's row: seconds per round and coordination (rounds 2..R), with what the driver measured."""
    walls = rounds["walls"]
    coordination = [wall - max(work) for wall, work in zip(walls, rounds["work"])]
    return {"round_seconds": mean_later_rounds(walls), "coordination_seconds": mean_later_rounds(coordination),
            "first_round_seconds": walls[0], "rounds": len(walls), "walls": walls,
            "bytes_up": rounds["bytes_up"], "bytes_down": rounds["bytes_down"], "parts": rounds.get("parts"),
            **measured}


def compare(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios to bare, and per engine pair whether medflare's round is at or below Flower's, and by how much."""
    bare = sides.get("bare", {}).get("round_seconds")
    for figures in sides.values():
        figures["ratio_to_bare"] = figures["round_seconds"] / bare if bare else None
    goals = {}
    for mode, (ours, theirs) in PAIRS.items():
        if ours in sides and theirs in sides:
            gap = sides[ours]["round_seconds"] - sides[theirs]["round_seconds"]
            goals[mode] = {"medflare": ours, "flower": theirs, "met": gap <= 0, "gap_seconds": gap,
                           "gap_percent": 100 * gap / sides[theirs]["round_seconds"]}
    floors = {ours: {"flare": theirs, "gap_seconds": sides[ours]["round_seconds"] - sides[theirs]["round_seconds"],
                     "coordination_gap_seconds": sides[ours]["coordination_seconds"]
                     - sides[theirs]["coordination_seconds"],
                     "server_growth": (_growth(sides[ours]), _growth(sides[theirs]))}
              for ours, theirs in FLOORS.items() if ours in sides and theirs in sides}
    return {"sides": sides, "goals": goals, "floors": floors}


def _growth(figures: dict[str, Any]) -> float | None:
    return (figures.get("server_memory") or {}).get("growth_after_round_3")


def floor_line(side: str, floor: dict[str, Any]) -> str:
    ours, flare = floor.get("server_growth") or (None, None)
    memory = (f"; the server's memory after round 3 grew {100 * ours:+.1f} % against FLARE's {100 * flare:+.1f} %"
              f" (goal <= 5 %)" if ours is not None and flare is not None else "")
    return (f"{side} against FLARE's own FedAvg ({floor['flare']}): {floor['gap_seconds']:+.2f} s/round, "
            f"coordination {floor['coordination_gap_seconds']:+.2f} s/round (positive: medflare's own cost above "
            f"FLARE's floor){memory}")


def goal_line(mode: str, goal: dict[str, Any]) -> str:
    verdict = "met" if goal["met"] else "missed"
    relation = "below" if goal["gap_seconds"] <= 0 else "above"
    return (f"{mode}: medflare ({goal['medflare']}) at or below Flower ({goal['flower']}): **{verdict}**, "
            f"{abs(goal['gap_seconds']):.2f} s/round ({abs(goal['gap_percent']):.1f} %) {relation} Flower")


def markdown(config: dict[str, Any], cells: dict[str, dict[str, Any]]) -> str:
    """results.md: one table per model and site count, then the goals."""
    lines = ["# Peer benchmark: medflare vs Flower 1.42 on the same FedAvg work (and the bare PyTorch loop)", "",
             f"Config: `{json.dumps(config)}`", ""]
    for cell, result in cells.items():
        lines += [f"## {cell}", "",
                  "| side | device | s/round (rounds 2..R) | ratio to bare | coordination s/round | first round s "
                  "| whole job s | CPU-s | peak memory GiB | MB up / site-round | MB down / site-round |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for side, f in result["sides"].items():
            lines.append(
                f"| {side} | {f['device']} | {f['round_seconds']:.2f} | {_fmt(f['ratio_to_bare'])} | "
                f"{f['coordination_seconds']:.2f} | {f['first_round_seconds']:.2f} | {f['total_seconds']:.1f} | "
                f"{_fmt(f['cpu_seconds'], 0)} | {_fmt(_gib(f['peak_rss_bytes']), 2)} | {_fmt(_mb(f['bytes_up']), 1)} | "
                f"{_fmt(_mb(f['bytes_down']), 1)} |")
        lines += [""] + [f"- {goal_line(mode, goal)}" for mode, goal in result["goals"].items()]
        lines += [f"- {floor_line(side, floor)}" for side, floor in result.get("floors", {}).items()]
        lines += [f"- {side}: **failed**, no figures ({why})" for side, why in result.get("failed", {}).items()] + [""]
        lines += [f"- where a {side} round goes (s, rounds 2..R, last site): "
                  + ", ".join(f"{name} {value:.2f}" for name, value in f["parts"].items())
                  for side, f in result["sides"].items() if f.get("parts")] + [""]
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _mb(value: float | None) -> float | None:
    return None if value is None else value / 1e6


def _gib(value: float | None) -> float | None:
    return None if value is None else value / 2**30


def peak_tree_rss(traces: dict[int, Any]) -> int | None:
    """The largest summed VmRSS over one sampling pass of the side's process tree (shared pages per process)."""
    by_pass: dict[float, int] = {}
    for trace in traces.values():
        for at, rss, _ in trace.samples:
            by_pass[at] = by_pass.get(at, 0) + rss
    return max(by_pass.values()) if by_pass else None


# ----- running a side -----------------------------------------------------------------------------------------
def side_command(side: str, args: argparse.Namespace, model: str, clients: int, result: Path) -> list[str]:
    """What runs a side: Flower's simulation in its venv; the rest as this script's ``--side`` mode."""
    if side == "flower-sim":
        return [str(flower_bin(args, "python")), "-m", "flower_peer.simulate"]
    cell = ["--models", model, "--clients", str(clients), "--rounds", str(args.rounds), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--data", args.data, "--seed", str(args.seed),
            "--flower-venv", str(args.flower_venv)]
    return [sys.executable, str(Path(__file__).resolve()), "--side", side, "--result", str(result), *cell]


def flower_bin(args: argparse.Namespace, name: str) -> Path:
    return Path(args.flower_venv) / "bin" / name


def side_env(workload_file: Path, result: Path) -> dict[str, str]:
    """Flower's processes find the app, the shared site code and medflare's data and model code on PYTHONPATH."""
    paths = [str(APP_DIR), str(HERE), str(ROOT / "custom"), os.environ.get("PYTHONPATH", "")]
    # absolute: FLARE's simulator runs a site's script in the site's own workspace folder
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            WORKLOAD_ENV: str(workload_file.resolve()), RESULT_ENV: str(result.resolve()),
            "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def adopt_orphans() -> None:
    """Make this process a child subreaper (Linux): what a side's processes orphan (Ray's and Flower's daemons,
    whose parents die first) is reparented here instead of to init, so :func:`end_leftovers` reaps it and its CPU
    time counts in ``RUSAGE_CHILDREN``."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans go to init and their CPU time is not counted
        pass


def own_children() -> set[int]:
    """The pids of this process's children now."""
    import psutil

    return {child.pid for child in psutil.Process().children()}


def end_leftovers(spared: set[int]) -> None:
    """End and reap every child still here after a side, except those this process had before it (``spared``):
    sides run one at a time, so the others are the side's (orphans adopted included); a process that calls this, a
    test session say, keeps the children it had, and their exit statuses stay theirs to collect."""
    import psutil

    from medflare.console.processes import end_processes

    end_processes([child for child in psutil.Process().children() if child.pid not in spared])  # reaps them too


def run_side(side: str, command: list[str], env: dict[str, str], log: Path, result: Path,
             timeout: float = SIDE_TIMEOUT) -> dict[str, Any]:
    """Run one side under a keeper; wall, CPU-seconds and peak memory of its whole process tree, and its record."""
    import scaling

    from medflare.console.processes import end_processes, start_kept

    result.unlink(missing_ok=True)
    spared = own_children()
    cpu, launched = children_cpu_seconds(), time.perf_counter()
    with log.open("w") as out, scaling.TreeSampler(interval=1.0) as sampler:
        keeper = start_kept(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            code = keeper.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = f"ended after the side timeout of {timeout:.0f} s"
        finally:
            end_processes([keeper])  # the keeper ends everything the side started
            end_leftovers(spared)
    measured = {"total_seconds": time.perf_counter() - launched, "cpu_seconds": children_cpu_seconds() - cpu,
                "peak_rss_bytes": peak_tree_rss(sampler.traces)}
    if code != 0 or not result.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{side} failed (exit {code}); its log: {log}\n{tail}")
    raw = json.loads(result.read_text())
    return {"raw": raw, "measured": {**measured, "server_memory": server_memory(side, sampler.traces, raw["rounds"])}}


def server_memory(side: str, traces: dict[int, Any], rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The server's peak RSS and the growth of its high-water mark after round 3 (``scaling.py``'s measure, goal
    <= 5 %), for the sides whose server is FLARE's simulator: medflare's and FLARE's own FedAvg, the floor."""
    import scaling

    if side not in SIMULATOR_SERVERS:
        return None
    starts, last = [r["started_at"] for r in rounds], rounds[-1]
    ends = starts[1:] + [starts[-1] + last["wall"] if "wall" in last else last["aggregated_at"]]
    records = [{"started_at": start, "wall_seconds": end - start} for start, end in zip(starts, ends)]
    server = scaling.memory_figures(traces, {"rounds": records}).get("server")
    return {key: server[key] for key in ("peak_bytes", "growth_after_round_3", "high_water_by_round")} if server else None


def measure_cell(args: argparse.Namespace, model: str, clients: int, out: Path,
                 on_side: Callable[[dict[str, Any]], None] = lambda cell: None) -> dict[str, Any]:
    """Every requested side on one model and site count; ``on_side`` gets the cell so far after each side."""
    run = overhead.build_run(argparse.Namespace(**{**vars(args), "model": model}), clients)
    out.mkdir(parents=True, exist_ok=True)
    load = workload(run, args.steps)
    workload_file = out / "workload.json"
    workload_file.write_text(json.dumps(load, indent=1))
    state_bytes = model_state_bytes(load["sites"][0])
    sides, failed = {}, {}
    for side in args.sides:
        result = out / f"{side}.json"
        print(f"{model}, {clients} site(s): {side} ...", flush=True)
        try:
            ran = run_side(side, side_command(side, args, model, clients, result), side_env(workload_file, result),
                           out / f"{side}.log", result, args.side_timeout)
        except RuntimeError as exc:  # one side's failure is reported; the other sides still run
            failed[side], *tail = str(exc).splitlines()  # the table keeps the line; the console also the log's end
            print(f"  {side}: FAILED: {failed[side]}", *(f"    | {line}" for line in tail), sep="\n", flush=True)
            continue
        sides[side] = side_figures(normalise(side, ran["raw"], state_bytes), {**ran["measured"], "device": device()})
        print(f"  {side}: {sides[side]['round_seconds']:.2f} s/round, whole job {sides[side]['total_seconds']:.0f} s",
              flush=True)
        on_side({**compare(sides), "failed": failed})
    return {**compare(sides), "failed": failed}


def device() -> str:
    """The device every side trains on (each picks CUDA when there is one, as medflare's sites do)."""
    import torch

    return f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else f"cpu ({cpu_model()})"


# ----- the sides that run as this script ----------------------------------------------------------------------
def run_here(args: argparse.Namespace) -> None:
    """``--side``: run one side in this process (and its children) and write its raw record to ``--result``."""
    model, clients, result = args.models[0], args.clients[0], Path(args.result)
    run = overhead.build_run(argparse.Namespace(**{**vars(args), "model": model}), clients)
    if args.side == "bare":
        record = {"rounds": overhead.bare_run(run, args.steps)["rounds"]}
    elif args.side in MEDFLARE_ENV:
        flare = overhead.flare_run(run, result.with_suffix(""), MEDFLARE_ENV[args.side])
        record = {"rounds": flare["rounds"], "payload": flare["summary"].get("payload", {})}
    elif args.side == "flare-sim":
        record = {"rounds": flare_fedavg(clients, result)}
    else:
        deploy_flower(args, clients, result)
        return
    result.write_text(json.dumps(record))


def flare_fedavg(clients: int, result: Path) -> list[dict[str, Any]]:
    """FLARE's own ``FedAvgRecipe`` in ``SimEnv`` with ``flare_peer/client.py``: its rounds as Flower's side records
    them (start, aggregated, each site's stamps), from the server's log and the sites' lines."""
    from nvflare.app_opt.pt.recipes.fedavg import FedAvgRecipe
    from nvflare.recipe import SimEnv

    load = json.loads(Path(os.environ[WORKLOAD_ENV]).read_text())
    spec = load["sites"][0]
    model = {"class_path": "flare_peer.model.PeerNet",
             "args": {name: spec[name] for name in ("model", "num_classes", "in_channels", "image_size", "seed")}}
    recipe = FedAvgRecipe(name="flare-fedavg", model=model, min_clients=clients,
                          num_rounds=load["rounds"], train_script=str(FLARE_CLIENT), command=f"{sys.executable} -u")
    workspace = result.with_name(result.stem + "-workspace")
    for old in result.parent.glob(f"{result.name}.*.jsonl"):
        old.unlink()
    recipe.execute(SimEnv(num_clients=clients, workspace_root=str(workspace)))
    return flare_rounds(workspace, result, [s["name"] for s in load["sites"]])


def flare_rounds(workspace: Path, result: Path, sites: list[str]) -> list[dict[str, Any]]:
    """Round starts and the end from FLARE's FedAvg log lines, with each site's own round lines."""
    from round_timeline import stamp_seconds

    log = next(path for path in workspace.rglob("log.txt") if "server" in path.parts)
    starts, finished, when = {}, None, None
    for line in log.read_text(errors="replace").splitlines():  # FedAvg's banners continue a stamped line
        when = stamp_seconds(line) or when
        if when is None:
            continue
        if match := FLARE_ROUND_START.search(line):
            starts[int(match.group(1))] = when
        elif FLARE_FINISHED.search(line):
            finished = when
    by_site = {name: {entry["round"]: entry for entry in map(json.loads, Path(f"{result}.{name}.jsonl").open())}
               for name in sites}
    order = sorted(starts)
    ends = [starts[r] for r in order[1:]] + [finished]
    return [{"started_at": starts[r], "aggregated_at": end, "sites": [by_site[name][r] for name in sites]}
            for r, end in zip(order, ends)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the SuperLink exited ({process.returncode}) before listening on {port}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the SuperLink did not listen on {port} within {timeout:.0f} s")


def deploy_flower(args: argparse.Namespace, clients: int, result: Path) -> None:
    """Flower's deployment engine on loopback: SuperLink, one SuperNode per site, ``flwr run``; the ServerApp
    writes ``result`` when its last round is done. Everything started here is ended on the way out."""
    from medflare.console.processes import end_processes

    home = result.with_suffix("").with_name(result.stem + "-flwr-home")
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    # Flower starts its helpers (flower-superexec, flwr-serverapp, flwr-clientapp) by name, from PATH
    env = {**os.environ, "FLWR_HOME": str(home),
           "PATH": os.pathsep.join([str(flower_bin(args, "")), os.environ.get("PATH", "")])}
    processes: list[subprocess.Popen] = []
    try:
        superlink = subprocess.Popen([str(flower_bin(args, "flower-superlink")), "--insecure", "--port", str(port),
                                      "--disable-runtime-dependency-installation"], env=env)
        processes.append(superlink)
        wait_for_port(port, superlink)
        for index in range(clients):
            processes.append(subprocess.Popen(
                [str(flower_bin(args, "flower-supernode")), "--insecure", "--superlink", f"127.0.0.1:{port}",
                 "--port", str(free_port()), "--node-config", f"partition-id={index} num-partitions={clients}"],
                env=env))
        subprocess.run([str(flower_bin(args, "flwr")), "run", str(APP_DIR), "bench"], env=env, check=True,
                       timeout=SUBMIT_TIMEOUT)
        while not result.is_file():  # the ServerApp writes it after its last round
            if any(p.poll() is not None for p in processes):
                raise RuntimeError("a Flower process exited before the run finished")
            time.sleep(0.5)
    finally:
        end_processes(processes)


# ----- command line -------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "cnn"])
    parser.add_argument("--clients", type=int, nargs="+", default=[2], help="site counts, one table each")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per site and round (0 = one epoch)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--data", default=f"medmnist:{overhead.DATA}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--flower-venv", default=str(DEFAULT_FLOWER_VENV),
                        help="Flower's own virtual environment (flwr 1.42, torch, numpy)")
    parser.add_argument("--side-timeout", type=float, default=SIDE_TIMEOUT,
                        help="seconds a side may run before it is ended and reported as failed")
    parser.add_argument("--quick", action="store_true", help="cnn, 2 sites, 3 rounds, 5 steps")
    parser.add_argument("--out", default="runs/bench-peer")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: run one side here
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # what overhead.build_run reads besides these: medflare's defaults of the overhead benchmark
    args.task_request_interval, args.transfer_dtype = 0.1, "float32"
    if args.quick:
        args.models, args.clients, args.rounds, args.steps = ["cnn"], [2], 3, 5
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: round 1 holds the start-up and is left out of the mean")
    running = [args.side] if args.side else args.sides
    if any(side.startswith("flower") for side in running) and not flower_bin(args, "flwr").is_file():
        parser.error(f"no Flower environment at {args.flower_venv}: run `make bench-peer`, which makes it")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.side:
        run_here(args)
        return {}
    out = Path(args.out)
    adopt_orphans()
    config = {k: v for k, v in vars(args).items() if k not in ("out", "side", "result", "flower_venv")}
    cells: dict[str, dict[str, Any]] = {}
    for model in args.models:
        for clients in args.clients:
            name = f"{model}, {clients} sites"

            def publish(cell: dict[str, Any], name: str = name) -> None:
                write_results(out, config, {**cells, name: cell})  # a run ended early keeps every finished side

            cells[name] = measure_cell(args, model, clients, out / f"{model}-{clients}", on_side=publish)
    write_results(out, config, cells)
    print(f"written: {out / 'results.md'}, {out / 'results.json'}")
    return cells


def write_results(out: Path, config: dict[str, Any], cells: dict[str, dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"config": config, "cells": cells}, indent=2) + "\n")
    (out / "results.md").write_text(markdown(config, cells))


if __name__ == "__main__":
    from medflare.console.processes import stop_on_signals

    with stop_on_signals():
        main()
