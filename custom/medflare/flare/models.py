"""The server's initial global model, built by the method's own builder, holding only keys that may travel."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from medflare.config import from_dict
from medflare.registry import get_method, load_plugins


class ServerModel(nn.Module):
    """The global network as the server keeps it: its state dict leaves out the method's private keys.

    A personalized head never reaches the server, so the server neither stores nor broadcasts it. A method
    whose server holds no model (no weights travel) gets an empty state dict: FLARE's persistor then stores
    nothing to aggregate and the job still runs.
    """

    def __init__(self, network: nn.Module | None, private_keys: str | None) -> None:
        super().__init__()
        object.__setattr__(self, "network", network)  # not a submodule: keys keep the network's own names
        self._private = private_keys

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if self.network is None:
            return {}
        from medflare.contracts import Payload

        payload = Payload(private_keys=self._private)
        return {k: v for k, v in self.network.state_dict().items() if not payload.is_private(k)}


def build_global_model(
    method: str,
    model: str,
    num_classes: int,
    in_channels: int,
    image_size: int,
    pretrained: str | None = None,
    method_args: dict | None = None,
    seed: int = 0,
    plugins: list | None = None,
    dp_sgd: bool = False,
) -> nn.Module:
    """Initial global network; FLARE's PTFileModelPersistor instantiates it from the job config.

    Seeded so that the same job starts from the same weights in the simulator, POC and production. With
    ``dp_sgd`` the network is the DP-compatible one every site of the job builds
    (:func:`medflare.dp_sgd.dp_compatible_model`).
    """
    load_plugins(plugins or [])
    spec = get_method(method)
    if not spec.server_model:
        return ServerModel(None, None)
    method_cfg = from_dict(spec.config_cls, method_args or {}, f"method '{method}'")
    torch.manual_seed(seed)
    network = spec.build_model(model, num_classes, in_channels, image_size, pretrained, method_cfg)
    if dp_sgd:
        from medflare.dp_sgd import dp_compatible_model

        network = dp_compatible_model(network)
    return ServerModel(network, spec.payload.private_keys)
