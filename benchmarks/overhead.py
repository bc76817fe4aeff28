"""Framework cost, fairly: medflare in FLARE's simulator (or a POC) against a bare PyTorch FedAvg, same parallelism.

Both sides train the same model on the same site partitions (one local epoch, or ``--steps`` optimizer steps),
score the received model on every site's val and test split each round, and average the weights. The simulator
runs one process per site; so does the bare side (``multiprocessing``, one torch thread per site as medflare
sets), whose coordinator averages in float64 and sends the weights through pipes. Reported per site count:

- wall: whole job with start-up (launch to last round done) and mean round without it (rounds 2..R), their ratios;
- first round over a later one (start-up that leaks into round 1);
- per-round coordination overhead = round wall - the slowest site's local work (its evaluation, weight loading,
  training, encoding, state save), on both sides; and, for medflare, where it goes (from the controller's
  ``server_seconds`` and each site's ``task_seconds`` records): result transport and polling, the server's
  evaluation bookkeeping, aggregation and checkpoint;
- trainer throughput: images per second of training, medflare's LocalTrainer against the bare step;
- CPU-seconds of each side (its processes, including the children they waited for; not counted in a POC);
- bytes a site sends per round against the model's float32 size.

Goals (issue 15): ratio <= 1.05, overhead <= 0.3 s per round, throughput >= 0.95x bare, first round <= 2x a later
one, bytes <= 1.05x the fp32 parameters. Results: ``results.json`` and ``results.md`` under ``--out``.

Usage:
    python benchmarks/overhead.py                          # ResNet-18, PneumoniaMNIST, 2 and 4 sites, 10 rounds
    python benchmarks/overhead.py --quick                  # 1-2 min sanity run (2 sites, 3 rounds, 5 steps)
    python benchmarks/overhead.py --clients 1 --rounds 6 --steps 20 --model resnet18   # simplest fair check
    python benchmarks/overhead.py --env poc --clients 2 --out runs/bench-overhead-poc  # medflare in a POC
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from benchmarking import goal_verdict, later_rounds, mean_later_rounds, model_fp32_bytes, trained_images

from medflare.plan import resolve, task_of

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist" / "pneumoniamnist.npz"
GOALS = {"ratio": 1.05, "overhead_seconds": 0.3, "throughput": 0.95, "first_round": 2.0, "bytes": 1.05}
SITE_OVERHEAD_SPANS = ("receive", "encode", "save_state")  # a site's spans besides evaluation and training
# not inside the round's wall: the results file is written just after it, checkpoint and gc while the sites train
SERVER_SPANS_OUTSIDE_WALL = ("results_file", "best_model", "checkpoint", "gc")


# ----- the bare side: one process per site, a coordinator that averages -------------------------------------
def bare_site(run_fields: dict[str, Any], index: int, steps: int, conn: Any) -> None:
    """One bare site (``fedavg_site.FedAvgSite``: receive weights, score val and test, train), sending weights and
    timings back; until told to stop."""
    from fedavg_site import FedAvgSite, site_specs  # benchmarks/, on the path the spawned site inherits

    from medflare.run_config import RunConfig

    site = FedAvgSite(site_specs(RunConfig(**run_fields), steps)[index])
    conn.send(("ready", site.n_train))
    while (params := conn.recv()) is not None:
        conn.send(site.round(params))


def bare_run(run: Any, steps: int) -> dict[str, Any]:
    """FedAvg by hand over one process per site; wall, per-round and per-site timings, CPU-seconds."""
    import torch

    from medflare.models import create_model

    launched, cpu = time.perf_counter(), cpu_seconds()
    context = mp.get_context("spawn")
    pipes, processes = [], []
    try:
        for index in range(run.clients):
            ours, theirs = context.Pipe()
            process = context.Process(target=bare_site, args=(dataclasses.asdict(run), index, steps, theirs),
                                      daemon=True)
            process.start()
            pipes.append(ours)
            processes.append(process)
        sizes = [pipe.recv()[1] for pipe in pipes]
        task = task_of(run)
        torch.manual_seed(run.seed)
        global_model = create_model(run.model, task.num_classes, task.in_channels, image_size=task.image_size)
        params = {k: v.detach().numpy().copy() for k, v in global_model.state_dict().items()}
        rounds = []
        for _ in range(run.rounds):
            started = time.perf_counter()
            for pipe in pipes:
                pipe.send(params)
            replies = [pipe.recv() for pipe in pipes]
            params = average([state for state, _ in replies], sizes)
            rounds.append({"wall": time.perf_counter() - started, "sites": [timing for _, timing in replies]})
            print(f"  bare, {run.clients} site(s): round {len(rounds)}/{run.rounds} {rounds[-1]['wall']:.2f} s",
                  flush=True)
        for pipe in pipes:
            pipe.send(None)
        for process in processes:
            process.join(timeout=60)
    finally:
        for process in processes:  # an interrupted benchmark leaves no site behind
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
    return {"total_seconds": time.perf_counter() - launched, "cpu_seconds": cpu_seconds() - cpu, "rounds": rounds}


def average(states: list[dict[str, np.ndarray]], sizes: list[int]) -> dict[str, np.ndarray]:
    """Sample-weighted average in float64, stored in each array's own dtype (integers rounded)."""
    weights = np.asarray(sizes, np.float64) / sum(sizes)
    averaged = {}
    for key, first in states[0].items():
        total = np.asarray(sum(weight * state[key].astype(np.float64) for weight, state in zip(weights, states)))
        averaged[key] = np.rint(total).astype(first.dtype) if first.dtype.kind in "iub" else total.astype(first.dtype)
    return averaged


def cpu_seconds() -> float:
    """User + system CPU-seconds of this process and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# ----- the medflare side --------------------------------------------------------------------------------------
def flare_run(run: Any, out: Path, env: str = "sim") -> dict[str, Any]:
    """The same job in FLARE's simulator (or a POC); per-round walls and the sites' and server's own spans.

    In a POC the server and site processes are started by FLARE's start scripts, not as this process's
    children, so their CPU-seconds are not counted (None); the whole-job time runs from starting the POC (its
    processes, which in production run all the time) to the end of the last round."""
    if env == "poc":
        from medflare.console.deploy.poc import run_poc

        summary = run_poc(resolve(run, "byoc", deployed=True), out, echo=print, overwrite=True)
        total, cpu = summary["timing"]["total_seconds"], None
    else:
        from medflare.console.simulate import run_simulation

        cpu, launched = cpu_seconds(), time.perf_counter()
        summary = run_simulation(resolve(run, "byoc"), out, echo=print, overwrite=True)  # its progress lines only
        total, cpu = time.perf_counter() - launched, cpu_seconds() - cpu
    results = json.loads((out / "medflare_results.json").read_text())
    return {"total_seconds": total, "cpu_seconds": cpu, "summary": summary,
            "rounds": flare_rounds(results, site_spans(out))}


def site_spans(out: Path) -> dict[str, dict[int, dict[str, float]]]:
    """site -> round -> the spans of its train task, from each site's own log (copied out by the simulator)."""
    spans: dict[str, dict[int, dict[str, float]]] = {}
    for log in sorted(out.glob("sites/*/medflare_site_log.jsonl")):
        for line in log.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if record.get("event") == "task_seconds":
                spans.setdefault(log.parent.name, {})[int(record["round"])] = record["seconds"]
    return spans


def flare_rounds(results: dict[str, Any], spans: dict[str, dict[int, dict[str, float]]]) -> list[dict[str, Any]]:
    """Per round: wall (start to the next round's start; the last: start to aggregated), each site's work and
    the moment its result reached the server, and the server's spans."""
    records = results["rounds"]
    rounds = []
    for i, record in enumerate(records):
        later = records[i + 1]["started_at"] if i + 1 < len(records) else None
        wall = later - record["started_at"] if later is not None else record["wall_seconds"]
        sites = {site: sum(spans[site][record["round"]].values()) for site in spans if record["round"] in spans[site]}
        arrived = {site: facts.get("result_at") for site, facts in record.get("sites", {}).items()}
        train = {site: facts.get("train_seconds") for site, facts in record.get("sites", {}).items()}
        rounds.append({"started_at": record["started_at"], "wall": wall, "work": sites, "result_at": arrived, "train": train,
                       "server": record.get("server_seconds", {}),
                       "spans": {site: spans[site].get(record["round"], {}) for site in spans}})
    return rounds


# ----- figures --------------------------------------------------------------------------------------------------
def coordination(rounds: list[dict[str, Any]], work_of: Callable[[dict[str, Any]], list[float]]) -> list[float]:
    """Round wall minus the slowest site's local work, per round."""
    return [r["wall"] - max(work_of(r)) for r in rounds]


def where_it_goes(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per round (rounds 2..R) of medflare's coordination, by part.

    ``transport``: from the round's start to the slowest site's result at the controller, minus that site's
    work (sending the task, the site's poll, sending the result back). ``server.*``: the controller's spans
    (``results_file``, ``checkpoint`` and ``gc`` lie outside the round's wall, so ``other`` leaves them out).
    ``site.*``: that site's non-training spans (inside its work). ``other``: the rest of the round's wall (the
    controller's polling, FLARE's bookkeeping, the results file).
    """
    parts: dict[str, list[float]] = {}
    for r in later_rounds(rounds):
        slowest = max(r["work"], key=r["work"].get)
        transport = (r["result_at"].get(slowest) or 0.0) - r["work"][slowest]
        entry = {"transport": transport, **{f"server.{k}": v for k, v in r["server"].items()}}
        entry.update({f"site.{name}": r["spans"][slowest].get(name, 0.0) for name in SITE_OVERHEAD_SPANS})
        on_path = sum(v for k, v in r["server"].items() if k not in SERVER_SPANS_OUTSIDE_WALL)
        entry["other"] = r["wall"] - r["work"][slowest] - transport - on_path
        for name, value in entry.items():
            parts.setdefault(name, []).append(value)
    return {name: statistics.mean(values) for name, values in parts.items()}


def throughput(rounds: list[dict[str, Any]], images_per_site: dict[str, int] | None = None) -> float:
    """Images per second of training, summed over sites and rounds 2..R (each side's own clock of training)."""
    rows = later_rounds(rounds)
    if images_per_site is None:  # bare: every site counts its images
        return sum(s["images"] for r in rows for s in r["sites"]) / sum(s["train"] for r in rows for s in r["sites"])
    return (sum(images_per_site[site] for r in rows for site in r["train"])
            / sum(seconds for r in rows for seconds in r["train"].values()))


def compare(bare: dict[str, Any], flare: dict[str, Any], run: Any, steps: int, model_bytes: int) -> dict[str, Any]:
    """Every figure of one site count, with its goal."""
    bare_walls, flare_walls = [r["wall"] for r in bare["rounds"]], [r["wall"] for r in flare["rounds"]]
    bare_overhead = coordination(bare["rounds"], lambda r: [s["work"] for s in r["sites"]])
    flare_overhead = coordination(flare["rounds"], lambda r: list(r["work"].values()))
    clients = flare["summary"].get("clients", {})
    batch = int(run.train.get("batch_size", 64))
    images = {site: trained_images(int(facts["n_samples_reported"]), batch, steps) for site, facts in clients.items()}
    sent = [b for entry in flare["summary"].get("payload", {}).values() for b in entry["bytes_per_round"]]
    bare_round, flare_round = mean_later_rounds(bare_walls), mean_later_rounds(flare_walls)
    figures = {
        "wall_ratio_with_startup": flare["total_seconds"] / bare["total_seconds"],
        "round_ratio_without_startup": flare_round / bare_round,
        "bare_round_seconds": bare_round, "flare_round_seconds": flare_round,
        "bare_total_seconds": bare["total_seconds"], "flare_total_seconds": flare["total_seconds"],
        "flare_startup_seconds": flare["summary"]["timing"].get("startup_seconds"),
        "first_round_over_later": {"bare": bare_walls[0] / bare_round, "flare": flare_walls[0] / flare_round},
        "coordination_seconds_per_round": {"bare": mean_later_rounds(bare_overhead),
                                           "flare": mean_later_rounds(flare_overhead)},
        "flare_coordination_parts": where_it_goes(flare["rounds"]),
        "train_images_per_second": {"bare": throughput(bare["rounds"]), "flare": throughput(flare["rounds"], images)},
        "cpu_seconds": {"bare": bare["cpu_seconds"], "flare": flare["cpu_seconds"]},
        "bytes_per_site_round_over_fp32_model": max(sent) / model_bytes if sent else None,
        "per_round_seconds": {"bare": bare_walls, "flare": flare_walls},
    }
    tp = figures["train_images_per_second"]
    figures["throughput_ratio"] = tp["flare"] / tp["bare"]
    bytes_ratio = figures["bytes_per_site_round_over_fp32_model"]
    figures["goals_met"] = {
        "ratio": figures["round_ratio_without_startup"] <= GOALS["ratio"],
        "overhead_seconds": figures["coordination_seconds_per_round"]["flare"] <= GOALS["overhead_seconds"],
        "throughput": figures["throughput_ratio"] >= GOALS["throughput"],
        "first_round": figures["first_round_over_later"]["flare"] <= GOALS["first_round"],
        "bytes": bytes_ratio is not None and bytes_ratio <= GOALS["bytes"],
    }
    return figures


def markdown(config: dict[str, Any], by_clients: dict[str, dict[str, Any]]) -> str:
    """results.md: one table row per site count, then where medflare's coordination time goes."""
    where = "a FLARE POC" if config.get("env") == "poc" else "FLARE's simulator"
    lines = [
        f"# Framework cost: medflare in {where} vs a bare PyTorch FedAvg (one process per site on both)",
        "", f"Config: `{json.dumps(config)}`", "",
        "| sites | bare s/round | medflare s/round | ratio (goal <= 1.05) | whole-job ratio (with start-up) "
        "| coordination s/round bare / medflare (goal <= 0.3) | train img/s bare / medflare (ratio, goal >= 0.95) "
        "| first / later round, medflare (goal <= 2) | CPU-s bare / medflare | bytes / fp32 model (goal <= 1.05) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for clients, f in by_clients.items():
        c, t, cpu = f["coordination_seconds_per_round"], f["train_images_per_second"], f["cpu_seconds"]
        lines.append(
            f"| {clients} | {f['bare_round_seconds']:.2f} | {f['flare_round_seconds']:.2f} | "
            f"{f['round_ratio_without_startup']:.3f} | {f['wall_ratio_with_startup']:.3f} | "
            f"{c['bare']:.2f} / {c['flare']:.2f} | {t['bare']:.0f} / {t['flare']:.0f} ({f['throughput_ratio']:.3f}) | "
            f"{f['first_round_over_later']['flare']:.2f} | {cpu['bare']:.0f} / {_fmt(cpu['flare'], 0)} | "
            f"{_fmt(f['bytes_per_site_round_over_fp32_model'])} |"
        )
    lines += ["", "Where medflare's coordination time goes (mean s per round, rounds 2..R; slowest site):", ""]
    names = sorted({name for f in by_clients.values() for name in f["flare_coordination_parts"]})
    lines += ["| sites | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for clients, f in by_clients.items():
        lines.append(f"| {clients} | " + " | ".join(_fmt(f["flare_coordination_parts"].get(n)) for n in names) + " |")
    lines += [""] + [f"- {c} sites: " + "; ".join(goal_verdicts(f)) for c, f in by_clients.items()] + [""]
    return "\n".join(lines)


def goal_verdicts(f: dict[str, Any]) -> list[str]:
    """Each goal of one site count, met or missed and by how much."""
    return [goal_verdict("ratio", f["round_ratio_without_startup"], GOALS["ratio"]),
            goal_verdict("coordination", f["coordination_seconds_per_round"]["flare"], GOALS["overhead_seconds"],
                         unit=" s"),
            goal_verdict("throughput", f["throughput_ratio"], GOALS["throughput"], at_most=False),
            goal_verdict("first round / later", f["first_round_over_later"]["flare"], GOALS["first_round"]),
            goal_verdict("bytes / fp32 model", f["bytes_per_site_round_over_fp32_model"], GOALS["bytes"])]


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def build_run(args: argparse.Namespace, clients: int) -> Any:
    from medflare.run_config import RunConfig

    train = {"batch_size": args.batch_size, "local_epochs": 1, "max_steps": args.steps}
    return RunConfig(method="fedavg", model=args.model, rounds=args.rounds, clients=clients, seed=args.seed,
                     data={"source": args.data, "partition": "iid"}, train=train,
                     task_request_interval=args.task_request_interval, transfer_dtype=args.transfer_dtype,
                     name=f"overhead-{clients}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 4], help="site counts, one comparison each")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per site and round (0 = one epoch)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--data", default=f"medmnist:{DATA}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task-request-interval", type=float, default=0.1)
    parser.add_argument("--transfer-dtype", default="float32", choices=["float32", "float16"],
                        help="how medflare's weights travel (the bare side always pipes float32)")
    parser.add_argument("--env", default="sim", choices=["sim", "poc"],
                        help="where medflare's side runs: FLARE's simulator, or a real POC on this machine "
                             "(server and sites as separate FLARE processes, mTLS on loopback)")
    parser.add_argument("--quick", action="store_true", help="sanity run: 2 sites, 3 rounds, 5 steps")
    parser.add_argument("--out", default="runs/bench-overhead")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.rounds, args.steps = [2], 3, 5
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    by_clients = {}
    for clients in args.clients:
        run = build_run(args, clients)
        bare = bare_run(run, args.steps)
        flare = flare_run(run, out / f"flare-{clients}", args.env)
        figures = by_clients[str(clients)] = compare(bare, flare, run, args.steps, model_fp32_bytes(run))
        print(f"{clients} site(s): bare {figures['bare_round_seconds']:.2f} s/round, medflare "
              f"{figures['flare_round_seconds']:.2f} -> {figures['round_ratio_without_startup']:.3f}x; "
              f"coordination s/round {figures['coordination_seconds_per_round']}")
    config = {k: v for k, v in vars(args).items() if k != "out"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"config": config, "goals": GOALS, "by_clients": by_clients},
                                                 indent=2) + "\n")
    (out / "results.md").write_text(markdown(config, by_clients))
    print(f"written: {out / 'results.md'}, {out / 'results.json'}")
    return by_clients


if __name__ == "__main__":
    from medflare.console.processes import stop_on_signals

    with stop_on_signals():
        main()
