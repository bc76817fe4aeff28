"""A MONAI network as a medflare model: DenseNet-121 in 2-D, registered as ``monai_densenet121``.

This file is a plugin (BYOC): the job carries it as ``app/custom/medflare_plugins/monai_densenet.py`` and every
site and the server import it before building the model. Run from the repository root:

    medflare run fedavg --model monai_densenet121 --set 'plugins=["examples/own_model/monai_densenet.py"]' \\
        --data synthetic:n=400,classes=2,channels=1,size=32 --rounds 2 --max-steps 5

A pre-installed site refuses jobs that carry code: install the same function in a package there instead
(``examples/own_model/my_models/`` shows how). See docs/own-model-and-data.md.
"""

from __future__ import annotations

from monai.networks.nets import DenseNet121
from torch import nn

from medflare.errors import ConfigError
from medflare.models import Classifier, register_model

# Four dense blocks, three 2x2 average pools after a stride-4 stem: a side below 32 px shrinks to nothing.
SMALLEST_SIDE = 32


@register_model("monai_densenet121")
def monai_densenet121(*, num_classes: int, in_channels: int, image_size: int) -> Classifier:
    """MONAI's DenseNet-121 (``spatial_dims=2``), 1024 pooled features, MONAI's own initialisation."""
    if image_size < SMALLEST_SIDE:
        raise ConfigError(f"monai_densenet121 needs images of at least {SMALLEST_SIDE} px, got {image_size}; "
                          f"add --set data.image_size={SMALLEST_SIDE}")
    network = DenseNet121(spatial_dims=2, in_channels=in_channels, out_channels=num_classes)
    head = network.class_layers.out  # MONAI's final Linear becomes medflare's head ...
    network.class_layers.out = nn.Identity()  # ... so the rest returns the pooled features
    return Classifier(network, head)
