"""Model registry and factory: every network behind one interface (:class:`Classifier`).

Importing a family module registers its models; add a family by adding one import line below. Models from outside
medflare (a job's plugin file, an installed package's ``medflare.models`` entry point): ``models/_registry.py``.
"""

from medflare.models import cifar_resnet, cnn, efficientnet_lite, torchvision_nets, vit  # noqa: F401  (registers)
from medflare.models._factory import IMAGENET, create_model
from medflare.models._registry import (
    ENTRY_POINT_GROUP,
    ModelInfo,
    get_model_info,
    is_model,
    list_models,
    register_model,
)
from medflare.models.classifier import Classifier, CosineLinear
from medflare.models.device import get_device, place_model
from medflare.models.efficientnet_lite import (
    IMAGENET_LITE0_MEAN,
    IMAGENET_LITE0_STD,
    imagenet_lite0_weights_path,
    load_imagenet_lite0_state_dict,
)
from medflare.models.ema import EmaTeacher
from medflare.models.weights import WeightsReport, load_weights, read_state_dict_file

__all__ = [
    "ENTRY_POINT_GROUP",
    "IMAGENET",
    "IMAGENET_LITE0_MEAN",
    "IMAGENET_LITE0_STD",
    "Classifier",
    "CosineLinear",
    "EmaTeacher",
    "ModelInfo",
    "WeightsReport",
    "create_model",
    "get_device",
    "get_model_info",
    "imagenet_lite0_weights_path",
    "is_model",
    "list_models",
    "load_imagenet_lite0_state_dict",
    "load_weights",
    "place_model",
    "read_state_dict_file",
    "register_model",
]
