"""Fed-MAS's ``--preset paper``: the paper's HyperKvasir headline (spec §2(c)), as close as this stack is offline."""

from __future__ import annotations

from medflare.methods.presets import Preset

PAPER = Preset(
    overrides={
        "model": "resnet18",
        "clients": 8,
        "rounds": 200,
        "data": {"image_size": 224},
        "train": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4,
                  "batch_size": 64, "local_epochs": 10, "lr_schedule": "cosine", "min_lr": 1e-4, "grad_clip": 5.0},
        "method_args": {"lambda_f": 3.0, "aggregation": "mas", "prior_input_size": 224},
    },
    differs=(
        "ResNet-18 starts from random weights: the paper's is ImageNet-initialised, and this stack has offline "
        "ImageNet weights for efficientnet_lite0 only",
        "the prior is the offline ImageNet EfficientNet-Lite0 (method.prior=imagenet-lite0); the paper's "
        "self-supervised MoCo prior is not available offline (method.prior=moco:PATH takes a local checkpoint)",
        "images are the data source's, resized to 224 px (MedMNIST: 28 px upsampled) and normalised with mean/std "
        "0.5; HyperKvasir at 224 px with ImageNet statistics is not available offline",
        "augmentation is the method's default transform, not the paper's Flamby set (H/V flips, Gaussian blur, "
        "±10° rotation)",
        "HyperKvasir's 5-fold CV, Dirichlet(0.5) split over 8 clients and head/medium/tail thresholds 700/70 are "
        "data options: --partition dirichlet:0.5 --shot-thresholds 700 70 on a data set of that size",
        "batch 64 is the spec's recommendation (the paper does not state it); clipping at 5.0 is the authors' code",
    ),
    source="the Fed-MAS paper's HyperKvasir setting (spec §2(c))",
    setting="HyperKvasir: 8 clients, 200 rounds x 10 epochs, SGD-Nesterov cosine from 0.1",
)
