"""Each round's reference cycles are freed when the round ends, on the server and at the sites."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from medflare.flare.memory import collect_round_garbage, freeze_startup_objects
from medflare.run_config import RunConfig
from medflare.simulate import run_simulation


class Holder:
    """Stands in for FLARE's stream objects: a cycle that keeps a large buffer alive."""

    def __init__(self) -> None:
        self.buffer = np.ones(1_000_000, dtype=np.float32)
        self.me = self


def cycle_holding_a_buffer() -> weakref.ref:
    return weakref.ref(Holder().buffer)


@pytest.fixture
def automatic_gc_off() -> Iterator[None]:
    """Without automatic collections only an explicit one frees a cycle, so the tests can fail."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_the_round_collection_frees_a_cycle_that_holds_a_buffer(automatic_gc_off: None) -> None:
    buffer = cycle_holding_a_buffer()
    assert buffer() is not None  # the control: dropping the last name frees nothing in a cycle
    assert collect_round_garbage() >= 2
    assert buffer() is None


def test_frozen_start_up_objects_do_not_hide_a_later_rounds_garbage(automatic_gc_off: None) -> None:
    started = cycle_holding_a_buffer()
    try:
        freeze_startup_objects()  # collects first: a start-up cycle already dead is not kept forever
        assert started() is None
        later = cycle_holding_a_buffer()
        collect_round_garbage()
        assert later() is None
    finally:
        gc.unfreeze()


@pytest.mark.slow
def test_the_server_collects_after_every_round_in_the_simulator(tmp_path: Path) -> None:
    config = RunConfig(method="fedavg", rounds=2, clients=2, data={"source": "synthetic:n=240,classes=3"},
                       train={"max_steps": 2, "batch_size": 16})
    run_simulation(config, tmp_path / "run", echo=lambda line: None)
    rounds = json.loads((tmp_path / "run" / "medflare_results.json").read_text())["rounds"]
    assert len(rounds) == 2
    for record in rounds:
        assert record["gc_objects_freed"] > 0  # every round's transfers leave cycles behind
        assert 0.0 <= record["server_seconds"]["gc"] < 1.0
