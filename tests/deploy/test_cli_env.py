"""`medflare run METHOD --env poc` runs the same job through the POC runner instead of the simulator."""

from __future__ import annotations

from pathlib import Path

import pytest

import medflare.console.deploy.poc as poc_module
import medflare.console.simulate as simulate_module
from medflare.console.cli import main
from medflare.console.report import build_summary


def fake_summary(plan) -> dict:
    return build_summary({"method": plan.method, "rounds": []}, {"method": plan.method}, {})


@pytest.mark.parametrize("env,mode", [("poc", "preinstalled"), ("poc", "byoc"), ("sim", "byoc")])
def test_env_option_dispatches(env: str, mode: str, monkeypatch, tmp_path: Path) -> None:
    calls = []

    def fake_poc(plan, out, mode="byoc", **kwargs):
        calls.append(("poc", plan.method, len(plan.rounds), mode))
        return fake_summary(plan)

    def fake_sim(plan, out, echo=print, **kwargs):
        calls.append(("sim", plan.method, len(plan.rounds), None))
        return fake_summary(plan)

    monkeypatch.setattr(poc_module, "run_poc", fake_poc)
    monkeypatch.setattr(simulate_module, "run_simulation", fake_sim)
    argv = ["run", "fedprox", "--rounds", "2", "--out", str(tmp_path / "out"), "--env", env, "--mode", mode]
    assert main(argv) == 0
    assert calls == [(env, "fedprox", 2, mode if env == "poc" else None)]


def test_compare_runs_every_method_and_seed_in_the_chosen_env(monkeypatch, tmp_path: Path) -> None:
    calls = []

    def fake_poc(plan, out, mode="byoc", **kwargs):
        calls.append((plan.method, plan.seed, mode, Path(out).relative_to(tmp_path / "out.partial").as_posix()))
        return fake_summary(plan)

    monkeypatch.setattr(poc_module, "run_poc", fake_poc)
    monkeypatch.setattr(simulate_module, "run_simulation", lambda *a, **k: pytest.fail("the simulator was used"))
    argv = ["compare", "fedavg", "fedprox", "--seeds", "0", "1", "--out", str(tmp_path / "out"), "--env", "poc",
            "--mode", "preinstalled"]
    assert main(argv) == 0
    assert calls == [("fedavg", 0, "preinstalled", "fedavg/seed0"), ("fedavg", 1, "preinstalled", "fedavg/seed1"),
                     ("fedprox", 0, "preinstalled", "fedprox/seed0"), ("fedprox", 1, "preinstalled", "fedprox/seed1")]
    assert (tmp_path / "out" / "comparison.md").is_file()
