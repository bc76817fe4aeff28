"""What a job's server runs, built and checked without FLARE: the method's server rule and its stages, the robust
defences, the wire format and the initial global model. The FLARE glue (:mod:`medflare.flare`) runs them;
:mod:`medflare.run_config` and :mod:`medflare.resume` check a run against them before anything starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from medflare.config import from_dict
from medflare.errors import ConfigError
from medflare.methods.base import MethodSpec, RoundContext, ServerRule, Stage
from medflare.ops import wire
from medflare.registry import get_method, load_plugins


@dataclass(frozen=True)
class RobustConfig:
    """Optional defences against one site taking over or breaking the aggregate (on in production templates).

    Attributes:
        max_norm_ratio: reject a site whose update norm ‖θ_site − θ_global‖ exceeds this multiple of the
            median norm of the other sites (0 = off; needs at least two sites).
        max_share: cap on any one site's share of every part of every aggregate (0 = off): the scalar share,
            every row of a row-weighted array, every mix the server builds from the sites' arrays
            (:mod:`medflare.ops.influence`); relaxes to equal shares when no split of this round's sites can meet it.
    """

    max_norm_ratio: float = 0.0
    max_share: float = 0.0

    def __post_init__(self) -> None:
        if self.max_norm_ratio < 0 or not 0 <= self.max_share <= 1:
            raise ConfigError(f"robust: max_norm_ratio must be >= 0 and max_share in [0, 1], got {self}")

    def record(self) -> dict[str, Any]:
        """Whether the defences are on, and with which values (0 = that defence is off): ``meta.json``'s
        ``robust_aggregation`` as the job was written, and the server's results as it ran."""
        settings = {"max_norm_ratio": float(self.max_norm_ratio), "max_share": float(self.max_share)}
        return {"on": any(settings.values()), **settings}


def server_rule(
    method: str,
    method_args: Mapping[str, Any] | None,
    num_rounds: int,
    robust: Mapping[str, Any] | None = None,
    transfer_dtype: str = "float32",
    transfer_kind: str = "weights",
    download_dtype: str = "float32",
    multi_label: bool = False,
) -> tuple[MethodSpec, ServerRule, list[Stage], RobustConfig]:
    """The method's spec, its server rule, the rule's stages and the defences for a job (the arguments are
    :class:`medflare.flare.aggregator.RoundAggregation`'s), checked as the server checks them before the first round.

    Raises:
        ConfigError: stages that do not add up to ``num_rounds``, a defence out of range, an unknown wire option,
            or a rule that combines the sites' arrays itself.
    """
    spec = get_method(method)
    method_cfg = from_dict(spec.config_cls, dict(method_args or {}), f"method '{method}'")
    rule = spec.server_rule_cls(method_cfg, num_rounds, spec.payload)
    rule.multi_label = multi_label
    stages = checked_stages(rule.stages(), num_rounds, method)
    defences = from_dict(RobustConfig, dict(robust or {}), "robust")
    rule.share_cap = defences.max_share
    if type(rule).aggregate is not ServerRule.aggregate:
        raise ConfigError(
            f"method '{method}': its server rule overrides aggregate(); a rule returns per-site weights "
            "(site_weight, site_weights, row_weights, weighting) and the server bounds and combines them"
        )
    if transfer_dtype not in wire.DTYPES or download_dtype not in wire.DTYPES or transfer_kind not in wire.KINDS:
        raise ConfigError(
            f"transfer_dtype and download_dtype must be one of {wire.DTYPES} and transfer_kind one of "
            f"{wire.KINDS}, got '{transfer_dtype}', '{download_dtype}', '{transfer_kind}'"
        )
    return spec, rule, stages, defences


def checked_stages(stages: list[Stage], num_rounds: int, method: str) -> list[Stage]:
    """The rule's stages, which must add up to the job's rounds."""
    total = sum(stage.rounds for stage in stages)
    if total != num_rounds or any(stage.rounds < 1 for stage in stages):
        plan = " + ".join(f"{s.name}={s.rounds}" for s in stages)
        raise ConfigError(
            f"method '{method}' runs stages {plan} = {total} rounds, but the job has rounds={num_rounds}; "
            "set rounds to the sum, or change the stage budgets in the method's options"
        )
    return stages


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


def round_plan(stages: list[Stage], total_rounds: int) -> list[RoundContext]:
    """One RoundContext per round, stage by stage, with job-level and in-stage counters."""
    plan, index = [], 0
    for stage in stages:
        for stage_round in range(stage.rounds):
            plan.append(
                RoundContext(
                    round=index, total_rounds=total_rounds, stage=stage.name, stage_round=stage_round,
                    stage_rounds=stage.rounds, scored=stage.scored,
                )
            )
            index += 1
    return plan


def global_model(
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
    """Initial global network (:func:`medflare.flare.models.build_global_model` is the path a job names).

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
