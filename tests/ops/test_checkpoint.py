"""Round checkpoints: arrays and JSON state round-trip exactly, atomically, without pickle."""

from pathlib import Path

import numpy as np
import pytest

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
