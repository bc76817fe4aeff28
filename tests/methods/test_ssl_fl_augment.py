"""SSL-FL's training views per stage: the scripts' pre-training and fine-tuning recipes by default (spec §4(c)),
one option per stage, and the stage's dataset drawing them over the site's own training images."""

from __future__ import annotations

import pytest
import torch

from medflare.data import build_transform
from medflare.errors import ConfigError
from medflare.methods.ssl_fl import FedBeitConfig, FedMaeConfig
from medflare.registry import get_method
from medflare.site_config import SiteSettings, TaskSpec
from medflare.site_runtime import SiteRuntime

TASK = TaskSpec(num_classes=3, in_channels=3, image_size=28)
DATA = {"source": "synthetic:n=60,classes=3", "num_sites": 2, "partition": "iid", "label_fraction": 0.5}


def _trainer(method: str, method_args: dict | None = None):
    settings = SiteSettings(spec=get_method(method), task=TASK, data=DATA, model="vit_micro", method_args=method_args or {},
                            train={"max_steps": 1, "batch_size": 8}, evaluation="off")
    return SiteRuntime(settings, "site-1", 0, log=lambda message: None).trainer


def _augment(trainer, stage: str) -> str:
    """The recipe of the dataset ``stage`` trains on (fine-tuning's is a subset of the labelled images)."""
    trainer._stage = stage
    dataset = trainer.train_dataset()
    return getattr(dataset, "dataset", dataset).transform.augment


def test_defaults_are_the_scripts_recipes_per_method_and_stage() -> None:
    """MAE: crop-grey-jitter-flip; BEiT: the same ops with the crop last; both fine-tune with crop 0.6-1, rotation
    10° and flip; not the generic flip + affine every other method trains with."""
    assert (FedMaeConfig().pretrain_augment, FedMaeConfig().finetune_augment) == ("mae_pretrain", "ssl_finetune")
    assert (FedBeitConfig().pretrain_augment, FedBeitConfig().finetune_augment) == ("beit_pretrain", "ssl_finetune")


@pytest.mark.parametrize("method, stages", [
    ("fed-mae", {"pretrain": "mae_pretrain", "finetune": "ssl_finetune"}),
    ("fed-beit", {"tokenizer": "beit_pretrain", "pretrain": "beit_pretrain", "finetune": "ssl_finetune"}),
])
def test_each_stage_trains_on_its_recipe_by_default(method: str, stages: dict[str, str]) -> None:
    trainer = _trainer(method)
    assert trainer.data.train.transform.augment == "basic"  # the site's data.augment: not what SSL-FL trains on
    assert {stage: _augment(trainer, stage) for stage in stages} == stages


def test_a_user_picks_each_stages_augmentation_and_unknown_names_are_refused() -> None:
    trainer = _trainer("fed-mae", {"pretrain_augment": "none", "finetune_augment": "basic"})
    assert (_augment(trainer, "pretrain"), _augment(trainer, "finetune")) == ("none", "basic")
    with pytest.raises(ConfigError, match="pretrain_augment and finetune_augment must be one of"):
        FedMaeConfig(finetune_augment="randaugment")


def test_stage_datasets_hold_the_sites_images_in_order_pretraining_all_finetuning_the_labelled() -> None:
    trainer = _trainer("fed-mae", {"pretrain_augment": "none", "finetune_augment": "none"})
    train = trainer.data.train
    labelled = [i for i in range(len(train)) if train.labels[i] >= 0]
    trainer._stage = "pretrain"
    pretrain = trainer.train_dataset()
    assert len(pretrain) == len(train)
    unaugmented = build_transform(3, 28, train=False)
    assert torch.equal(pretrain[3][0], unaugmented(train.images.get_image(3)))
    trainer._stage = "finetune"
    finetune = trainer.train_dataset()
    assert list(finetune.indices) == labelled and finetune[0][1] == train.labels[labelled[0]]
    assert torch.equal(finetune[0][0], unaugmented(train.images.get_image(labelled[0])))
