"""Every registered method's FLARE 2.9 recipe completes a short job in ``SimEnv`` (FLARE's simulator), reports
per-site metrics, sends exactly what its Payload declares, and shows medflare's progress on the console with
FLARE's INFO log kept in files: new methods are covered with no new test.

One simulator run per method serves both checks (the recipe and the job ``medflare run`` simulates are the same
job: tests/test_recipes.py compares them file by file). ``make test-heavy`` runs it; ``make test`` runs the same
smoke jobs through the in-process loop (test_every_method_inprocess.py) and one simulator run per control pattern.
"""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from nvflare.recipe import SimEnv

from medflare.console.launch import write_job_outputs
from medflare.console.recipes import MedflareRecipe
from medflare.flare.audit import AUDIT_FILE
from medflare.flare.controller import RESULTS_FILE
from medflare.plan import describe_sites
from medflare.registry import get_method, list_methods
from medflare.run_config import RunConfig

from ._rescoring import rescore_global_model
from ._smoke import check_audit, smoke_run

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

# INFO lines FLARE's simulator prints several times a round per site with its default ("concise") console: a
# recipe run shows medflare's lines instead and leaves FLARE's INFO log in the simulator's log files (issue 30)
FLARE_INFO = re.compile(r"set transaction info|object has been downloaded|Finished one task run")


def run_recipe_in_simenv(run: RunConfig, tmp_path: Path) -> tuple[Path, dict, dict, Path]:
    """(run folder, summary, controller results, FLARE's workspace) of ``run``'s recipe executed in SimEnv, with
    the outputs ``medflare run`` writes (summary, global model) and each site's payload audit copied to
    ``sites/<site>/``."""
    recipe = MedflareRecipe(run)
    result = recipe.execute(SimEnv(num_clients=run.clients, workspace_root=str(tmp_path / "ws")))
    workspace = Path(result.get_result())
    results_file = workspace / "server" / "simulate_job" / "app_server" / RESULTS_FILE
    out = tmp_path / "run"
    out.mkdir()
    plan = recipe.plan  # as the recipe resolved it (its method's protocol data options filled in)
    summary = write_job_outputs(plan, results_file, out, describe_sites(plan)[0], launched_at=None)
    for audit in workspace.glob(f"site-*/**/{AUDIT_FILE}"):
        site = audit.relative_to(workspace).parts[0]
        (out / "sites" / site).mkdir(parents=True)
        (out / "sites" / site / AUDIT_FILE).write_bytes(audit.read_bytes())
    return out, summary, json.loads(results_file.read_text()), workspace


def audit_records(out: Path, site: str) -> list[dict]:
    path = out / "sites" / site / "medflare_payload_audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_console(capfd: pytest.CaptureFixture, run: RunConfig, workspace_root: Path) -> None:
    """medflare's progress on the console, FLARE's INFO log only in the simulator's log files."""
    shown = "".join(capfd.readouterr()).splitlines()
    assert any(f"medflare: round 1/{run.rounds}" in line for line in shown), shown[-20:]
    if run.method == "fedavg":  # a plain supervised method reports each local epoch
        assert any(f"site-1: round 1/{run.rounds} epoch 1/" in line for line in shown), shown[-20:]
    assert [line for line in shown if FLARE_INFO.search(line)] == []
    server_logs = list(workspace_root.glob("*/server/log.txt"))  # not lost: FLARE's INFO log is in the log file
    assert server_logs and re.search(r" - SimulatorServer - INFO - ", server_logs[0].read_text())


@pytest.mark.parametrize("method", list_methods())
def test_methods_recipe_completes_a_short_job_in_simenv_and_sends_exactly_its_declaration(
    method: str, tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FL_LOG_LEVEL", raising=False)  # the console a user gets by default
    run = smoke_run(method)  # one round per stage (SSL-FL's smallest job: one pre-training, one fine-tuning round)
    out, summary, results, _ = run_recipe_in_simenv(run, tmp_path)
    assert "error" not in results, results.get("error")
    assert summary["plan_check"] == "matches"  # the server ran the plan the runner built (and wrote the job from)
    check_console(capfd, run, tmp_path / "ws")
    assert len(results["rounds"]) == run.rounds == len(results["stages"]) == summary["rounds_completed"]
    assert all(set(r["payload"]) == set(run.site_names) for r in results["rounds"])  # every site answered
    assert results["final"]["model_version"] == run.rounds
    assert set(summary["per_round"][-1]["share"]) == set(run.site_names)
    final = summary["final"]
    assert set(final["by_site"]) == set(run.site_names)
    assert final["site_mean"]["accuracy"] == pytest.approx(np.mean([m["accuracy"] for m in final["by_site"].values()]))
    global_keys = list(torch.load(out / "FL_global_model.pt", weights_only=False)["model"])
    for site in run.site_names:
        results = check_audit(audit_records(out, site), method, global_keys)
        assert results["train"] == run.rounds and results["validate"] == 1, results
    spec = get_method(method)
    if spec.server_model and spec.global_classifier:  # the reported final model is the saved one, scored ...
        assert final["balanced_accuracy"] == pytest.approx(rescore_global_model(out, run)["balanced_accuracy"], abs=1e-12)
    # ... and it trained: the first scored model (model 0, or the first after an unscored pre-training stage)
    first = summary["initial"] or next(entry["metrics"] for entry in summary["per_round"] if entry.get("metrics"))
    assert final["loss"] != pytest.approx(first["loss"], rel=1e-6)
