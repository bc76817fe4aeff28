"""FedLC's seams (issue 62): the calibration from the labels the site's data build produced, and the pooled
evaluation scoring the raw (uncalibrated) logits."""

from __future__ import annotations

import pytest
import torch

from ._seams import (
    check_absent_class_is_not_pushed_down,
    check_loss_is_ce_on_count_shifted_logits,
    check_pooled_test_scores_raw_logits,
)

TAU = 0.5  # spec §1.10 (the Fed-MAS repo's LCC)


def test_the_calibration_uses_the_counts_of_the_labels_the_sites_data_build_produced() -> None:
    """Zhang et al. 2022 (FedLC) as the Fed-MAS repo's LCC (spec §1.10): CE(z − τ · n_k^(−1/4), y), n_k this site's
    training counts after the job's long-tail cut (data.imbalance) and its split, floored at 1e-8, so the class the
    site lacks has its logit lowered by 100 τ = 50. Checked on the trainer's loss of its own first batch."""
    def missing_class_offset(shift: torch.Tensor) -> None:
        assert float((-shift).max()) == pytest.approx(50.0)  # the missing class: its logit lowered by 100 τ

    check_loss_is_ce_on_count_shifted_logits("fedlc", lambda counts: -TAU * counts.clamp(min=1e-8).pow(-0.25),
                                             missing_class_offset)


def test_the_pooled_test_metrics_score_the_raw_logits_not_the_calibrated_ones() -> None:
    """Zhang et al. 2022 §4 (the calibration is a training-time loss; inference uses the model's logits), Fed-MAS §3
    (B-acc of the global model): the controller's pooled test metrics are the raw logits' over the union of the test
    splits."""
    check_pooled_test_scores_raw_logits("fedlc", train={"batch_size": 32})


def test_the_loss_does_not_push_down_the_logit_of_a_class_the_site_lacks() -> None:
    """Zhang et al. 2022 §4 (calibration by n_k^(−1/4) stops a site from suppressing classes it rarely or never sees)
    and the Fed-MAS repo's count floor 1e-8 (spec §1.10): the absent class's logit is lowered by 100 τ = 50 inside
    the loss, so the loss's gradient on that class's head bias is ~0."""
    check_absent_class_is_not_pushed_down("fedlc")
