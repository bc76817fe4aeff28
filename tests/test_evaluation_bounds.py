"""evaluation.py: one site's evaluation counts cannot decide the consortium's metrics (issue 49, item 2)."""

from __future__ import annotations

import numpy as np
import pytest

from medflare.evaluation import DeclaredCounts, capped_pool, summarize
from medflare.methods.base import eval_stats


def stats(right: int, wrong: int, num_classes: int = 2):
    """Statistics of classes 0 and 1 (of ``num_classes``): ``right`` images predicted right, ``wrong`` wrong, half
    of each per class."""
    labels = np.array([0, 1] * ((right + wrong) // 2))
    probs = np.zeros((len(labels), num_classes))
    probs[np.arange(len(labels)), labels] = 1.0  # all right ...
    flip = np.arange(len(labels)) < wrong
    probs[flip] = 1.0 - probs[flip]  # ... but the first ``wrong``
    return eval_stats(labels, probs, np.zeros(len(labels)), num_classes)


def test_a_site_with_forged_counts_moves_the_pooled_metric_only_to_its_cap() -> None:
    honest = {"site-1": {"val": stats(100, 0), "test": stats(100, 0)},
              "site-2": {"val": stats(100, 0), "test": stats(100, 0)}}
    forged = {**honest, "hostile": {"val": stats(0, 10**6), "test": stats(0, 10**6)}}
    plain = summarize(forged)
    assert plain["val"]["accuracy"] < 0.001  # uncapped (research runs): the counts decide
    capped = summarize(forged, share_cap=0.6)
    # by hand: the hostile site weighs 0.6, the two honest ones 0.2 each, all right: accuracy 0.4
    assert capped["val"]["accuracy"] == pytest.approx(0.4, abs=1e-3)
    assert capped["val_capped"] == {"hostile": pytest.approx(0.6)}
    assert capped["val_stats"]["count"] == 10**6 + 200  # the record keeps the sums as reported
    assert "val_capped" not in summarize(honest, share_cap=0.6)  # nobody over the cap: the exact pooled sum


def test_under_the_cap_the_pool_is_the_exact_sum() -> None:
    parts = {"a": stats(30, 10), "b": stats(50, 10)}
    pooled, capped = capped_pool(parts, 0.6)
    assert capped == {} and pooled.count == 100 and np.array_equal(pooled.confusion, (parts["a"] + parts["b"]).confusion)


def test_a_site_whose_counts_change_during_the_job_is_refused() -> None:
    declared = DeclaredCounts()
    first = {"val": stats(10, 2), "test": stats(8, 4), "test_by_attribute": {}, "extra": {}}
    assert declared.refusal("site-1", first) == ""
    assert declared.refusal("site-1", {**first, "val": stats(11, 1)}) == ""  # same 12 images, other predictions
    why = declared.refusal("site-1", {**first, "val": stats(10**6, 0)})
    assert why.startswith("its val statistics count 1000000 images, but it declared 12 the first time")
    groups = {"0": stats(8, 4), "1": stats(2, 0)}
    assert "attribute groups count 14 test images, more than its test split's 12" in declared.refusal(
        "site-1", {**first, "test_by_attribute": groups})
    assert declared.refusal("site-2", {**first, "val": stats(10**6, 0)}) == ""  # each site declares its own


def test_the_controller_caps_one_sites_say_in_the_per_attribute_and_declared_evaluations(tmp_path, monkeypatch) -> None:
    """Issue 60, item 4: a site reporting 10^6 wrong images of attribute "1" set that group's pooled metrics
    to 0.0 (its per-attribute and declared evaluations were summed without the share cap). Through the
    controller: its results accept the sites' metas, its evaluation pools them with the job's robust.max_share."""
    from nvflare.apis.fl_context import FLContext

    from medflare import contracts
    from medflare.flare import controller as controller_module

    from .flare.test_controller_progress import started

    controller = started(False, tmp_path, monkeypatch, robust={"max_share": 0.6})
    monkeypatch.setattr(controller_module, "send_scalars", lambda *args, **kwargs: None)
    monkeypatch.setattr(controller, "fire_event", lambda *args: None)

    def meta(right: int, wrong: int) -> dict:
        part = stats(right, wrong, controller.plan.task.num_classes).to_dict()
        return {contracts.EVAL_VAL: part, contracts.EVAL_TEST: part, contracts.EVAL_TEST_BY_ATTRIBUTE: {"1": part},
                contracts.EVAL_EXTRA: {"specialization": {"test": part}}}

    record, evaluations = {"sites": {}}, {}
    for site, (right, wrong) in {"site-1": (100, 0), "site-2": (100, 0), "hostile": (0, 10**6)}.items():
        assert controller.results.accept_site_result(record, evaluations, site, meta(right, wrong),
                                                      controller.plan.task.num_classes, False) == ""
    summary = controller._record_evaluation(0, evaluations, FLContext())
    # by hand, as for the pooled metric: the hostile site weighs 0.6, the two honest ones 0.2 each, all right
    assert summary["test"]["accuracy"] == pytest.approx(0.4, abs=1e-3)
    assert summary["test_by_attribute"]["1"]["accuracy"] == pytest.approx(0.4, abs=1e-3)
    assert summary["test_by_attribute_capped"] == {"1": {"hostile": pytest.approx(0.6)}}
    assert summary["extra"]["specialization"]["test"]["accuracy"] == pytest.approx(0.4, abs=1e-3)
