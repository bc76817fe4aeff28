"""FCA's evaluation protocol is the default: each simulated site's test split follows its training class mix
(``data.eval_split=like_train``, paper §4.2, spec §6(d)), declared as ``MethodSpec.data_defaults``; the job's own
data options win, site-local data and multi-label tasks are left alone, and ``compare`` scores every method alike."""

from __future__ import annotations

import dataclasses

import pytest

from medflare import plan as plan_module
from medflare.errors import ConfigError
from medflare.evaluation import FCA_PROTOCOL_DATA
from medflare.plan import shared_data_defaults, task_of, validated
from medflare.registry import get_method
from medflare.run_config import apply_overrides, merge_run_config

ML_SOURCE = "synthetic:multilabel=1,classes=6,n=600,size=12"


def _validated(method: str, *overrides: str, data: dict | None = None):
    run = merge_run_config({"method": method, "model": "cnn", **({"data": data} if data else {})})
    run = apply_overrides(run, list(overrides))
    run = validated(run, check_files=False)
    return run


def test_a_default_fca_run_resolves_like_train_test_slices_and_records_them() -> None:
    run = _validated("fca")
    assert run.data["eval_split"] == "like_train"
    assert run.site_data()["eval_split"] == "like_train"  # what the sites (and the run's recorded config) get


def test_the_users_eval_split_wins_over_the_methods_default() -> None:
    assert _validated("fca", "data.eval_split=pooled").data["eval_split"] == "pooled"


@pytest.mark.parametrize("method", ["fedrep", "fedbabu"])
def test_the_personalized_baselines_fca_compares_follow_its_protocol(method: str) -> None:
    assert _validated(method).data["eval_split"] == "like_train"


@pytest.mark.parametrize("method", ["fedavg", "local-only"])
def test_other_methods_keep_pooled_test_slices(method: str) -> None:
    assert "eval_split" not in _validated(method).data  # DataConfig's default: pooled


def test_site_local_data_gets_no_simulation_default() -> None:
    run = _validated("fca", "task.num_classes=3", "task.in_channels=1", "task.image_size=28",
                     data={"source": "site"})
    assert "eval_split" not in run.data and "eval_split" not in run.site_data()


def test_like_train_is_not_applied_to_a_multi_label_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """A multi-label method with FCA's protocol keeps pooled slices on multi-label data (like_train needs class ids)."""
    spec = dataclasses.replace(get_method("fedavg"), data_defaults=FCA_PROTOCOL_DATA)
    monkeypatch.setattr(plan_module, "get_method", lambda name: spec)
    assert "eval_split" not in _validated("fedavg", data={"source": ML_SOURCE}).data
    assert _validated("fedavg", data={"source": "synthetic:n=60,classes=3"}).data["eval_split"] == "like_train"


def test_fca_on_multi_label_data_is_refused_by_the_method_not_by_the_split() -> None:
    run = _validated("fca", data={"source": ML_SOURCE})
    with pytest.raises(ConfigError, match="trains single-label classifiers"):
        task_of(run)


def test_compare_scores_every_method_under_one_protocol() -> None:
    assert shared_data_defaults(["fedavg", "fca"]) == {"eval_split": "like_train"}
    assert shared_data_defaults(["fedavg", "fca"], given={"eval_split": "pooled"}) == {}
    assert shared_data_defaults(["fedavg", "local-only"]) == {}
    run = merge_run_config({"method": "fedavg"})
    run = validated(run, check_files=False, data_defaults=shared_data_defaults(["fedavg", "fca"]))
    assert run.data["eval_split"] == "like_train"
