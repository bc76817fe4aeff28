"""benchmarks/transfer.py: what each variant hands FLARE arrives whole, and a real two-cell transfer runs."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import load_benchmark

transfer = load_benchmark("transfer")


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"conv.weight": rng.normal(size=(4, 1, 3, 3)).astype(np.float32),
            "bn.num_batches_tracked": np.array(7, dtype=np.int64), "fc.bias": rng.normal(size=3).astype(np.float32)}


def test_one_buffer_packs_every_array_and_unpacks_them_bit_for_bit() -> None:
    packed = transfer.pack_one_buffer(arrays())
    assert set(packed) == {"buffer", "index"} and packed["buffer"].dtype == np.uint8
    unpacked = transfer.unpack_one_buffer(packed)
    assert list(unpacked) == list(arrays())
    for key, value in arrays().items():
        assert unpacked[key].dtype == value.dtype and np.array_equal(unpacked[key], value)


def test_each_variant_counts_the_bytes_it_sends() -> None:
    full = sum(v.nbytes for v in arrays().values())
    for variant in ("fp32", "one-buffer", "tensors", "one-tensor"):
        data, check = transfer.payload_for(variant, arrays())
        assert check(data) == full, variant
    data, check = transfer.payload_for("fp16", arrays())
    assert check(data) == full - (36 + 3) * 2  # the float arrays at half their size, the int64 counter whole


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy
def test_a_model_crosses_two_flare_cells_and_arrives_whole() -> None:
    rows = [transfer.run_variant(variant, "cnn", repeats=1) for variant in ("fp32", "one-buffer")]
    expected = sum(v.nbytes for v in transfer.model_arrays("cnn").values())
    assert [row["bytes"] for row in rows] == [expected, expected]
    assert all(0 < row["mean"] < 30 for row in rows)
    assert "| one-buffer |" in transfer.markdown(rows, "cnn", 1)


def test_the_server_cell_runs_in_another_process_so_the_model_crosses_the_socket(monkeypatch) -> None:
    """FLARE hands a message between two cells of one process by a direct call: the measured transfer would then
    skip the socket (it did once, and read 2x faster)."""
    from he_cost import free_port

    started_here = []
    start_cell = transfer.start_cell

    def recording(fqcn: str, port: int):
        started_here.append(fqcn)
        return start_cell(fqcn, port)

    monkeypatch.setattr(transfer, "start_cell", recording)
    transfer.register_decomposers()
    row = transfer.measure("fp32", transfer.model_arrays("cnn"), 1, free_port(), "cnn")
    assert started_here == ["site-1"]
    assert row["bytes"] == sum(v.nbytes for v in transfer.model_arrays("cnn").values())
