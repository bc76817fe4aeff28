"""Encrypted aggregation in a real FLARE POC: kits provisioned with FLARE's HEBuilder, fedavg and fedmas jobs with
secure_aggregation=he beside the same jobs in plaintext (one POC, four jobs at once, two rounds each).

The encrypted jobs finish, their server writes only the encrypted model (no FL_global_model.pt, no best model, no
checkpoint), and that model, decrypted with a site's context, equals the plaintext job's within CKKS precision
(SGD, so the round-2 training of a decrypted model moves as little as the decryption error)."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("tenseal")

from medflare.checkpoint import read_checkpoint  # noqa: E402
from medflare.console.deploy.poc import PocSession, find_results  # noqa: E402
from medflare.flare.he import CLIENT_CONTEXT_FILE, MODEL_FILE, read_encrypted_model  # noqa: E402
from medflare.ops import he_aggregate  # noqa: E402
from medflare.plan import validated
from medflare.run_config import RunConfig  # noqa: E402
from medflare.server_setup import deployment_robust  # noqa: E402

from .._plans import write_run_job

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

METHODS = ("fedavg", "fedmas")
TRAIN = {"max_steps": 3, "batch_size": 32, "optimizer": "sgd", "lr": 0.01, "momentum": 0.0}
DATA = {"source": "synthetic:n=400", "partition": "iid"}
JOB_TIMEOUT = 300
CKKS_TOLERANCE = 1e-4


def job_run(method: str, he: bool) -> RunConfig:
    run = RunConfig(method=method, rounds=2, clients=2, data=dict(DATA), train=dict(TRAIN),
                    name=f"{method}-{'he' if he else 'plain'}", secure_aggregation="he" if he else "off")
    run.robust = deployment_robust(run.robust, encrypted=he)
    run = validated(run)
    return run


@pytest.fixture(scope="module")
def finished(tmp_path_factory, poc_lock, poc_port):
    """(downloaded job folder per job name, the POC's seconds, a site's context) after all four jobs ended."""
    root = tmp_path_factory.mktemp("poc-he")
    # tied: the POC dies with this test process, also when a cancelled run (CI, Ctrl-C) skips the teardown
    session = PocSession(root / "poc", port=poc_port, echo=lambda line: None, tied=True)
    try:
        started = time.time()
        session.prepare(2, allow_job_data=True, he=True)
        session.start()
        runs = [job_run(method, he) for method in METHODS for he in (True, False)]
        ids = {run.job_name: session.submit(write_run_job(run, root / "jobs", mode="byoc")) for run in runs}
        statuses = {name: session.wait(job_id, timeout=JOB_TIMEOUT) for name, job_id in ids.items()}
        assert set(statuses.values()) == {"FINISHED:COMPLETED"}, (statuses, session.server_log()[-3000:])
        downloads = {name: find_results(session.download(job_id, root / "download" / name)).parent
                     for name, job_id in ids.items()}
        context = he_aggregate.tenseal().context_from(
            (session.kit("site-1") / "startup" / CLIENT_CONTEXT_FILE).read_bytes())
        server_context = (session.kit(session.state["server"]) / "startup" / "server_context.tenseal").read_bytes()
        yield downloads, time.time() - started, context, server_context
    finally:
        session.discard()


@pytest.mark.parametrize("method", METHODS)
def test_the_encrypted_model_equals_the_plaintext_one(finished, method: str) -> None:
    downloads, seconds, context, _ = finished
    encrypted_app, plain_app = downloads[f"{method}-he"], downloads[f"{method}-plain"]
    assert not (encrypted_app / "FL_global_model.pt").exists()
    assert not (encrypted_app / "best_FL_global_model.pt").exists()
    assert not (encrypted_app / "medflare_checkpoint.npz").exists()
    plain_params = {k: np.asarray(v) for k, v in read_checkpoint(plain_app / "FL_global_model.pt").weights.items()}
    decrypted = read_encrypted_model(encrypted_app / MODEL_FILE, context)
    assert set(decrypted) == set(plain_params)
    worst = max(float(np.max(np.abs(decrypted[k].astype(np.float64) - np.asarray(v, np.float64)), initial=0.0))
                for k, v in plain_params.items())
    print(f"{method}: POC with 4 jobs took {seconds:.0f} s; max |encrypted - plaintext| = {worst:.2e}")
    assert worst < CKKS_TOLERANCE


def test_the_server_kit_cannot_decrypt(finished) -> None:
    *_, server_context = finished
    assert not he_aggregate.tenseal().context_from(server_context).is_private()
