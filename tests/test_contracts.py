"""The wire contract: outgoing checks at the site, incoming validation at the server, array rules."""

import numpy as np
import pytest

from medflare.contracts import (
    ArraySpec,
    ContractContext,
    Expected,
    Payload,
    array_expectations,
    check_result_values,
    class_vector,
    counts,
    positive_number,
    probabilities,
    validate_update,
    weight_expectations,
)
from medflare.errors import PayloadError
from medflare.metrics import EvalStats

CTX = ContractContext(num_classes=3)
EXPECTED = {"w": Expected((2, 2), ("float32",)), "b": Expected((2,), ("float32",))}


def good_arrays() -> dict:
    return {"w": np.ones((2, 2), np.float32), "b": np.zeros(2, np.float32)}


def test_valid_update_passes() -> None:
    arrays, meta = validate_update(good_arrays(), {"n_samples": 10}, EXPECTED, Payload(), CTX)
    assert set(arrays) == {"w", "b"} and meta == {"n_samples": 10.0}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(w=np.full((2, 2), np.nan, np.float32)), "NaN or Inf"),
        (lambda a: a.update(w=np.full((2, 2), np.inf, np.float32)), "NaN or Inf"),
        (lambda a: a.update(w=np.ones((3, 2), np.float32)), "shape"),
        (lambda a: a.update(w=np.ones((2, 2), np.int64)), "dtype"),
        (lambda a: a.update(w=np.ones((2, 2), np.float64) * 1e300), "dtype"),  # float64 is not float32
        (lambda a: a.update(w=np.array(["a", "b"])), "numeric array"),
        (lambda a: a.update(w=[[1.0, 1.0], [1.0, 1.0]]), "numeric array"),
        (lambda a: a.pop("b"), "missing keys"),
        (lambda a: a.update(extra=np.ones(1, np.float32)), "unexpected keys"),
        (lambda a: a.update(stolen_images=np.zeros((100, 28, 28), np.uint8)), "bytes"),
    ],
)
def test_malformed_updates_are_rejected_with_a_reason(mutate, message: str) -> None:
    arrays = good_arrays()
    mutate(arrays)
    with pytest.raises(PayloadError, match=message):
        validate_update(arrays, {"n_samples": 10}, EXPECTED, Payload(), CTX)


@pytest.mark.parametrize(
    "meta",
    [
        {"n_samples": -1},
        {"n_samples": float("nan")},
        {"n_samples": True},
        {"n_samples": 1.79e308},  # a forged weight that would take the whole aggregate
        {"n_samples": "x" * 20_000},
        {"secret": 1},
    ],
)
def test_bad_or_undeclared_meta_is_rejected(meta: dict) -> None:
    with pytest.raises(PayloadError):
        validate_update(good_arrays(), meta, EXPECTED, Payload(), CTX)


def test_evaluation_dicts_are_canonical_and_carry_nothing_else() -> None:
    stats = EvalStats.from_predictions([0, 1], np.array([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1]]), num_classes=3).to_dict()
    _, meta = validate_update(good_arrays(), {"eval_test": stats}, EXPECTED, Payload(), CTX)
    assert meta["eval_test"] == stats
    with pytest.raises(PayloadError, match="undeclared entries"):
        validate_update(good_arrays(), {"eval_test": {**stats, "stolen": [1, 2]}}, EXPECTED, Payload(), CTX)
    with pytest.raises(PayloadError):
        validate_update(good_arrays(), {"eval_extra": {"personal": {"train": stats}}}, EXPECTED, Payload(), CTX)
    _, meta = validate_update(good_arrays(), {"eval_extra": {"personal": {"test": stats}}}, EXPECTED, Payload(), CTX)
    assert meta["eval_extra"]["personal"]["test"] == stats


def test_method_meta_validators() -> None:
    payload = Payload(meta={"rf": positive_number("rf", upper=1.0), "counts": class_vector("counts")})
    validate_update(good_arrays(), {"rf": 0.5, "counts": [1, 0, 2]}, EXPECTED, payload, CTX)
    for bad in ({"rf": 0.0}, {"rf": 1.5}, {"rf": float("inf")}, {"counts": [1, 2]}, {"counts": [1, -1, 0]}, {"counts": "abc"}):
        with pytest.raises(PayloadError):
            validate_update(good_arrays(), bad, EXPECTED, payload, CTX)


# ----- array contracts --------------------------------------------------------------------------------------
PROBS = Payload(sends_weights=False, arrays={"probs": probabilities(phase="public_probs")})
PROBS_CTX = ContractContext(num_classes=3, dims={"rows": 4})


def probs(dtype=np.float16) -> np.ndarray:
    return np.full((4, 3), 1 / 3, dtype)


def expected_probs() -> dict:
    return array_expectations(PROBS.arrays_for("public_probs"), PROBS_CTX)


def test_declared_probability_array_passes_in_fp16_and_fp32() -> None:
    for dtype in (np.float16, np.float32):
        arrays, _ = validate_update({"probs": probs(dtype)}, {}, expected_probs(), PROBS, PROBS_CTX)
        assert arrays["probs"].dtype == dtype


@pytest.mark.parametrize(
    "value, message",
    [
        (np.full((5, 3), 1 / 3, np.float16), "shape"),  # wrong number of public rows
        (np.full((4, 2), 0.5, np.float16), "shape"),  # wrong class count
        (probs(np.float64), "dtype"),
        (np.full((4, 3), 5.0, np.float16), "above 1"),  # the fp16 'probability' matrix of 5.0
        (np.full((4, 3), -0.1, np.float32), "below 0"),
        (np.full((4, 3), 0.2, np.float32), "sum to 1"),
        (np.where(np.eye(4, 3) > 0, np.nan, 0.5).astype(np.float32), "NaN"),
        (np.full((4000, 3), 1 / 3, np.float32), "bytes"),  # oversized: refused before anything else
    ],
)
def test_every_array_contract_case_is_rejected(value: np.ndarray, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        validate_update({"probs": value}, {}, expected_probs(), PROBS, PROBS_CTX)


def test_counts_must_be_whole_and_non_negative() -> None:
    spec = counts()
    spec.check("c", np.array([3, 0, 1], np.int64), CTX)
    for bad, message in ((np.array([1.5, 0, 1]), "whole"), (np.array([-1, 0, 1]), "below 0")):
        with pytest.raises(PayloadError, match=message):
            spec.check("c", bad, CTX)


def test_unset_dimension_is_an_error_of_the_rule() -> None:
    with pytest.raises(PayloadError, match="did not set"):
        array_expectations(PROBS.arrays_for("public_probs"), CTX)


def test_weight_expectations_are_exact_dtypes_and_follow_transfer_dtype() -> None:
    global_params = {"w": np.zeros((2, 2), np.float32), "bn.num_batches_tracked": np.array(3, np.int64)}
    full = weight_expectations(global_params, list(global_params))
    assert full["w"].dtypes == ("float32",) and full["bn.num_batches_tracked"].dtypes == ("int64",)
    half = weight_expectations(global_params, list(global_params), transfer_dtype="float16")
    assert half["w"].dtypes == ("float16",) and half["bn.num_batches_tracked"].dtypes == ("int64",)
    assert half["w"].nbytes == 8 and full["w"].nbytes == 16


# ----- the site side ----------------------------------------------------------------------------------------
def test_site_refuses_to_send_private_or_undeclared_content() -> None:
    payload = Payload(private_keys=r"^personal_head\.")
    keys = ["backbone.w", "personal_head.weight"]
    shared = {"backbone.w": np.ones(2, np.float32)}
    payload.check_outgoing(shared, {"n_samples": 3}, keys, CTX)
    with pytest.raises(PayloadError, match="private"):
        payload.check_outgoing({**shared, "personal_head.weight": np.ones(2)}, {}, keys, CTX)
    with pytest.raises(PayloadError, match="undeclared meta"):
        payload.check_outgoing(shared, {"class_counts": [1, 2, 3]}, keys, CTX)
    with pytest.raises(PayloadError, match="NaN"):
        payload.check_outgoing({"backbone.w": np.array([np.nan], np.float32)}, {}, keys, CTX)
    assert payload.shared_keys(keys) == ["backbone.w"]


def test_stage_excluded_keys_do_not_travel_in_that_stage() -> None:
    payload = Payload(stage_excluded_keys={"finetune": r"^decoder\."})
    keys = ["encoder.w", "decoder.w", "head.w"]
    assert payload.shared_keys(keys, "pretrain") == keys
    assert payload.shared_keys(keys, "finetune") == ["encoder.w", "head.w"]
    with pytest.raises(PayloadError, match="undeclared"):
        payload.check_outgoing({"decoder.w": np.ones(1, np.float32)}, {}, keys, CTX, stage="finetune")


def test_site_checks_declared_array_values_before_sending() -> None:
    keys: list[str] = []
    PROBS.check_outgoing({"probs": probs()}, {}, keys, PROBS_CTX, phase="public_probs")
    with pytest.raises(PayloadError, match="above 1"):
        PROBS.check_outgoing({"probs": np.full((4, 3), 5.0, np.float16)}, {}, keys, PROBS_CTX, phase="public_probs")
    with pytest.raises(PayloadError, match="must carry"):
        PROBS.check_outgoing({}, {}, keys, PROBS_CTX, phase="public_probs")
    with pytest.raises(PayloadError, match="undeclared"):
        PROBS.check_outgoing({"w": np.ones(2, np.float32)}, {}, ["w"], PROBS_CTX, phase="train")
    with pytest.raises(PayloadError, match="carries no weights"):  # the site filter, which knows no model keys
        check_result_values(PROBS, {"w": np.ones(2, np.float32)}, {}, PROBS_CTX, "train")


def test_check_result_values_needs_no_model_and_catches_what_the_site_filter_must() -> None:
    payload = Payload()
    check_result_values(payload, good_arrays(), {"n_samples": 3}, CTX, "train")
    for arrays, meta in (
        ({"w": np.array(["stolen"])}, {}),
        (good_arrays(), {"n_samples": "x" * 20_000}),
        (good_arrays(), {"eval_test": {"confusion": "nope"}}),
    ):
        with pytest.raises(PayloadError):
            check_result_values(payload, arrays, meta, CTX, "train")


def test_array_spec_with_named_rows_checks_rank_when_rows_are_unknown() -> None:
    spec = ArraySpec(shape=("rows", "num_classes"))
    spec.check("x", np.zeros((7, 3), np.float32), CTX)  # rows unknown here: any count
    with pytest.raises(PayloadError, match="shape"):
        spec.check("x", np.zeros((7, 3, 1), np.float32), CTX)
