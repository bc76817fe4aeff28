"""BSM-FL's seams (issue 62): the class prior from the labels the site's data build produced, and the pooled
evaluation scoring the raw logits."""

from __future__ import annotations

import torch

from ._seams import (
    check_absent_class_is_not_pushed_down,
    check_loss_is_ce_on_count_shifted_logits,
    check_pooled_test_scores_raw_logits,
)

EPS = 1e-12  # Fed-MAS's prior floor (spec §1.1)


def test_the_prior_is_the_frequency_of_the_labels_the_sites_data_build_produced() -> None:
    """Ren et al. 2020 (balanced softmax) as Fed-MAS's BSM-FL (spec §1.1): CE(z + log(π + eps), y), π the site's
    training-set class frequency after the job's long-tail cut (data.imbalance) and its split; the class the site
    lacks gets log(1e-12) ≈ −27.6. Checked on the trainer's loss of its own first batch."""
    def missing_class_floor(log_prior: torch.Tensor) -> None:
        assert float(log_prior.min()) < -27  # the missing class

    check_loss_is_ce_on_count_shifted_logits("bsm-fl", lambda counts: torch.log(counts / counts.sum() + EPS),
                                             missing_class_floor)


def test_the_pooled_test_metrics_score_the_raw_logits_not_the_prior_shifted_ones() -> None:
    """Spec §1.1: 'Use the adjusted logits only in the loss. Prediction and evaluation use the raw logits.' Fed-MAS
    §3 (B-acc of the global model): the controller's pooled test metrics, from every site's evaluation counts, are
    the raw logits' balanced accuracy and CE over the union of the test splits."""
    check_pooled_test_scores_raw_logits("bsm-fl", train={"batch_size": 32})


def test_the_loss_does_not_push_down_the_logit_of_a_class_the_site_lacks() -> None:
    """Spec §1.1: 'Classes missing from a client's data get an offset near −20 to −28. That is intended: the client
    does not push those logits down.' (Ren et al. 2020 §3.1: the softmax is shifted by the local label prior.) On a
    site the data build left without a class, the loss's gradient on that class's head bias is ~0."""
    check_absent_class_is_not_pushed_down("bsm-fl")
