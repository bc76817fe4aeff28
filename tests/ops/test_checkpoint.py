"""Round checkpoints: arrays and JSON state round-trip exactly, atomically, without pickle."""

from pathlib import Path

import numpy as np
import pytest

from medflare.errors import DataError
from medflare.ops.checkpoint import load_checkpoint, save_checkpoint


def test_params_and_state_round_trip(tmp_path: Path) -> None:
    params = {"conv.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "bn.num_batches_tracked": np.array(7)}
    state = {"next_round": 2, "results": {"rounds": [{"round": 0}, {"round": 1}]}, "best": float("-inf")}
    path = tmp_path / "ck.npz"
    save_checkpoint(path, params, {**state, "score": np.float32(0.5)}, json_default=lambda v: v.item())
    loaded, loaded_state = load_checkpoint(path)
    assert loaded.keys() == params.keys()
    for key, value in params.items():
        assert loaded[key].dtype == value.dtype and np.array_equal(loaded[key], value)
    assert loaded_state == {**state, "score": 0.5}
    assert not (tmp_path / "ck.npz.tmp").exists()


def test_a_checkpoint_never_holds_pickled_objects(tmp_path: Path) -> None:
    with pytest.raises(ValueError):  # object arrays would need pickle to load
        save_checkpoint(tmp_path / "ck.npz", {"w": np.array([{"x": 1}], dtype=object)}, {})
        load_checkpoint(tmp_path / "ck.npz")


def write_raw(path: Path, state_text: str, params: dict) -> None:
    """A checkpoint file as a crafted or damaged one could look: any state bytes, any arrays."""
    encoded = np.frombuffer(state_text.encode(), dtype=np.uint8)
    np.savez(path, __state__=encoded, **{f"param:{k}": v for k, v in params.items()})


@pytest.mark.parametrize("state_text, params, reason", [
    ("[" * 100_000 + "]" * 100_000, {}, "nests deeper"),
    ("[1, 2]", {}, "the top level is list"),
    ("{not json", {}, "not a medflare checkpoint"),
    ("{}", {"w": np.array([1.0, np.nan], np.float32)}, "'w' holds NaN"),
])
def test_a_tampered_checkpoint_is_one_line_naming_the_file(tmp_path: Path, state_text: str, params: dict,
                                                          reason: str) -> None:
    path = tmp_path / "ck.npz"
    write_raw(path, state_text, params)
    with pytest.raises(DataError, match=reason) as refused:
        load_checkpoint(path)
    assert str(path) in str(refused.value) and "\n" not in str(refused.value)


def test_a_file_that_is_no_npz_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "ck.npz"
    path.write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(DataError, match="not a medflare checkpoint"):
        load_checkpoint(path)
