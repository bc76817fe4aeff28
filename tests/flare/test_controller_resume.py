"""The controller's state for a resumed job (FLARE 2.9 cannot resume a job itself): what it checkpoints after a
round, what it restores, which rounds it then skips, and which checkpoints it refuses."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.signal import Signal

from medflare.flare.controller import CHECKPOINT_FILE, RESULTS_FILE, MedflareController
from medflare.flare.resume_state import save_round_checkpoint
from medflare.methods.base import Stage

from .._plans import site_data_plan

ROUNDS = 4
LEAD = "lead@hospital-a.example.org"


def controller(app_dir: Path, method: str = "fedavg", rounds: int = ROUNDS) -> MedflareController:
    """A controller as start_controller leaves it (persistor and aggregator stubbed: no FLARE engine)."""
    ctl = MedflareController().use_plan(site_data_plan(method, rounds=rounds, min_clients=1))
    ctl.aggregator = SimpleNamespace(holds_plaintext=True, core=SimpleNamespace(
        stages=[Stage("warmup", 1), Stage("train", rounds - 1)]))
    ctl.persistor = SimpleNamespace(saved=[], save=lambda learnable, fl_ctx: ctl.persistor.saved.append(learnable))
    ctl.global_params = {"w": np.zeros((2, 3), np.float32)}
    ctl.results_path = str(app_dir / RESULTS_FILE)
    ctl.results.data = {"method": method, "num_rounds": rounds, "rounds": [], "evaluations": {}}
    return ctl


def crashed_job(root: Path) -> tuple[str, MedflareController]:
    """A job that checkpointed 2 of 4 rounds in ``root/<job id>/app_server`` before its server died."""
    job_id = str(uuid.uuid4())
    app = root / job_id / "app_server"
    app.mkdir(parents=True)
    _write_meta(app.parent, LEAD)
    ctl = controller(app)
    ctl.global_params = {"w": np.full((2, 3), 3.0, np.float32)}
    ctl.results.data["rounds"] = [{"round": 0, "share": {"site-1": 1.0}}, {"round": 1, "share": {"site-1": 1.0}}]
    ctl.results.best = 0.7
    ctl.results.next_round = 2  # set by _run_round once round 2 of 4 is aggregated
    save_round_checkpoint(str(app), ctl.results, ctl.global_params, ctl._checkpoint_write)
    ctl._checkpoint_write.wait()  # written in the background while the next round's sites train
    return job_id, ctl


def new_job(root: Path, resume_from: str, submitter: str = LEAD) -> tuple[MedflareController, FLContext]:
    app = root / str(uuid.uuid4()) / "app_server"
    app.mkdir(parents=True)
    _write_meta(app.parent, submitter)
    ctl = controller(app)
    ctl.resume_from = resume_from
    ctx = FLContext()
    ctx.set_prop(FLContextKey.APP_ROOT, str(app), private=True, sticky=False)
    return ctl, ctx


def test_a_resumed_job_continues_where_the_crashed_one_stopped(tmp_path: Path) -> None:
    job_id, crashed = crashed_job(tmp_path)
    assert (tmp_path / job_id / "app_server" / CHECKPOINT_FILE).is_file()
    ctl, ctx = new_job(tmp_path, job_id)
    ctl._resume(ctx)
    assert ctl.results.next_round == 2 and ctl.results.best == 0.7
    assert ctl.results.data["rounds"] == crashed.results.data["rounds"]
    assert ctl.results.data["resumed"][-1]["from_job"] == job_id and ctl.results.data["resumed"][-1]["start_round"] == 2
    np.testing.assert_array_equal(ctl.global_params["w"], np.full((2, 3), 3.0))
    assert len(ctl.persistor.saved) == 1  # the restored model is this job's model from the start
    ran = []
    ctl._run_round = lambda ctx, abort, fl_ctx: ran.append((ctx.round, ctx.stage))
    ctl._final_validation = lambda last, abort, fl_ctx: ran.append("final")
    ctl.control_flow(Signal(), ctx)
    assert ran == [(2, "train"), (3, "train"), "final"]


def test_a_fresh_job_runs_every_round_of_its_plan(tmp_path: Path) -> None:
    """The plan's rounds, not a schedule rebuilt from the aggregator's stages (here stubbed as another one)."""
    ctl = controller(tmp_path)
    ran = []
    ctl._run_round = lambda ctx, abort, fl_ctx: ran.append((ctx.round, ctx.stage))
    ctl._final_validation = lambda last, abort, fl_ctx: None
    ctl.control_flow(Signal(), FLContext())
    assert ran == [(0, "train"), (1, "train"), (2, "train"), (3, "train")]
    assert ran == [(ctx.round, ctx.stage) for ctx in ctl.plan.round_contexts()]


@pytest.mark.parametrize("change", ["method", "rounds", "shape"])
def test_a_checkpoint_of_another_job_is_refused(tmp_path: Path, change: str) -> None:
    job_id, _ = crashed_job(tmp_path)
    ctl, ctx = new_job(tmp_path, job_id)
    if change == "method":
        ctl.plan = dataclasses.replace(ctl.plan, method="fedprox")
    elif change == "rounds":
        ctl.num_rounds = 5
    else:
        ctl.global_params = {"w": np.zeros((3, 3), np.float32)}
    with pytest.raises(ValueError, match="another job|differs"):
        ctl._resume(ctx)


@pytest.mark.parametrize("resume_from", ["../../etc", "not-a-job-id"])
def test_resume_from_names_a_job_id_never_a_path(tmp_path: Path, resume_from: str) -> None:
    """Outside the simulator a folder is refused before anything is read (only the simulator resumes folders)."""
    ctl, ctx = new_job(tmp_path, resume_from)
    with pytest.raises(ValueError, match="must be the id of an earlier job"):
        ctl._resume(ctx)


def test_the_simulators_server_resumes_a_folder(tmp_path: Path) -> None:
    """FLARE's simulator marks its sites (SIMULATE_MODE), not its server: the server is known by its engine."""
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.private.fed.simulator.simulator_server import SimulatorServerEngine

    ctl, ctx = new_job(tmp_path, str(tmp_path / "previous-run"))
    ctx.set_prop(ReservedKey.ENGINE, object.__new__(SimulatorServerEngine), private=True, sticky=False)
    resumed = []
    ctl._resume_folder = lambda fl_ctx: resumed.append(ctl.resume_from)

    ctl._resume(ctx)

    assert resumed == [str(tmp_path / "previous-run")]


def test_only_the_submitter_of_the_crashed_job_may_resume_it(tmp_path: Path) -> None:
    """Resuming hands the crashed job's model to the new job's submitter, who may download it."""
    job_id, _ = crashed_job(tmp_path)
    ctl, ctx = new_job(tmp_path, job_id, submitter="other-lead@hospital-b.example.org")
    with pytest.raises(ValueError, match="only its submitter"):
        ctl._resume(ctx)


def _write_meta(run_dir: Path, submitter: str) -> None:
    """The meta.json FLARE writes into a job's server run folder."""
    (run_dir / "meta.json").write_text(json.dumps({"submitter_name": submitter}))


def test_the_model_file_is_written_once_with_the_last_rounds_model(tmp_path: Path) -> None:
    """Every round's model is in the round checkpoint; FL_global_model.pt is written once, before the final
    validation scores that model (a per-round copy only lengthened each round)."""
    ctl = controller(tmp_path)
    events = []

    def play(ctx, abort, fl_ctx) -> None:
        ctl.global_params = {"w": np.full((2, 3), float(ctx.round), np.float32)}
        events.append(("round", len(ctl.persistor.saved)))

    ctl._run_round = play
    ctl._final_validation = lambda last, abort, fl_ctx: events.append(("final", len(ctl.persistor.saved)))
    ctl.control_flow(Signal(), FLContext())
    assert events == [("round", 0)] * ROUNDS + [("final", 1)]
    np.testing.assert_array_equal(ctl.persistor.saved[0]["weights"]["w"], np.full((2, 3), ROUNDS - 1.0))


def test_a_failed_job_keeps_its_last_good_model(tmp_path: Path) -> None:
    ctl = controller(tmp_path)
    ctl.system_panic = lambda reason, fl_ctx: None

    def play(ctx, abort, fl_ctx) -> None:
        if ctx.round == 2:
            raise RuntimeError("only 0 site(s) sent a valid result")
        ctl.global_params = {"w": np.full((2, 3), float(ctx.round), np.float32)}

    ctl._run_round = play
    ctl.control_flow(Signal(), FLContext())
    assert "only 0 site(s)" in ctl.results.data["error"]
    assert len(ctl.persistor.saved) == 1
    np.testing.assert_array_equal(ctl.persistor.saved[0]["weights"]["w"], np.full((2, 3), 1.0))


# ----- a resumed job is reported as itself ---------------------------------------------------------------
def _round_record(index: int) -> dict:
    """A round's record as the controller writes it (two sites, equal shares)."""
    return {"round": index, "started_at": 1000.0 + 10 * index, "wall_seconds": 9.0, "failed": {}, "rejected": {},
            "payload": {}, "server_seconds": {}, "share": {"site-1": 0.5, "site-2": 0.5},
            "sites": {s: {"n_samples": 50, "train_loss": 0.7} for s in ("site-1", "site-2")}}


def _with_header(ctl: MedflareController) -> MedflareController:
    """``ctl`` with the results header start_controller writes (run_results.results_header) for its own plan."""
    from medflare.flare.run_results import results_header

    ctl.aggregator.core.robust = SimpleNamespace(record=lambda: {"rule": "mean"})
    ctl.results.data = results_header(ctl.plan, ctl.aggregator)
    return ctl


def test_a_resumed_job_keeps_its_own_plan_and_medflare_report_accepts_it(tmp_path: Path) -> None:
    """After a server crash the job resubmitted with ``resume_from`` (its plan differs by that field) records its
    own plan fingerprint and start, the crashed job's rounds, and the report checks it against its own plan and
    says which job it resumed (was: the crashed job's fingerprint, so ``medflare report`` refused the results)."""
    from medflare.console.launch import report_from_results
    from medflare.plan import write_plan

    job_id = str(uuid.uuid4())
    crashed_app = tmp_path / job_id / "app_server"
    crashed_app.mkdir(parents=True)
    _write_meta(crashed_app.parent, LEAD)
    crashed = _with_header(controller(crashed_app))
    for index in range(2):  # the rounds the crashed job checkpointed, as _run_round finishes them
        crashed.results.finish_round(_round_record(index))
        crashed.results.record_evaluation(index + 1, {"val": {"balanced_accuracy": 0.5 + index / 10}}, None)
    save_round_checkpoint(str(crashed_app), crashed.results, crashed.global_params, crashed._checkpoint_write)
    crashed._checkpoint_write.wait()

    ctl, ctx = new_job(tmp_path, job_id)
    ctl.use_plan(dataclasses.replace(ctl.plan, resume_from=job_id))  # what set_resume writes into the job
    _with_header(ctl)
    own_header = {k: ctl.results.data[k] for k in ("plan", "controller_started_at", "robust_aggregation")}
    ctl._resume(ctx)
    assert ctl.plan.digest() != crashed.plan.digest()
    assert {k: ctl.results.data[k] for k in own_header} == own_header  # this job's, not the crashed job's
    assert ctl.results.data["rounds"] == crashed.results.data["rounds"] and ctl.results.best == 0.6
    for index in range(2, ROUNDS):  # the resumed job finishes the rest
        ctl.results.finish_round(_round_record(index))
    ctl.results.data["evaluations"].update({str(r): {"test": {"balanced_accuracy": 0.6}, "val": {}}
                                            for r in range(ROUNDS + 1)})
    ctl._write_results()
    (Path(ctl.results_path).parent / "config").mkdir()  # FLARE deploys the job's config beside its results
    write_plan(ctl.plan, Path(ctl.results_path).parent / "config")

    summary = report_from_results(Path(ctl.results_path), tmp_path / "report")

    assert summary["plan_check"] == "matches" and summary["rounds_completed"] == ROUNDS
    report = (tmp_path / "report" / "report.md").read_text()
    assert f"resumed from job `{job_id}` after 2 round(s)" in report
