"""Resuming a job on its server (FLARE 2.9 cannot resume one itself): the checkpoint the controller writes after
every round, and what a new job's ``resume_from`` continues: in POC and production the *id* of an earlier job of
this server (same submitter), in FLARE's simulator only a previous run's folder (``medflare run --resume``). A job
never makes a deployed server read a path it names."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any, Mapping

import numpy as np
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext

from medflare import resume
from medflare.flare.run_results import RunResults, json_default
from medflare.methods.base import ServerRule
from medflare.ops.background import BackgroundWrite
from medflare.ops.checkpoint import load_checkpoint, save_checkpoint
from medflare.ops.server_opt import ServerOptimizer, split_state

CHECKPOINT_FILE = "medflare_checkpoint.npz"  # a run's state and model after every round, for a resumed job
SERVER_OPT_STATE = "server_optimizer"  # the checkpoint state's name of the rule whose buffers it holds
SERVER_RULE_STATE = "server_rule"  # the checkpoint state's facts of the method's server rule (ServerRule.checkpoint)
RULE_PREFIX = "server_rule:"  # the checkpoint's arrays of the method's server rule


def save_round_checkpoint(app_dir: str, run: RunResults, params: Mapping[str, np.ndarray],
                          writer: BackgroundWrite, server_opt: ServerOptimizer | None = None,
                          rule: ServerRule | None = None) -> None:
    """Write ``run``'s state and the model ``params`` in the background (``writer``), while the sites train; with
    ``server_opt``, its buffers too, and with ``rule``, what it carries between rounds (the server's own file:
    nothing of it is ever sent)."""
    state, arrays = run.state(), dict(params)
    if server_opt is not None:
        state, arrays = {**state, SERVER_OPT_STATE: server_opt.config.name}, {**arrays, **server_opt.state_arrays()}
    facts, rule_arrays = rule.checkpoint() if rule is not None else ({}, {})
    if facts or rule_arrays:
        state = {**state, SERVER_RULE_STATE: facts}
        arrays = {**arrays, **{RULE_PREFIX + name: value for name, value in rule_arrays.items()}}
    save_checkpoint(os.path.join(app_dir, CHECKPOINT_FILE), arrays, state, json_default, writer=writer)


def resumed_job_id(resume_from: str, in_simulator: bool) -> str | None:
    """The job id ``resume_from`` names, or None when it names a folder, which only the simulator resumes."""
    try:
        return str(uuid.UUID(resume_from))
    except ValueError:
        if not in_simulator:
            raise ValueError("in POC and production, resume_from must be the id of an earlier job of this server (a "
                             "job may not make the server read a path); folders resume only in the simulator "
                             "(medflare run --resume)") from None
        return None


def resume_job(run: RunResults, job_id: str, app_root: str, model: Mapping[str, Any], method: str,
               num_rounds: int, server_opt: ServerOptimizer | None = None,
               rule: ServerRule | None = None) -> tuple[dict[str, np.ndarray], str]:
    """Restore into ``run`` the history (rounds, evaluations, best score) of job ``job_id``'s last checkpoint (same
    submitter) from this server's own workspace, under this job's own header (its plan fingerprint, start, defences:
    what ``medflare report`` checks against the job's plan): (its model, its app folder). ``server_opt`` continues
    from the checkpoint's buffers when they are of its rule (else it starts afresh: m = 0, v = τ²); ``rule`` (the
    method's server rule) from what it wrote (SCAFFOLD's c)."""
    run_dir = os.path.dirname(app_root)
    previous_run = os.path.join(os.path.dirname(run_dir), job_id)
    if _submitter(previous_run) != _submitter(run_dir):
        raise ValueError(f"job {job_id} was submitted by someone else; only its submitter may resume it")
    previous_app = os.path.join(previous_run, os.path.basename(app_root))
    params, state = load_checkpoint(os.path.join(previous_app, CHECKPOINT_FILE))
    params, buffers = split_state(params)
    rule_arrays = {k.removeprefix(RULE_PREFIX): params.pop(k) for k in [k for k in params if k.startswith(RULE_PREFIX)]}
    check_same_model(params, model)
    header = dict(run.data)  # this job's, written by results_header before anything is restored
    run.restore(state, method, num_rounds)  # the same method and rounds, before its rule's state is taken
    if server_opt is not None and state.get(SERVER_OPT_STATE) == server_opt.config.name:
        server_opt.restore(buffers)
    if rule is not None and SERVER_RULE_STATE in state:
        rule.restore(state[SERVER_RULE_STATE], rule_arrays)
    start = {**resume.start_record(f"job {job_id}", run.next_round, params), "from_job": job_id}
    run.data = resume.continued_results(run.data, header, start)
    return params, previous_app


def resume_folder(run: RunResults, folder: str, model: Mapping[str, Any], header: dict) -> dict[str, np.ndarray]:
    """Restore into ``run`` a previous run's history in ``folder`` under this job's results ``header``; its model."""
    history, params = resume.read_history(folder), resume.read_model(folder)
    check_same_model(params, model)
    run.restore({"next_round": len(history["rounds"]), "results": history,
                 "best": resume.best_score(history, run.key_metric)}, header["method"])
    run.data = resume.continued_results(history, header, resume.start_record(folder, run.next_round, params))
    return params


def check_same_model(params: Mapping[str, Any], model: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose model has other keys or shapes than this job's."""
    differ = sorted(set(params) ^ set(model)) or sorted(k for k in params if np.shape(params[k]) != np.shape(model[k]))
    if differ:
        raise ValueError(f"the checkpoint's model differs from this job's model in {differ[:5]}")


def carry_best_model(previous_app: str, app_root: str) -> None:
    """The previous job's best model stays the best until this job scores a better one."""
    if os.path.isfile(os.path.join(previous_app, resume.BEST_MODEL_FILE)):
        shutil.copy(os.path.join(previous_app, resume.BEST_MODEL_FILE), os.path.join(app_root, resume.BEST_MODEL_FILE))


def in_simulator(fl_ctx: FLContext) -> bool:
    """Whether this server is FLARE's simulator: its engine class (FLARE sets SIMULATE_MODE at simulated sites
    only). Neither can be chosen by a job's configuration."""
    from nvflare.private.fed.simulator.simulator_server import SimulatorServerEngine

    return bool(fl_ctx.get_prop(FLContextKey.SIMULATE_MODE, False)) or isinstance(fl_ctx.get_engine(),
                                                                                  SimulatorServerEngine)


def _submitter(run_dir: str) -> str:
    """Who submitted the job whose server run folder is ``run_dir`` (FLARE writes its meta.json there)."""
    with open(os.path.join(run_dir, "meta.json")) as f:
        return str(json.load(f)["submitter_name"])
