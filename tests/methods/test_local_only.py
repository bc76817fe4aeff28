"""local-only: the site's whole model is its state, so a restarted site continues with its own model."""

from __future__ import annotations

import numpy as np

from medflare.methods.base import RoundContext
from medflare.ops import model_params
from medflare.registry import get_method

from ._trainers import make_trainer, tiny_classifier
from .conftest import make_site


def test_the_whole_model_survives_a_state_round_trip_and_nothing_is_shared() -> None:
    site = make_site()
    trainer = make_trainer("local-only", tiny_classifier(), site, max_steps=2)
    trainer.train_round(RoundContext(0, 2))
    fresh = make_trainer("local-only", tiny_classifier(seed=7), site)
    fresh.load_state(trainer.state_dict())
    mine, restored = model_params(trainer.model), model_params(fresh.model)
    assert set(restored) == set(mine) and all(np.array_equal(restored[k], v) for k, v in mine.items())
    assert trainer.outgoing_arrays() == {}
    assert get_method("local-only").payload.shared_keys(list(mine)) == []
