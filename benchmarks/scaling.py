"""Memory, scaling, GPU readiness and fp16 parity of medflare in FLARE's simulator (issue 15, items 3-6).

Two parts (``--part``):

``scaling``  one job per site count (``--clients``, default 2 4 8) with FIXED TOTAL data: the IID partition deals
             the same PneumoniaMNIST training pool out in 1/N shares and every site trains one local epoch per
             round, so a round trains on the whole pool whatever N is (the script checks the shares add up to
             the same total). ResNet-18 at 28 px, batch 64, 30 rounds. Per site count:
             - seconds per round: the mean of the controller's round walls, rounds 2..R (round 1 holds start-up);
             - peak RSS of the server process and of each site process, and its growth after round 3;
             - bytes a site sends per round, the sites' training images/s, and the device line below;
             then what 20 hospitals would cost per round, computed from those per-site figures
             (:func:`hospital_estimate`).
``parity``   the demo job (``hyperkvasir-like``, 4 sites, 8 rounds, Fed-MAS, ``cnn``) with weights travelling in
             float32 and in float16 (``transfer_dtype``), seeds 0 1 2: balanced accuracy mean ± std per dtype and
             the gap read with ``benchmarking.versus`` (within one std is "no difference"). Finished
             runs with the same configuration are reused (``benchmarking.run_cell``).

What the memory figures are. A thread in this process walks the process tree below it every ``--sample-seconds``
and reads each process's ``/proc/<pid>/status``: ``VmRSS`` (resident now) and ``VmHWM``, the kernel's own
high-water mark of ``VmRSS``, so a peak between two samples is not missed. A FLARE ``simulator_worker --client
site-k`` process is site-k; the process that started the workers is the server (in the simulator it runs FLARE's
server, medflare's controller and aggregator, and also the simulator's client-side messaging threads, so its
memory per site is an upper bound for a real server's); the rest (the ``nvflare simulator`` launcher,
multiprocessing's manager) is "other". Peak = a process's last ``VmHWM``. Growth after round 3 = ``VmHWM`` at the
end of the last round over ``VmHWM`` at the end of round 3, minus 1 (rounds are placed in time by the
controller's round start times); goal <= 5 %. RSS counts shared pages (torch's libraries) in every process that
maps them, so the figures are per process and do not add up to the machine's use; GPU memory is not in RSS.
Without ``/proc`` (not Linux) psutil's RSS is sampled and a peak is the largest sample.

GPU readiness. The sites pick CUDA when it is there, and medflare's trainer then runs with AMP, channels_last,
pinned memory and non-blocking copies (``methods/base.py``, ``site_runtime.py``); this script adds nothing to
that. With CUDA it prints images/s and the GPU utilisation sampled during the job (``torch.cuda.utilization``,
else ``nvidia-smi``, else "unavailable"); on a CPU machine it says that no GPU figure is claimed.

Results: ``results.json`` and ``results.md`` under ``--out``; a part run alone replaces only its own section.

Usage:
    python benchmarks/scaling.py                      # both parts (about an hour on 2 idle cores)
    python benchmarks/scaling.py --part scaling       # 2, 4 and 8 sites, 30 rounds each
    python benchmarks/scaling.py --part parity        # fp32 vs fp16, 3 seeds of the demo job
    python benchmarks/scaling.py --quick              # 1-2 min sanity run: 2 sites, 4 rounds, 3 steps
    python benchmarks/scaling.py --part scaling --clients 8 --stream-aggregation --out runs/bench-scaling-stream
                                                      # the 8-site server peak with streaming aggregation
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarking import (
    cpu_model,
    goal_verdict,
    later_rounds,
    mean_later_rounds,
    mean_std,
    model_fp32_bytes,
    run_cell,
    trained_images,
    versus,
)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist" / "pneumoniamnist.npz"
GOALS = {"rss_growth_after_round_3": 0.05}
SETTLED_ROUNDS = 3  # rounds allowed to grow memory (imports, first allocations, optimizer state)
HOSPITALS = 20
PARITY_DTYPES = ("float32", "float16")
WORKER_MODULE = "simulator_worker"  # FLARE's per-site process in the simulator
HAS_PROC = Path("/proc/self/status").is_file()  # Linux: the kernel keeps each process's RSS high-water mark
GpuReader = Callable[[], "float | None"]  # utilisation in %, None when no source answers


# ----- sampling the process tree -----------------------------------------------------------------------------------
@dataclasses.dataclass
class ProcessTrace:
    """One process seen below this one: who started it, its command line and its samples (time, RSS, HWM)."""

    ppid: int
    cmdline: list[str]
    samples: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)


def memory_status(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of a process in bytes, from ``/proc/<pid>/status``; without /proc, psutil's RSS for both
    (the peak is then the largest sample); None once the process is gone (or a zombie without VmRSS)."""
    if not HAS_PROC:
        return _sampled_rss(pid)
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        return _kib(fields["VmRSS"]), _kib(fields["VmHWM"])
    except (OSError, KeyError):
        return None


def _sampled_rss(pid: int) -> tuple[int, int] | None:
    import psutil

    try:
        rss = psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None
    return rss, rss


def _kib(field: str) -> int:
    """'  123456 kB' -> bytes."""
    return int(field.split()[0]) * 1024


class TreeSampler:
    """Samples the memory of every process below this one, and the GPU's utilisation, in a background thread.

    Use as a context manager around a simulator run; ``traces`` (pid -> :class:`ProcessTrace`) and ``gpu``
    (utilisation samples in %) hold what it saw.
    """

    def __init__(self, interval: float = 0.5, gpu: GpuReader | None = None) -> None:
        self.interval = interval
        self.read_gpu = gpu
        self.traces: dict[int, ProcessTrace] = {}
        self.gpu: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        """One pass over the tree (and the GPU)."""
        import psutil

        now = time.time()
        for child in psutil.Process(os.getpid()).children(recursive=True):
            try:
                cmdline, ppid = child.cmdline(), child.ppid()
            except psutil.Error:
                continue
            trace = self.traces.get(child.pid)
            if trace is None or trace.cmdline != cmdline:  # new, or it exec'd: earlier samples were its parent's image
                trace = self.traces[child.pid] = ProcessTrace(ppid, cmdline)
            if (reading := memory_status(child.pid)) is not None:
                trace.samples.append((now, *reading))
        if self.read_gpu is not None and (value := self.read_gpu()) is not None:
            self.gpu.append(value)


def process_roles(traces: dict[int, ProcessTrace]) -> dict[int, str]:
    """pid -> "site-k" for FLARE's simulator workers (their ``--client``), "server" for the process that started
    them, "other" for the rest."""
    roles: dict[int, str] = {}
    for pid, trace in traces.items():
        if any(WORKER_MODULE in part for part in trace.cmdline) and "--client" in trace.cmdline:
            roles[pid] = trace.cmdline[trace.cmdline.index("--client") + 1]
    parents = {traces[pid].ppid for pid in roles}
    for pid in traces:
        roles.setdefault(pid, "server" if pid in parents else "other")
    return roles


# ----- memory figures ----------------------------------------------------------------------------------------------
def round_ends(results: dict[str, Any]) -> list[float]:
    """When each round ended (epoch seconds): the next round's start, the last round's start + its wall."""
    records = results["rounds"]
    starts = [float(r["started_at"]) for r in records]
    return starts[1:] + [starts[-1] + float(records[-1]["wall_seconds"])] if records else []


def high_water_by_round(samples: list[tuple[float, int, int]], ends: list[float]) -> list[int | None]:
    """The process's VmHWM at the end of each round: its largest HWM sampled before that round ended (None when
    no sample came before it)."""
    return [max((hwm for at, _, hwm in samples if at <= end), default=None) for end in ends]


def resident_by_round(samples: list[tuple[float, int, int]], ends: list[float]) -> list[int | None]:
    """The process's VmRSS at the end of each round: its last sample before that round ended (None when none
    came before it). Unlike the high-water mark it can fall, so a rising line is memory held, while a flat one
    under a climbing mark means rare momentary peaks."""
    return [next((rss for at, rss, _ in reversed(samples) if at <= end), None) for end in ends]


def growth_after(marks: list[int | None], settled: int = SETTLED_ROUNDS) -> float | None:
    """Relative growth of the high-water mark after round ``settled``: last round's mark over round ``settled``'s,
    minus 1; None when the job had no later round or the marks are missing."""
    if len(marks) <= settled or marks[settled - 1] in (None, 0) or marks[-1] is None:
        return None
    return marks[-1] / marks[settled - 1] - 1.0


def memory_figures(traces: dict[int, ProcessTrace], results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """role -> peak RSS (bytes), growth after round 3 and the per-round high-water marks; a role that several
    processes held (a restarted site) keeps its largest peak."""
    ends = round_ends(results)
    figures: dict[str, dict[str, Any]] = {}
    for pid, role in process_roles(traces).items():
        samples = traces[pid].samples
        if not samples:
            continue
        marks = high_water_by_round(samples, ends)
        peak = max(hwm for _, _, hwm in samples)
        if role not in figures or peak > figures[role]["peak_bytes"]:
            figures[role] = {"peak_bytes": peak, "growth_after_round_3": growth_after(marks),
                             "high_water_by_round": marks, "resident_by_round": resident_by_round(samples, ends),
                             "command": " ".join(traces[pid].cmdline[:4])}
    return figures


# ----- scaling figures ---------------------------------------------------------------------------------------------
def fixed_total(train_sizes_by_clients: dict[int, list[int]]) -> int:
    """The training images every site count shares out; a ValueError when two counts split different totals
    (then the seconds per round would compare different work)."""
    totals = {clients: sum(sizes) for clients, sizes in train_sizes_by_clients.items()}
    if len(set(totals.values())) > 1:
        raise ValueError(f"the site counts do not split the same training pool: images per site count {totals}")
    return next(iter(totals.values()))


def images_per_second(summary: dict[str, Any], batch: int, steps: int) -> float | None:
    """Training images per second of training, over every site and rounds 2..R (the sites' own train clocks)."""
    images = seconds = 0.0
    for facts in summary.get("clients", {}).values():
        later = [t for t in later_rounds(facts.get("train_seconds", [])) if t]
        images += len(later) * trained_images(int(facts["n_samples_reported"]), batch, steps)
        seconds += sum(later)
    return images / seconds if seconds else None


def streaming(results: dict[str, Any]) -> dict[str, Any] | None:
    """What the rounds' records say about ``stream_aggregation`` (None when it was off): how many rounds summed
    their results as they arrived, and the most results the server held at once in any of them."""
    facts = [r["stream_aggregation"] for r in results["rounds"] if "stream_aggregation" in r]
    if not facts:
        return None
    streamed = [f for f in facts if f["mode"] == "streamed"]
    return {"streamed_rounds": len(streamed), "rounds": len(facts),
            "most_results_held": max((f["most_results_held"] for f in streamed), default=None),
            "batch_reasons": sorted({f["reason"] for f in facts if f["mode"] == "batch"})}


def upload_bytes_per_site_round(summary: dict[str, Any]) -> float:
    """Mean bytes one site sends per round (arrays and meta, as the controller counted them)."""
    return statistics.mean(b for entry in summary["payload"].values() for b in entry["bytes_per_round"])


def hospital_estimate(
    upload_per_site: float, download_per_site: float, server_peak_by_sites: dict[int, float], hospitals: int = HOSPITALS
) -> dict[str, float | None]:
    """What ``hospitals`` sites would cost per round, from the per-site figures measured with fewer sites.

    Bytes: every site receives the global model and sends its result once a round, so the server moves
    ``hospitals × (download + upload)``. Server memory: a least-squares line through the server's peak RSS
    against the site count (its slope is the memory each further site costs, its intercept the rest), read at
    ``hospitals``; None with fewer than two site counts measured.
    """
    estimate: dict[str, float | None] = {
        "hospitals": hospitals,
        "upload_bytes_per_round": hospitals * upload_per_site,
        "download_bytes_per_round": hospitals * download_per_site,
        "bytes_per_round": hospitals * (upload_per_site + download_per_site),
        "server_bytes_per_site": None, "server_base_bytes": None, "server_peak_bytes": None,
    }
    if len(server_peak_by_sites) >= 2:
        counts = sorted(server_peak_by_sites)
        slope, intercept = statistics.linear_regression(counts, [server_peak_by_sites[n] for n in counts])
        estimate.update(server_bytes_per_site=slope, server_base_bytes=intercept,
                        server_peak_bytes=intercept + slope * hospitals)
    return estimate


# ----- GPU readiness -----------------------------------------------------------------------------------------------
def gpu_utilisation_reader() -> GpuReader | None:
    """A reader of the GPU's utilisation in % (torch's NVML binding, else ``nvidia-smi``), or None without CUDA.

    The reader returns None when neither source answers, and the job's device line then says "unavailable".
    """
    import torch

    if not torch.cuda.is_available():
        return None

    def read() -> float | None:
        try:
            return float(torch.cuda.utilization())
        except Exception:  # noqa: BLE001 - no pynvml, or NVML refuses (its own error types): ask nvidia-smi
            return nvidia_smi_utilisation()

    return read


def nvidia_smi_utilisation() -> float | None:
    """GPU 0's utilisation in % from ``nvidia-smi``; None when the tool is missing or does not answer."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "--id=0"]
    try:
        answer = subprocess.run(query, capture_output=True, text=True, timeout=5, check=True).stdout
        return float(answer.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def device_line(cuda: bool, images_per_s: float | None, gpu_samples: list[float]) -> str:
    """What the run says about its device: images/s and GPU utilisation with CUDA, else that no GPU figure is
    claimed."""
    speed = "-" if images_per_s is None else f"{images_per_s:.0f}"
    if not cuda:
        return (f"device cpu ({cpu_model()}): {speed} training images/s on CPU; no GPU figure is claimed (none "
                "measured here)")
    utilisation = "unavailable"
    if gpu_samples:
        utilisation = f"{statistics.mean(gpu_samples):.0f} % (mean of {len(gpu_samples)} samples)"
    return f"device cuda (AMP, channels_last): {speed} training images/s, GPU utilisation {utilisation}"


# ----- the parts ---------------------------------------------------------------------------------------------------
def scaling_run(args: argparse.Namespace, clients: int) -> Any:
    """ResNet-18 (``--model``) FedAvg over ``clients`` IID shares of one pool, one epoch (or ``--steps``) a round."""
    from medflare.run_config import RunConfig

    train = {"batch_size": args.batch_size, "local_epochs": 1, "max_steps": args.steps}
    return RunConfig(method="fedavg", model=args.model, rounds=args.rounds, clients=clients, seed=args.seed,
                     data={"source": args.data, "partition": "iid"}, train=train, name=f"scaling-{clients}",
                     stream_aggregation=args.stream_aggregation)


def measure_site_count(args: argparse.Namespace, clients: int) -> dict[str, Any]:
    """One simulator job at ``clients`` sites, sampled throughout: its seconds, memory, bytes and device line."""
    import torch

    from medflare.console.simulate import run_simulation
    from medflare.plan import resolve

    run, out = scaling_run(args, clients), args.out / f"sites-{clients}"
    with TreeSampler(args.sample_seconds, gpu_utilisation_reader()) as sampler:
        summary = run_simulation(resolve(run, "byoc"), out, echo=print, overwrite=True)  # its progress lines only
    results = json.loads((out / "medflare_results.json").read_text())
    speed = images_per_second(summary, args.batch_size, args.steps)
    return {
        "seconds_per_round": mean_later_rounds(summary["timing"]["per_round_seconds"]),
        "startup_seconds": summary["timing"].get("startup_seconds"),
        "train_images": [int(f["n_samples_reported"]) for f in summary["clients"].values()],
        "upload_bytes_per_site_round": upload_bytes_per_site_round(summary),
        "images_per_second": speed,
        "memory": memory_figures(sampler.traces, results),
        "streaming": streaming(results),
        "gpu_utilisation_samples": sampler.gpu,
        "device": device_line(torch.cuda.is_available(), speed, sampler.gpu),
    }


def scaling_part(args: argparse.Namespace) -> dict[str, Any]:
    """Every site count, the fixed-total check, and the 20-hospital estimate."""
    by_clients = {}
    for clients in args.clients:
        figures = by_clients[clients] = measure_site_count(args, clients)
        print(f"{clients} sites: {figures['seconds_per_round']:.2f} s/round; server peak "
              f"{_mib(figures['memory'].get('server', {}).get('peak_bytes'))} MiB; {figures['device']}", flush=True)
    total = fixed_total({n: f["train_images"] for n, f in by_clients.items()})
    largest = by_clients[max(by_clients)]
    peaks = {n: f["memory"]["server"]["peak_bytes"] for n, f in by_clients.items() if "server" in f["memory"]}
    estimate = hospital_estimate(largest["upload_bytes_per_site_round"],
                                 model_fp32_bytes(scaling_run(args, max(by_clients))), peaks)
    names = ("clients", "rounds", "steps", "batch_size", "model", "data", "seed", "stream_aggregation")
    return {"config": _config(args, *names),
            "total_train_images": total, "by_clients": {str(n): f for n, f in by_clients.items()},
            "estimate": estimate}


def parity_run(args: argparse.Namespace, dtype: str, seed: int) -> Any:
    """The demo job (``make demo``'s scenario, sites and rounds) with weights travelling in ``dtype``."""
    from medflare.console.scenarios import load_scenario
    from medflare.run_config import RunConfig, merge_sections

    override = {"method": args.parity_method, "clients": 4, "rounds": args.parity_rounds, "seed": seed,
                "transfer_dtype": dtype, "name": f"parity-{dtype}-{seed}"}
    return RunConfig(**merge_sections(load_scenario("hyperkvasir-like"), override))


def parity_part(args: argparse.Namespace) -> dict[str, Any]:
    """Balanced accuracy per transfer dtype and seed, and the float16 - float32 gap."""
    accuracy: dict[str, list[float]] = {}
    for dtype in PARITY_DTYPES:
        for seed in args.seeds:
            summary, _ = run_cell(parity_run(args, dtype, seed), args.out / "parity" / f"{dtype}-seed{seed}")
            accuracy.setdefault(dtype, []).append(summary["final"]["balanced_accuracy"])
            print(f"parity {dtype} seed {seed}: balanced accuracy {accuracy[dtype][-1]:.4f}", flush=True)
    return {"config": _config(args, "parity_method", "parity_rounds", "seeds"), "balanced_accuracy": accuracy,
            "float16_vs_float32": versus(accuracy["float16"], accuracy["float32"])}


# ----- report ------------------------------------------------------------------------------------------------------
def markdown(parts: dict[str, Any]) -> str:
    """results.md: the scaling table and its estimate, then the parity table (whichever parts were run)."""
    lines = ["# Memory, scaling and fp16 parity of medflare in FLARE's simulator (issue 15)", ""]
    if "scaling" in parts:
        lines += _scaling_lines(parts["scaling"])
    if "parity" in parts:
        lines += _parity_lines(parts["parity"])
    return "\n".join(lines)


def _scaling_lines(scaling: dict[str, Any]) -> list[str]:
    goal = GOALS["rss_growth_after_round_3"]
    header = (f"| sites | s/round (rounds 2..R) | server peak RSS MiB | server growth after round 3 "
              f"(goal <= {goal:.0%}) | largest site peak RSS MiB | largest site growth after round 3 "
              "| bytes / site / round | device |")
    lines = [f"## Seconds per round and peak RSS, fixed total data ({scaling['total_train_images']} training images)",
             "", f"Config: `{json.dumps(scaling['config'])}`", "", header, "|---|---|---|---|---|---|---|---|"]
    for clients, f in scaling["by_clients"].items():
        server = f["memory"].get("server", {})
        sites = [m for role, m in f["memory"].items() if role.startswith("site-")]
        site_peak = max(sites, key=lambda m: m["peak_bytes"]) if sites else {}
        site_growth = [m["growth_after_round_3"] for m in sites if m["growth_after_round_3"] is not None]
        lines.append(f"| {clients} | {f['seconds_per_round']:.2f} | {_mib(server.get('peak_bytes'))} | "
                     f"{_percent(server.get('growth_after_round_3'))} | {_mib(site_peak.get('peak_bytes'))} | "
                     f"{_percent(max(site_growth) if site_growth else None)} | "
                     f"{_number(f['upload_bytes_per_site_round'])} | {f['device']} |")
    e = scaling["estimate"]
    memory = "not computed (it needs two site counts or more)"
    if e["server_peak_bytes"] is not None:
        memory = (f"{_mib(e['server_peak_bytes'])} MiB ({_mib(e['server_base_bytes'])} MiB + "
                  f"{_mib(e['server_bytes_per_site'])} MiB per site)")
    estimate = (f"{e['hospitals']} hospitals, computed from the per-site figures above: "
                f"{_number(e['bytes_per_round'])} bytes per round through the server "
                f"({_number(e['upload_bytes_per_round'])} up, {_number(e['download_bytes_per_round'])} down); "
                f"server memory {memory}.")
    lines += ["", estimate, ""] + _memory_goal_lines(scaling["by_clients"], goal)
    return lines + _streaming_lines(scaling["by_clients"])


def _memory_goal_lines(by_clients: dict[str, Any], goal: float) -> list[str]:
    """The growth goal per site count and process, met or missed and by how much."""
    lines = []
    for clients, f in by_clients.items():
        growth = {role: m["growth_after_round_3"] for role, m in sorted(f["memory"].items())}
        lines.append(f"- {clients} sites: " + "; ".join(
            goal_verdict(f"{role} growth after round 3", None if g is None else 100 * g, 100 * goal, unit=" %")
            for role, g in growth.items()))
    return lines + [""] if lines else []


def _streaming_lines(by_clients: dict[str, Any]) -> list[str]:
    """One line per site count run with ``--stream-aggregation``: how its rounds were aggregated."""
    lines = []
    for clients, figures in by_clients.items():
        facts = figures.get("streaming")
        if facts:
            batch = f"; one batch because {'; '.join(facts['batch_reasons'])}" if facts["batch_reasons"] else ""
            lines.append(f"stream_aggregation, {clients} sites: {facts['streamed_rounds']} of {facts['rounds']} rounds "
                         f"summed as results arrived, at most {facts['most_results_held']} result(s) held at once"
                         f"{batch}.")
    return lines + [""] if lines else []


def _parity_lines(parity: dict[str, Any]) -> list[str]:
    lines = ["## fp16 transfer parity (balanced accuracy, mean ± std)", "",
             f"Config: `{json.dumps(parity['config'])}`", "", "| transfer_dtype | balanced accuracy | seeds |",
             "|---|---|---|"]
    for dtype, values in parity["balanced_accuracy"].items():
        mean, std = mean_std(values) or (float("nan"), float("nan"))
        lines.append(f"| {dtype} | {mean:.4f} ± {std:.4f} | {len(values)} |")
    return lines + ["", f"float16 - float32: {parity['float16_vs_float32']}", ""]


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _config(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    return {name: getattr(args, name) for name in names}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["scaling", "parity", "all"], default="all")
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 4, 8], help="site counts of the scaling part")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=0,
                        help="cap on optimizer steps per site and round (0 = one epoch; a cap breaks fixed total work)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--data", default=f"medmnist:{DATA}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream-aggregation", action="store_true",
                        help="scaling part: the server sums results as they arrive (stream_aggregation=true)")
    parser.add_argument("--sample-seconds", type=float, default=0.5, help="how often the process tree is sampled")
    parser.add_argument("--parity-method", default="fedmas", help="method of the parity part's demo job")
    parser.add_argument("--parity-rounds", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the parity part")
    parser.add_argument("--quick", action="store_true", help="sanity run: scaling part, 2 sites, 4 rounds, 3 steps")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-scaling"))
    args = parser.parse_args(argv)
    if args.quick:
        args.part, args.clients, args.rounds, args.steps = "scaling", [2], 4, 3
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / "results.json"
    parts = json.loads(record.read_text()) if record.is_file() else {}  # a part run alone keeps the other's section
    parts["goals"] = GOALS
    if args.part in ("scaling", "all"):
        parts["scaling"] = scaling_part(args)
    if args.part in ("parity", "all"):
        parts["parity"] = parity_part(args)
    record.write_text(json.dumps(parts, indent=2) + "\n")
    report = markdown(parts)
    (args.out / "results.md").write_text(report)
    print(report)
    return parts


if __name__ == "__main__":
    from medflare.console.processes import stop_on_signals

    with stop_on_signals():
        main()
