"""Encrypted aggregation (secure_aggregation=he): the server weighs CKKS ciphertexts with its plaintext shares and
never holds a decryptable update; the sites' decrypted model equals the plaintext aggregate within CKKS precision.

One small context (FLARE's HEBuilder parameters) for the module; small arrays, so the whole file takes seconds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("tenseal")

from nvflare.apis.dxo import DXO, DataKind, from_shareable  # noqa: E402
from nvflare.apis.fl_context import FLContext  # noqa: E402

from medflare import contracts  # noqa: E402
from medflare.errors import ConfigError  # noqa: E402
from medflare.flare.he import (  # noqa: E402
    DecryptTask,
    EncryptedRoundAggregation,
    EncryptResult,
    read_encrypted_model,
    save_encrypted_model,
)
from medflare.methods.base import RoundContext  # noqa: E402
from medflare.ops import he_aggregate  # noqa: E402
from medflare.ops.he_aggregate import EncryptedArray, encryption_refusal  # noqa: E402
from medflare.plan import resolve, validated  # noqa: E402
from medflare.registry import get_method  # noqa: E402
from medflare.server_round import RoundAggregation  # noqa: E402

from .._plans import app_context, deploy_plan, site_data_plan

CKKS_TOLERANCE = 1e-4  # |decrypted − plaintext| for weights of magnitude ≤ 3 at scale 2**40
GLOBAL = {
    "features.weight": np.zeros((4, 2, 3), np.float32),
    "features.bn.num_batches_tracked": np.array(0, np.int64),
    "head.weight": np.zeros((3, 4), np.float32),
    "head.bias": np.zeros(3, np.float32),
}


@pytest.fixture(scope="module")
def contexts():
    """(site context with the secret key, server context without it), as HEBuilder writes them into the kits."""
    site = he_aggregate.make_context()
    return site, he_aggregate.server_context(he_aggregate.server_copy(site))


def site_update(seed: int, n: int, **meta) -> tuple[dict[str, np.ndarray], dict]:
    rng = np.random.default_rng(seed)
    arrays = {k: (rng.normal(size=v.shape).astype(v.dtype) if v.dtype.kind == "f" else np.array(4 + seed, v.dtype))
              for k, v in GLOBAL.items()}
    return arrays, {"n_samples": n, **meta}


def encrypted(site_context, arrays: dict, meta: dict, plain: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """What EncryptResult makes of a site's result (the filter itself is tested below)."""
    sealed = {k: he_aggregate.encrypt_array(site_context, v) for k, v in arrays.items() if k not in plain}
    declared = {k: [list(np.shape(arrays[k])), np.asarray(arrays[k]).dtype.name] for k in sealed}
    return {**arrays, **sealed}, {**meta, contracts.ENCRYPTED_ARRAYS: declared}


def rounds(method: str, contexts, updates: dict, method_args=None, robust=None, num_rounds: int = 2):
    """(plaintext aggregate, encrypted core after aggregating the same updates) of round 1."""
    plain = RoundAggregation(get_method(method), method_args, 3, num_rounds, robust)
    sealed = EncryptedRoundAggregation(get_method(method), method_args, 3, num_rounds, robust)
    sealed.use_context(contexts[1])
    for core in (plain, sealed):
        core.start_round(GLOBAL, RoundContext(0, num_rounds))
        core.start_phase("train")
    for site, (arrays, meta) in updates.items():
        assert plain.accept(site, arrays, meta) is None
        assert sealed.accept(site, *encrypted(contexts[0], arrays, meta)) is None
    return plain.aggregate(), sealed


def site_app(tmp_path) -> FLContext:
    """A site's FLARE context running a deployed fedavg job (DecryptTask builds its initial model from the plan)."""
    return app_context(deploy_plan(tmp_path / "app", site_data_plan("fedavg", 3)))


def decrypted(site_context, params: dict) -> dict[str, np.ndarray]:
    return {k: he_aggregate.decrypt_array(site_context, v.serialize(), v.shape, v.dtype)
            if isinstance(v, EncryptedArray) else v for k, v in params.items()}


def assert_close(decrypted_params: dict, plain_params: dict) -> None:
    for key, value in plain_params.items():
        assert decrypted_params[key].dtype == value.dtype and decrypted_params[key].shape == value.shape
        np.testing.assert_allclose(decrypted_params[key], value, atol=CKKS_TOLERANCE, err_msg=key)


@pytest.mark.parametrize("method, method_args, meta, robust", [
    ("fedavg", None, ({}, {}), None),
    ("fedmas", None, ({"rf": 0.2}, {"rf": 0.9}), None),
    ("fedmas", None, ({"rf": 0.2}, {"rf": 0.9}), {"max_share": 0.6}),  # the cap binds: 0.9/1.1 > 0.6
    ("fedlsm", {"aggregation": "awpa"}, ({"q": [5, 0, 1], "identified": [1, 0, 1]},
                                         {"q": [1, 4, 0], "identified": [1, 1, 0]}), {"max_share": 0.7}),
])
def test_the_decrypted_aggregate_equals_the_plaintext_one(contexts, method, method_args, meta, robust) -> None:
    updates = {"site-1": site_update(1, 10, **meta[0]), "site-2": site_update(2, 30, **meta[1])}
    plain, sealed = rounds(method, contexts, updates, method_args, robust)
    result = sealed.aggregate()
    assert result.shares == pytest.approx(plain.shares)
    if robust:
        assert max(result.shares.values()) <= robust["max_share"] + 1e-9  # capped before weighing ciphertexts
    assert_close(decrypted(contexts[0], result.params), plain.params)


def test_the_server_holds_only_ciphertexts_it_cannot_decrypt(contexts) -> None:
    _, sealed = rounds("fedavg", contexts, {"site-1": site_update(1, 10), "site-2": site_update(2, 20)})
    assert not sealed.context.is_private()
    for update in sealed.accepted():
        model = {k: v for k, v in update.arrays.items() if k in GLOBAL}
        assert set(model) == set(GLOBAL) and all(isinstance(v, EncryptedArray) for v in model.values())
        for array in model.values():
            assert not array.vector.context().is_private()
            with pytest.raises(ValueError, match="secret"):
                array.vector.decrypt()
    with pytest.raises(ConfigError, match="secret key"):
        sealed.use_context(contexts[0])


def test_a_plaintext_model_array_is_refused(contexts) -> None:
    sealed = EncryptedRoundAggregation(get_method("fedavg"), None, 3, 2)
    sealed.use_context(contexts[1])
    sealed.start_round(GLOBAL, RoundContext(0, 2))
    sealed.start_phase("train")
    arrays, meta = site_update(1, 10)
    assert "in plaintext" in sealed.accept("site-1", arrays, meta)
    sealed_arrays, sealed_meta = encrypted(contexts[0], arrays, meta, plain=("head.bias",))
    assert "in plaintext" in sealed.accept("site-2", sealed_arrays, sealed_meta)
    sealed_arrays, sealed_meta = encrypted(contexts[0], arrays, meta)
    sealed_arrays["head.bias"] = he_aggregate.encrypt_array(contexts[0], np.zeros(5))
    assert "encrypts 5 values" in sealed.accept("site-3", sealed_arrays, sealed_meta)


def test_the_next_round_sends_ciphertexts_the_sites_decrypt(contexts, tmp_path) -> None:
    """The encrypted global model goes out as bytes the task header declares; DecryptTask restores the arrays."""
    plain, sealed = rounds("fedavg", contexts, {"site-1": site_update(1, 10), "site-2": site_update(2, 20)})
    sealed.start_round(sealed.aggregate().params, RoundContext(1, 2))
    outgoing = sealed.start_phase("train")
    header = sealed.task_header()
    assert set(header[contracts.ENCRYPTED_ARRAYS]) == set(GLOBAL)
    assert all(isinstance(outgoing[k], bytes) for k in GLOBAL)
    task = DXO(DataKind.WEIGHTS, data=outgoing, meta=header).to_shareable()
    decrypt = DecryptTask()
    decrypt._context = contexts[0]
    received = from_shareable(decrypt.process(task, site_app(tmp_path)))
    assert contracts.ENCRYPTED_ARRAYS not in received.meta
    assert_close(received.data, plain.params)


def test_encrypt_result_seals_model_arrays_and_leaves_the_frozen_ones(contexts, tmp_path) -> None:
    """What the job's plan names decides: FedBABU's frozen head (``Payload.frozen_keys``) travels in plaintext."""
    ctx = app_context(deploy_plan(tmp_path / "app", site_data_plan("fedbabu", 5)))
    arrays, meta = site_update(1, 10)
    encrypt = EncryptResult()
    encrypt._context = contexts[0]
    dxo = from_shareable(encrypt.process(DXO(DataKind.WEIGHTS, data=dict(arrays), meta=meta).to_shareable(), ctx))
    declared = dxo.meta[contracts.ENCRYPTED_ARRAYS]
    assert set(declared) == {"features.weight", "features.bn.num_batches_tracked"}
    assert all(isinstance(dxo.data[k], bytes) for k in declared)
    for key in ("head.weight", "head.bias"):
        np.testing.assert_array_equal(dxo.data[key], arrays[key])
    arrays["features.weight"][0] = np.nan
    with pytest.raises(Exception, match="NaN"):
        encrypt.process(DXO(DataKind.WEIGHTS, data=dict(arrays), meta=meta).to_shareable(), ctx)


@pytest.mark.parametrize("method", ["mdhfl", "fedmd", "local-only"])
def test_methods_whose_aggregate_is_no_weighted_sum_of_models_are_refused(method: str) -> None:
    reason = encryption_refusal(get_method(method))
    assert reason.startswith(f"method '{method}' cannot aggregate encrypted: ") and "\n" not in reason
    with pytest.raises(ConfigError, match="cannot aggregate encrypted"):
        EncryptedRoundAggregation(get_method(method), None, 3, 2)


@pytest.mark.parametrize("method", ["fedavg", "fedmas", "fedlsm", "fedavg-masked", "fedprox", "fedbabu"])
def test_weighted_sum_methods_are_accepted(method: str) -> None:
    assert encryption_refusal(get_method(method)) == ""


@pytest.mark.parametrize("options, refused", [
    ({"robust": {"max_norm_ratio": 10.0}}, "max_norm_ratio"),
    ({"stream_aggregation": True}, "stream_aggregation"),
    ({"transfer_kind": "diff"}, "transfer_kind=diff"),
    ({"transfer_dtype": "float16"}, "float32"),
])
def test_what_the_server_can_no_longer_do_is_refused(options: dict, refused: str) -> None:
    with pytest.raises(ConfigError, match=refused):
        EncryptedRoundAggregation(get_method("fedavg"), None, 3, 2, **options)


def test_the_saved_model_is_encrypted_and_a_site_decrypts_it(contexts, tmp_path) -> None:
    plain, sealed = rounds("fedavg", contexts, {"site-1": site_update(1, 10), "site-2": site_update(2, 20)})
    path = save_encrypted_model(tmp_path / "model.ckks.npz", sealed.aggregate().params)
    assert_close(read_encrypted_model(path, contexts[0]), plain.params)
    with pytest.raises(ConfigError, match="client_context"):
        read_encrypted_model(path, contexts[1])


def test_the_simulator_refuses_and_a_run_refuses_what_the_server_cannot_do(tmp_path) -> None:
    from medflare.console.simulate import run_simulation
    from medflare.run_config import RunConfig

    with pytest.raises(ConfigError, match="simulator"):
        run_simulation(resolve(RunConfig(secure_aggregation="he"), "byoc"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="max_norm_ratio"):
        validated(RunConfig(secure_aggregation="he", robust={"max_norm_ratio": 10}), check_files=False)
    with pytest.raises(ConfigError, match="cannot aggregate encrypted"):
        validated(RunConfig(method="local-only", secure_aggregation="he"), check_files=False)


def test_a_site_refuses_a_decrypted_model_that_is_garbage_or_far_out_of_range(contexts, tmp_path) -> None:
    """Issue 49, item 4: the server cannot look inside the aggregate; the site checks what it decrypted."""
    plain, sealed = rounds("fedavg", contexts, {"site-1": site_update(1, 10), "site-2": site_update(2, 20)})
    sealed.start_round(sealed.aggregate().params, RoundContext(1, 2))
    outgoing, header = sealed.start_phase("train"), sealed.task_header()
    decrypt = DecryptTask()
    decrypt._context = contexts[0]
    good = decrypt.process(DXO(DataKind.WEIGHTS, data=dict(outgoing), meta=dict(header)).to_shareable(),
                           site_app(tmp_path))
    assert good.get_header(contracts.REFUSED_TASK_HEADER) is None  # and it is now the site's last model
    other_key = he_aggregate.make_context()  # a ciphertext made under another consortium's key
    forged = {k: he_aggregate.encrypt_array(other_key, v) if k in header[contracts.ENCRYPTED_ARRAYS] else v
              for k, v in plain.params.items()}
    task = decrypt.process(DXO(DataKind.WEIGHTS, data=forged, meta=dict(header)).to_shareable(), None)
    assert "the decrypted global model is implausible: " in task.get_header(contracts.REFUSED_TASK_HEADER)
    scaled = {k: he_aggregate.encrypt_array(contexts[0], v * 1000) if k in header[contracts.ENCRYPTED_ARRAYS] else v
              for k, v in plain.params.items()}
    task = decrypt.process(DXO(DataKind.WEIGHTS, data=scaled, meta=dict(header)).to_shareable(), None)
    assert "since the last round, over 10 x its norm" in task.get_header(contracts.REFUSED_TASK_HEADER)


def test_the_first_encrypted_model_is_checked_against_the_jobs_initial_model(contexts, tmp_path) -> None:
    """Issue 60, item 4: the first encrypted model a site received was checked only against |w| <= 1e6 (the site had
    no last round's model); now against the initial model the site builds from the job's plan, as the server's
    persistor does, and every later one against the last round's."""
    from medflare.flare.models import global_model_of

    plan = site_data_plan("fedavg", 3)
    ctx = app_context(deploy_plan(tmp_path / "app", plan))
    initial = {k: v.numpy() for k, v in global_model_of(plan).state_dict().items()}
    sealed = ("head.weight", "head.bias")

    def task(scale: float):
        """The round-1 task: the initial model, its head encrypted and scaled by ``scale``."""
        data = {k: he_aggregate.encrypt_array(contexts[0], v * scale) if k in sealed else v for k, v in initial.items()}
        declared = {k: [list(initial[k].shape), initial[k].dtype.name] for k in sealed}
        return DXO(DataKind.WEIGHTS, data=data, meta={contracts.ENCRYPTED_ARRAYS: declared}).to_shareable()

    def site() -> DecryptTask:
        decrypt = DecryptTask()
        decrypt._context = contexts[0]
        return decrypt

    assert max(float(np.abs(initial[k] * 1000).max()) for k in sealed) < 1e6  # inside the old bound
    torch.manual_seed(123)
    drawn_without_he = torch.rand(4)
    torch.manual_seed(123)
    assert site().process(task(1.0), ctx).get_header(contracts.REFUSED_TASK_HEADER) is None
    # building the initial model (which seeds torch) leaves the site's random state as it was: the CI's POC caught
    # an encrypted job drawing other batches than the plaintext one
    assert torch.equal(torch.rand(4), drawn_without_he)
    refused = site().process(task(1000.0), ctx).get_header(contracts.REFUSED_TASK_HEADER)
    assert refused.startswith("the decrypted global model is implausible: the model moved ")
    assert "since the job's initial model, over 10 x its norm" in refused and "\n" not in refused
    honest = site()
    assert honest.process(task(1.5), ctx).get_header(contracts.REFUSED_TASK_HEADER) is None
    later = honest.process(task(1000.0), ctx).get_header(contracts.REFUSED_TASK_HEADER)
    assert "since the last round, over 10 x its norm" in later
