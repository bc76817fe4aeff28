"""FCA's ``--preset paper``: the paper's Fed-ISIC2019 headline (spec §6(c)), as close as this stack is offline."""

from __future__ import annotations

from medflare.methods.presets import Preset

PAPER = Preset(
    overrides={
        "model": "efficientnet_b0",
        "clients": 6,
        "rounds": 80,
        "data": {"image_size": 224, "eval_split": "like_train"},
        "train": {"optimizer": "adam", "lr": 1e-3, "weight_decay": 5e-4, "batch_size": 64, "local_epochs": 1,
                  "lr_schedule": "multistep", "milestones": [60, 70], "gamma": 0.1},
        "method_args": {"lambda_fed": 1.0, "lambda_personal": 3.0, "consistency": "kl", "consistency_weight": 1.0,
                        "temperature": 1.0},
    },
    differs=(
        "EfficientNet-B0 starts from random weights: the paper's is ImageNet-initialised, and offline ImageNet "
        "weights exist here only for EfficientNet-Lite0 (--model efficientnet_lite0 --pretrained imagenet)",
        "images are the data source's, resized to 224 px (MedMNIST: 28 px upsampled) and normalised with mean/std "
        "0.5; the paper's are FLamby-preprocessed ISIC 2019 images with ImageNet statistics",
        "augmentation is the method's default transform, not the paper's (H/V flips, Gaussian blur, ±10° rotation)",
        "the 6 FLamby centres are real hospitals; on a simulated source the sites are a split of it (e.g. "
        "--partition dirichlet:0.5), each site's test split following its training class mix",
    ),
    source="the FCA paper and the authors' notebook (spec §6(c))",
    setting="Fed-ISIC2019: 6 centres, 80 rounds x 1 epoch, Adam 1e-3 with lr x0.1 at rounds 60 and 70",
)
