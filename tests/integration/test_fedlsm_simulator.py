"""`medflare run fedlsm` in FLARE's simulator: multi-label synthetic data (with the label_counts set-up phase)
and single-label RetinaMNIST with explicit identified classes per site. (Single-label synthetic data runs in
tests/integration/test_every_method_simulator.py through FedLSM's smoke settings.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from medflare.console.cli import main

from ._rescoring import rescore_global_model, rescore_multi_label_model, run_of_summary
from ._smoke import check_audit
from .test_every_method_simulator import audit_records

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

ML_SOURCE = "synthetic:multilabel=1,classes=4,n=240,size=16"


def test_multi_label_fedlsm_sets_up_pos_weight_once_and_reports_per_class_auroc(tmp_path: Path) -> None:
    out = tmp_path / "ml"
    code = main(["run", "fedlsm", "--data", ML_SOURCE, "--partition", "labelset:2", "--clients", "2", "--rounds", "2",
                 "--batch-size", "24", "--max-steps", "3", "--out", str(out), "--set", "audit=true",
                 "--set", "method.local_iterations=3"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    run = run_of_summary(summary)
    assert summary["config"]["task"]["multi_label"] is True

    for site in run.site_names:  # the set-up phase ran in round 0 only; pos_weight came with every train task
        records = audit_records(out, site)
        checked = check_audit(records, "fedlsm", [k for k in records[2]["arrays"] if k != "pos_weight"])
        assert checked == {"label_counts": 1, "train": 2, "validate": 1}
        trains = [r for r in records if r["direction"] == "task" and r["task"] == "train"]
        assert all(r["arrays"]["pos_weight"] == ["float32", [4]] for r in trains)
    pos_weight = summary["per_round"][0]["pos_weight"]
    assert len(pos_weight) == 4 and all(w > 1 for w in pos_weight)  # every finding is rarer than 50 %
    assert set(summary["per_round"][-1]["q"]) == set(run.site_names)

    final, rescored = summary["final"], rescore_multi_label_model(out, run)
    assert len(final["per_class_auc"]) == 4
    assert final["accuracy"] == pytest.approx(rescored["accuracy"], abs=1e-12)
    assert final["macro_f1"] == pytest.approx(rescored["macro_f1"], abs=1e-12)
    assert final["auc_macro_ovr"] == pytest.approx(rescored["binned_auc_macro_ovr"], abs=1e-9)
    assert abs(final["auc_macro_ovr"] - rescored["auc_macro_ovr"]) <= rescored["auc_bound"]  # the stated bound
    assert summary["best"]["model_version"] in (0, 1, 2) and "auc_macro_ovr" in summary["best"]


@pytest.mark.realdata
@pytest.mark.heavy  # make test-heavy
def test_fedlsm_on_retinamnist_with_two_or_three_identified_grades_per_site(
    tmp_path: Path, medmnist_file
) -> None:
    path = medmnist_file("retinamnist.npz")  # MD5-checked
    identified = [[0, 1], [1, 2, 3], [3, 4], [0, 2, 4], [2, 3]]
    out = tmp_path / "retina"
    code = main(["run", "fedlsm", "--data", f"medmnist:{path}", "--clients", "5", "--rounds", "2",
                 "--batch-size", "32", "--max-steps", "2", "--out", str(out),
                 "--set", f"data.identified={json.dumps(identified)}", "--set", "method.local_iterations=2"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    run = run_of_summary(summary)
    for index, site in enumerate(run.site_names):
        facts = summary["clients"][site]
        assert facts["identified"] == [k in identified[index] for k in range(5)]
        annotated = np.array(facts["class_counts"]) > 0
        assert annotated.tolist() == facts["identified"]  # the other grades are unlabelled at this site
        q = np.array(summary["per_round"][-1]["q"][site])
        assert (q[annotated] > 0).all()  # labels drawn this round count in q
    assert summary["final"]["balanced_accuracy"] == pytest.approx(
        rescore_global_model(out, run)["balanced_accuracy"], abs=1e-12)
