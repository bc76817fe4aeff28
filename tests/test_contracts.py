"""The wire contract: outgoing checks at the site, incoming validation at the server."""

import numpy as np
import pytest

from medflare.contracts import ContractContext, Payload, class_vector, positive_number, validate_update
from medflare.errors import PayloadError

CTX = ContractContext(num_classes=3)
EXPECTED = {"w": ((2, 2), np.dtype(np.float32)), "b": ((2,), np.dtype(np.float32))}


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
        (lambda a: a.pop("b"), "missing keys"),
        (lambda a: a.update(extra=np.ones(1, np.float32)), "unexpected keys"),
    ],
)
def test_malformed_updates_are_rejected_with_a_reason(mutate, message: str) -> None:
    arrays = good_arrays()
    mutate(arrays)
    with pytest.raises(PayloadError, match=message):
        validate_update(arrays, {"n_samples": 10}, EXPECTED, Payload(), CTX)


@pytest.mark.parametrize("meta", [{"n_samples": -1}, {"n_samples": float("nan")}, {"n_samples": True}, {"secret": 1}])
def test_bad_or_undeclared_meta_is_rejected(meta: dict) -> None:
    with pytest.raises(PayloadError):
        validate_update(good_arrays(), meta, EXPECTED, Payload(), CTX)


def test_method_meta_validators() -> None:
    payload = Payload(meta={"rf": positive_number("rf", upper=1.0), "counts": class_vector("counts")})
    validate_update(good_arrays(), {"rf": 0.5, "counts": [1, 0, 2]}, EXPECTED, payload, CTX)
    for bad in ({"rf": 0.0}, {"rf": 1.5}, {"rf": float("inf")}, {"counts": [1, 2]}, {"counts": [1, -1, 0]}):
        with pytest.raises(PayloadError):
            validate_update(good_arrays(), bad, EXPECTED, payload, CTX)


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
