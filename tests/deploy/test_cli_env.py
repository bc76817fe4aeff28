"""`medflare run METHOD --env poc` runs the same job through the POC runner instead of the simulator."""

from __future__ import annotations

from pathlib import Path

import pytest

import medflare.deploy.poc as poc_module
import medflare.simulate as simulate_module
from medflare.cli import main
from medflare.report import build_summary


def fake_summary(run) -> dict:
    return build_summary({"method": run.method, "rounds": []}, {"method": run.method}, {})


@pytest.mark.parametrize("env,mode", [("poc", "preinstalled"), ("poc", "byoc"), ("sim", "byoc")])
def test_env_option_dispatches(env: str, mode: str, monkeypatch, tmp_path: Path) -> None:
    calls = []

    def fake_poc(run, out, mode="byoc", **kwargs):
        calls.append(("poc", run.method, run.rounds, mode))
        return fake_summary(run)

    def fake_sim(run, out, echo=print, **kwargs):
        calls.append(("sim", run.method, run.rounds, None))
        return fake_summary(run)

    monkeypatch.setattr(poc_module, "run_poc", fake_poc)
    monkeypatch.setattr(simulate_module, "run_simulation", fake_sim)
    argv = ["run", "fedprox", "--rounds", "2", "--out", str(tmp_path / "out"), "--env", env, "--mode", mode]
    assert main(argv) == 0
    assert calls == [(env, "fedprox", 2, mode if env == "poc" else None)]
