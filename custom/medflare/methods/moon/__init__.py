"""MOON: FedAvg plus a model-contrastive term pulling local representations towards the global model's."""

from dataclasses import dataclass

from medflare.methods.base import MethodSpec, builtin_method, require
from medflare.methods.moon.client import MoonTrainer

__all__ = ["MoonConfig", "SPEC"]


@dataclass
class MoonConfig:
    """MOON options."""

    mu: float = 1.0  # weight of the contrastive term; Fed-MAS Table 8 sweeps {0.01, 0.1, 1}, 1 scores best (gFL)
    temperature: float = 0.5  # τ dividing the cosine similarities (MOON and the Fed-MAS repo)

    def __post_init__(self) -> None:
        require(self.mu >= 0, f"moon mu must be >= 0, got {self.mu}")
        require(self.temperature > 0, f"moon temperature must be > 0, got {self.temperature}")


SPEC = builtin_method(
    MethodSpec(
        name="moon",
        summary="MOON: CE + mu * contrastive term (global model positive, site's previous model negative)",
        config_cls=MoonConfig,
        trainer_cls=MoonTrainer,
        reference="Li, He and Song, Model-Contrastive Federated Learning, CVPR 2021",
        multi_label=True,  # BCE instead of CE on multi-label tasks; the contrastive term needs no labels
    )
)
