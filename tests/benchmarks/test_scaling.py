"""The memory / scaling / parity benchmark's arithmetic and parsing on hand-made records (its runs take an hour)."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from medflare.data.partition import partition

from .conftest import load_benchmark

scaling = load_benchmark("scaling")
MIB = 2**20


def results(rounds: int) -> dict:
    """The controller's round records: round r (1-based) starts at 100 + 10 (r - 1) and lasts 9 s."""
    return {"rounds": [{"round": r, "started_at": 100.0 + 10 * r, "wall_seconds": 9.0} for r in range(rounds)]}


def trace(ppid: int, cmdline: str, high_water_mib: list[int]) -> object:
    """A process sampled once per round, 5 s into each round, with the given high-water marks (MiB)."""
    samples = [(105.0 + 10 * r, mark * MIB, mark * MIB) for r, mark in enumerate(high_water_mib)]
    return scaling.ProcessTrace(ppid, cmdline.split(), samples)


def worker(name: str) -> str:
    return f"python -m nvflare.private.fed.app.simulator.simulator_worker -o ws --client {name} --token t"


def test_round_ends_are_the_next_start_and_the_last_start_plus_its_wall() -> None:
    assert scaling.round_ends(results(3)) == [110.0, 120.0, 129.0]


def test_high_water_at_each_round_end_and_growth_after_round_3() -> None:
    samples = trace(1, "x", [100, 200, 400, 410, 420]).samples
    marks = scaling.high_water_by_round(samples, scaling.round_ends(results(5)))
    assert marks == [100 * MIB, 200 * MIB, 400 * MIB, 410 * MIB, 420 * MIB]
    assert scaling.growth_after(marks) == pytest.approx(0.05)  # 420 / 400 - 1: round 3 is the baseline
    assert scaling.growth_after(marks[:3]) is None  # no round after the third
    assert scaling.growth_after([None, None, None, 5]) is None  # nothing sampled by the end of round 3


def test_a_round_without_a_sample_keeps_the_mark_reached_before_it() -> None:
    samples = [(105.0, 10, 10), (131.0, 12, 30)]  # nothing sampled in rounds 2 and 3 ... then a peak in round 4
    assert scaling.high_water_by_round(samples, scaling.round_ends(results(4))) == [10, 10, 10, 30]


def test_resident_memory_at_each_round_end_can_fall() -> None:
    samples = [(105.0, 10, 10), (114.0, 30, 30), (116.0, 12, 30), (135.0, 11, 30)]  # a peak in round 2, then freed
    ends = scaling.round_ends(results(4))
    assert scaling.resident_by_round(samples, ends) == [10, 12, 12, 11]
    assert scaling.high_water_by_round(samples, ends) == [10, 30, 30, 30]
    assert scaling.resident_by_round([(150.0, 5, 5)], ends) == [None, None, None, None]  # sampled after the job


def test_workers_are_their_sites_their_parent_is_the_server_and_the_rest_other() -> None:
    traces = {10: trace(1, "python -m nvflare simulator job", [1]), 11: trace(10, "python -c manager", [1]),
              12: trace(10, "python -c run_process", [1]), 21: trace(12, worker("site-1"), [1]),
              22: trace(12, worker("site-2"), [1])}
    assert scaling.process_roles(traces) == {10: "other", 11: "other", 12: "server", 21: "site-1", 22: "site-2"}


def test_memory_figures_per_role() -> None:
    traces = {12: trace(1, "python run_process", [500, 600, 700, 700, 770]), 21: trace(12, worker("site-1"), [300] * 5)}
    figures = scaling.memory_figures(traces, results(5))
    assert figures["server"]["peak_bytes"] == 770 * MIB
    assert figures["server"]["growth_after_round_3"] == pytest.approx(0.10)
    assert figures["site-1"]["growth_after_round_3"] == 0.0
    assert figures["site-1"]["command"].endswith("simulator_worker -o")


def test_the_sampler_reads_a_live_child_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sampler = scaling.TreeSampler()
        sampler.sample()
        rss, high_water = sampler.traces[child.pid].samples[0][1:]
        assert 0 < rss <= high_water
        assert sampler.traces[child.pid].cmdline[-1] == "import time; time.sleep(30)"
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("sites", [2, 4, 8])
def test_every_site_count_shares_out_the_same_pool(sites: int) -> None:
    labels = np.random.default_rng(0).integers(0, 2, size=4708)
    shares = partition(labels, sites, "iid", seed=0).indices
    assert np.array_equal(np.sort(np.concatenate(shares)), np.arange(len(labels)))  # disjoint and complete
    assert max(map(len, shares)) - min(map(len, shares)) <= 2  # 1/N each
    assert scaling.fixed_total({1: [4708], sites: [len(s) for s in shares]}) == 4708


def test_different_totals_are_refused() -> None:
    with pytest.raises(ValueError, match="same training pool"):
        scaling.fixed_total({2: [2354, 2354], 4: [2354] * 4})  # a step cap or a per-site pool: not fixed total


def test_twenty_hospitals_from_the_per_site_figures() -> None:
    # server peak 1.2 / 1.4 / 1.8 GB at 2 / 4 / 8 sites: a line of 0.1 GB per site on 1.0 GB
    peaks = {2: 1.2e9, 4: 1.4e9, 8: 1.8e9}
    estimate = scaling.hospital_estimate(upload_per_site=1.0e6, download_per_site=2.0e6, server_peak_by_sites=peaks)
    assert estimate["bytes_per_round"] == pytest.approx(20 * 3.0e6)
    assert estimate["upload_bytes_per_round"] == pytest.approx(2.0e7)
    assert estimate["server_bytes_per_site"] == pytest.approx(1.0e8)
    assert estimate["server_base_bytes"] == pytest.approx(1.0e9)
    assert estimate["server_peak_bytes"] == pytest.approx(3.0e9)
    assert scaling.hospital_estimate(1.0, 1.0, {2: 1.2e9})["server_peak_bytes"] is None  # no line through one point


def test_images_per_second_and_bytes_from_a_summary() -> None:
    summary = {"clients": {"site-1": {"n_samples_reported": 640, "train_seconds": [99.0, 2.0, 2.0]},
                           "site-2": {"n_samples_reported": 100, "train_seconds": [99.0, 1.0, 1.0]}},
               "payload": {"site-1": {"bytes_per_round": [10, 20]}, "site-2": {"bytes_per_round": [30, 40]}}}
    # rounds 2..R: site-1 trains 10 batches of 64 twice in 4 s, site-2 one batch of 64 twice in 2 s
    assert scaling.images_per_second(summary, batch=64, steps=0) == pytest.approx((2 * 640 + 2 * 64) / 6)
    assert scaling.images_per_second(summary, batch=64, steps=5) == pytest.approx((2 * 320 + 2 * 64) / 6)
    assert scaling.upload_bytes_per_site_round(summary) == 25


def test_on_cpu_no_gpu_figure_is_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert scaling.gpu_utilisation_reader() is None
    line = scaling.device_line(False, 123.4, [])
    assert "no GPU figure is claimed" in line and "123" in line


def test_with_cuda_utilisation_comes_from_torch_else_nvidia_smi_else_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "utilization", lambda *a: 87)
    assert scaling.gpu_utilisation_reader()() == 87.0

    def no_nvml(*args: object) -> int:
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    monkeypatch.setattr(scaling.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(scaling.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout="42\n"))
    assert scaling.gpu_utilisation_reader()() == 42.0
    monkeypatch.setattr(scaling.shutil, "which", lambda name: None)
    assert scaling.gpu_utilisation_reader()() is None
    assert scaling.device_line(True, 900.0, []).endswith("GPU utilisation unavailable")
    assert "GPU utilisation 60 % (mean of 2 samples)" in scaling.device_line(True, 900.0, [50.0, 70.0])


def test_quick_mode_and_the_parity_jobs() -> None:
    quick = scaling.parse_args(["--quick"])
    assert (quick.part, quick.clients, quick.rounds, quick.steps) == ("scaling", [2], 4, 3)
    run = scaling.scaling_run(scaling.parse_args([]), 8)
    assert (run.clients, run.rounds, run.model, run.train["max_steps"]) == (8, 30, "resnet18", 0)
    assert run.data["partition"] == "iid"  # the same pool dealt out in 1/N shares
    fp16 = scaling.parity_run(scaling.parse_args([]), "float16", 2)
    assert (fp16.method, fp16.clients, fp16.rounds, fp16.seed, fp16.transfer_dtype) == ("fedmas", 4, 8, 2, "float16")
    assert scaling.parity_run(scaling.parse_args([]), "float32", 2).data == fp16.data  # only the dtype differs


def test_stream_aggregation_reaches_the_scaling_jobs_and_the_report_says_how_rounds_were_aggregated() -> None:
    assert scaling.scaling_run(scaling.parse_args(["--stream-aggregation"]), 8).stream_aggregation is True
    assert scaling.scaling_run(scaling.parse_args([]), 8).stream_aggregation is False
    streamed = {"mode": "streamed", "most_results_held": 2, "in_site_order": True}
    rounds = [{"stream_aggregation": streamed}, {"stream_aggregation": {**streamed, "most_results_held": 5}},
              {"stream_aggregation": {"mode": "batch", "reason": "the share cap"}}]
    facts = scaling.streaming({"rounds": rounds})
    assert facts == {"streamed_rounds": 2, "rounds": 3, "most_results_held": 5, "batch_reasons": ["the share cap"]}
    assert scaling.streaming({"rounds": [{"round": 0}]}) is None  # the option was off
    assert scaling._streaming_lines({"8": {"streaming": facts}, "2": {"streaming": None}}) == [
        "stream_aggregation, 8 sites: 2 of 3 rounds summed as results arrived, at most 5 result(s) held at once; "
        "one batch because the share cap.", ""]


def test_the_report_reads_the_parity_gap_and_shows_the_estimate() -> None:
    memory = {"server": {"peak_bytes": 800 * MIB, "growth_after_round_3": 0.01},
              "site-1": {"peak_bytes": 500 * MIB, "growth_after_round_3": 0.02}}
    scaling_part = {"config": {}, "total_train_images": 4708, "by_clients": {"2": {
        "seconds_per_round": 12.5, "memory": memory, "upload_bytes_per_site_round": 1000.0, "device": "device cpu"}},
        "estimate": scaling.hospital_estimate(1000.0, 2000.0, {2: 800 * MIB, 4: 900 * MIB})}
    parity = {"config": {}, "balanced_accuracy": {"float32": [0.50, 0.52, 0.54], "float16": [0.51, 0.52, 0.53]},
              "float16_vs_float32": scaling.versus([0.51, 0.52, 0.53], [0.50, 0.52, 0.54])}
    report = scaling.markdown({"scaling": scaling_part, "parity": parity})
    assert "| 2 | 12.50 | 800 | +1.0% | 500 | +2.0% | 1,000 | device cpu |" in report
    assert "60,000 bytes per round" in report and "server memory 1700 MiB (700 MiB + 50 MiB per site)" in report
    assert "| float16 | 0.5200 ± 0.0100 | 3 |" in report and "+0.000 (no difference)" in report
