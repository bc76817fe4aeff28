"""What a job's server runs, built and checked without FLARE: the method's server rule and its stages, the robust
defences, the wire format and the initial global model. The FLARE glue (:mod:`medflare.flare`) runs them;
:mod:`medflare.run_config` and :mod:`medflare.resume` check a run against them before anything starts."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping, get_args, get_type_hints

import torch
from torch import nn

from medflare.config import MAX_CLIENTS, bounded, check_value, fields_typed
from medflare.errors import ConfigError
from medflare.methods.base import MethodSpec, RoundContext, ServerRule, Stage
from medflare.ops import wire

SELECTING_RULES = ("krum", "multi_krum", "bulyan")  # choose sites by Krum score before the method weighs them
RULE_OPTIONS = {"trimmed_mean": ("trim_fraction",), "krum": ("hostile_sites",),
                "multi_krum": ("hostile_sites", "krum_keep"), "bulyan": ("hostile_sites",)}
RULE_OPTION_NAMES = ("hostile_sites", "krum_keep", "trim_fraction")  # options only some rules take
# The server's defences in every job for a real deployment (POC, production; issue 26), under the run's own robust
# settings. One hospital can neither take over nor break the aggregate: an update more than 10x the other sites'
# median norm is rejected, and no site weighs more than 60 % (feasible with the 2 sites a round needs). Honest sites
# of very different sizes stay well inside both; a forged x1e30 update or n_samples=1e8 does not.
DEPLOY_ROBUST = {"max_norm_ratio": 10.0, "max_share": 0.6}
# Both defences off, as `robust.off=true` writes it: explicit zeros, so a job says "off" instead of omitting it
ROBUST_OFF = {"max_norm_ratio": 0.0, "max_share": 0.0}
ROBUST_OFF_KEY = "off"
COORDINATE_RULES = ("median", "trimmed_mean")  # combine the sites' values per coordinate, weighted by their shares
MIN_COORDINATE_SITES = 3  # a coordinate rule outvotes one site only among three: with two, the median is the mean
# what a rule's site count comes from, for the line that refuses too few sites
RULE_NEEDS = {
    "median": "3 sites for the median to outvote one, and max_share x sites >= 1 for the cap to hold",
    "trimmed_mean": "3 sites, trim_fraction x sites >= 1 to cut a whole site from each end, and max_share x sites "
                    ">= 1 for the cap to hold",
    "krum": "n >= f + 3", "multi_krum": "n >= f + 3", "bulyan": "n >= 4f + 3"}
_TIE = 1e-9  # a fraction x sites this close to one counts as one (0.2 x 5 in floats)


@dataclass(frozen=True)
class RobustConfig:
    """Optional defences against one site taking over or breaking the aggregate (on in production templates).

    Attributes:
        max_norm_ratio: reject a site whose update norm ‖θ_site − θ_global‖ exceeds this multiple of the
            median norm of the other sites (0 = off; names an outlier only among 3 or more sites).
        max_share: cap on any one site's share of every part of every aggregate (0 = off): the scalar share,
            every row of a row-weighted array, every mix the server builds from the sites' arrays
            (:mod:`medflare.ops.influence`); relaxes to equal shares when no split of this round's sites can meet it.
        rule: how the model arrays are combined (:mod:`medflare.ops.robust_rules`): "mean" (the method's weighted
            sum), "median" or "trimmed_mean" (per coordinate, weighted by the capped shares), "krum" or
            "multi_krum" (the sites with the lowest Krum scores, then the method's weighting over them), "bulyan"
            (Krum picks, then the share-weighted mean of the values closest to the median per coordinate).
        hostile_sites: f, the sites Krum, Multi-Krum and Bulyan assume hostile (Krum needs n >= f + 3 sites,
            Bulyan n >= 4f + 3).
        trim_fraction: β of the trimmed mean: β of the share mass cut from each end per coordinate.
        krum_keep: Multi-Krum's m, the sites kept (0: n − f).
    """

    max_norm_ratio: float = bounded(0.0, low=0, zero="off")
    max_share: float = bounded(0.0, low=0, high=1, zero="off")
    rule: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum", "bulyan"] = "mean"
    hostile_sites: int = bounded(1, low=0, high=100)
    trim_fraction: float = bounded(0.2, low=0, high=0.5, low_open=True, high_open=True)
    krum_keep: int = bounded(0, low=0, high=MAX_CLIENTS, zero="n - f")

    def __post_init__(self) -> None:
        rules = get_args(get_type_hints(RobustConfig)["rule"])
        if self.max_norm_ratio < 0 or not 0 <= self.max_share <= 1:
            raise ConfigError(f"robust: max_norm_ratio must be >= 0 and max_share in [0, 1], got {self}")
        if self.rule not in rules:
            raise ConfigError(f"robust.rule must be one of {', '.join(rules)}, got '{self.rule}'")
        if not 0 <= self.hostile_sites <= 100 or self.krum_keep < 0 or not 0 < self.trim_fraction < 0.5:
            raise ConfigError("robust: hostile_sites must be in [0, 100], krum_keep >= 0 and trim_fraction in "
                              f"(0, 0.5), got {self.hostile_sites}, {self.krum_keep}, {self.trim_fraction}")
        # a weighted coordinate rule resists one site only while its share stays below what the rule tolerates
        tolerated = {"median": (0.5, "below 0.5 (e.g. 0.45)"),
                     "trimmed_mean": (self.trim_fraction + 1e-12, f"at most trim_fraction={self.trim_fraction:g}")}
        if self.rule in tolerated and not 0 < self.max_share < tolerated[self.rule][0]:
            raise ConfigError(
                f"robust.rule={self.rule} weighs each site by its share, and one site decides a coordinate once its "
                f"share reaches {'one half' if self.rule == 'median' else 'the trimmed fraction'}: set "
                f"robust.max_share {tolerated[self.rule][1]}, got {self.max_share:g}"
            )
        if self.selects and self.hostile_sites == 0:
            raise ConfigError(f"robust.rule={self.rule} with hostile_sites=0 assumes no hostile site and keeps every "
                              "site: it is no defence; set robust.hostile_sites to the sites it should resist (>= 1), "
                              "or robust.rule=mean")

    @property
    def selects(self) -> bool:
        """Whether the rule chooses sites by Krum score before they are weighed."""
        return self.rule in SELECTING_RULES

    def sites_needed(self) -> int:
        """The fewest sites for which the rule's guarantee against a hostile site holds, so the fewest a job under
        it has and a round under it aggregates (:data:`RULE_NEEDS`): Krum and Multi-Krum f + 3, Bulyan 4f + 3; the
        median and trimmed mean 3, and enough that the cap can be met (else it relaxes to equal shares) and the
        trimmed mean cuts a whole site; the mean, which guarantees nothing, 1."""
        f = self.hostile_sites
        if self.rule in COORDINATE_RULES:
            fractions = (self.max_share, self.trim_fraction) if self.rule == "trimmed_mean" else (self.max_share,)
            return max(MIN_COORDINATE_SITES, *(math.ceil(1 / fraction - _TIE) for fraction in fractions))
        return {"krum": f + 3, "multi_krum": f + 3, "bulyan": 4 * f + 3}.get(self.rule, 1)

    def needs(self, sites_needed: int | None = None) -> str:
        """The rule, the options its site count depends on, and the sites it needs, as a refusal begins."""
        options = ("trim_fraction", "max_share") if self.rule == "trimmed_mean" else \
            ("max_share",) if self.rule == "median" else ("hostile_sites",)
        settings = " and ".join(f"{option}={getattr(self, option):g}" for option in options)
        return (f"robust.rule={self.rule} with {settings} ({RULE_NEEDS.get(self.rule, 'any number of sites')}) needs "
                f"at least {sites_needed or self.sites_needed()} sites")

    def guarantee_refusal(self, sites: int, max_share: float = DEPLOY_ROBUST["max_share"],
                          max_norm_ratio: float = DEPLOY_ROBUST["max_norm_ratio"]) -> str:
        """Why these defences guarantee nothing against a hostile site among a job's ``sites`` ("" when they
        do): a rule whose guarantee holds for them, or concrete bounds: an update-norm bound of at most
        ``max_norm_ratio`` x the others' median, and no site's share above ``max_share`` (the cap, or the equal
        share it relaxes to where the sites cannot meet it). The defaults are the deployment's."""
        if self.rule != "mean" and sites >= self.sites_needed():
            return ""
        problems = [f"{self.needs()}; the job has {sites}"] if self.rule != "mean" else []
        if not self.max_norm_ratio or self.max_norm_ratio > max_norm_ratio:
            problems.append(f"max_norm_ratio={self.max_norm_ratio:g} is above {max_norm_ratio:g}" if self.max_norm_ratio
                            else "the update-norm bound is off")
        largest = max(self.max_share, 1 / max(sites, 1))  # where the sites cannot meet the cap, equal shares
        if not self.max_share or largest > max_share + _TIE:
            problems.append(f"max_share={self.max_share:g} lets one of {sites} site(s) weigh {largest:g}, above "
                            f"{max_share:g}" if self.max_share else "the share cap is off")
        return "; ".join(problems)

    def kept(self, answered: int) -> int:
        """How many of ``answered`` sites the rule keeps for the aggregate."""
        f = self.hostile_sites
        return {"krum": 1, "multi_krum": self.krum_keep or answered - f, "bulyan": answered - 2 * f}.get(
            self.rule, answered)

    def check_quorum(self, min_clients: int, sites: int | None = None) -> None:
        """Refuse (ConfigError) a rule that can never keep ``min_clients`` sites, or whose guarantee does not hold
        for the job's ``sites`` (:meth:`sites_needed`)."""
        if sites is not None and sites < self.sites_needed():
            raise ConfigError(f"{self.needs()}; the job has {sites}")
        largest = self.kept(max(sites or 0, self.sites_needed(), min_clients))
        if self.selects and largest < min_clients:
            raise ConfigError(f"robust.rule={self.rule} keeps {largest} site(s) per round and the job needs "
                              f"min_clients={min_clients}: no round could be aggregated; a rule that leaves out the "
                              f"hostile sites needs min_clients at most what it keeps (--set min_clients={largest}"
                              f"{'' if self.rule != 'krum' else ', or use multi_krum'})")

    def record(self) -> dict[str, Any]:
        """Whether the defences are on, and their values (0 = off): ``meta.json``'s ``robust_aggregation``."""
        settings: dict[str, Any] = {"max_norm_ratio": float(self.max_norm_ratio), "max_share": float(self.max_share)}
        if self.rule != "mean":  # the method's own weighted sum is recorded by its absence, as before rules existed
            settings["rule"] = self.rule
            settings.update({option: getattr(self, option) for option in RULE_OPTIONS.get(self.rule, ())})
        return {"on": any(settings.values()), **settings}


def server_rule(
    spec: MethodSpec,
    method_args: Any,
    num_rounds: int,
    robust: Mapping[str, Any] | None = None,
    transfer_dtype: str = "float32",
    transfer_kind: str = "weights",
    download_dtype: str = "float32",
    multi_label: bool = False,
) -> tuple[ServerRule, list[Stage], RobustConfig]:
    """The method's server rule, its stages and the job's defences, checked as the server does before round 0.
    Raises ConfigError for stages that do not add up to ``num_rounds``, a defence out of range, an unknown wire
    option, or a rule that combines the sites' arrays itself."""
    method = spec.name
    method_cfg = spec.config_of(method_args)
    rule = spec.server_rule_cls(method_cfg, num_rounds, spec.payload_of(method_cfg))
    rule.multi_label = multi_label
    stages = checked_stages(rule.stages(), num_rounds, method)
    defences = robust if isinstance(robust, RobustConfig) else RobustConfig(**typed_robust(robust or {}))
    rule.share_cap = defences.max_share
    if defences.rule != "mean" and not spec.server_model:
        raise ConfigError(f"robust.rule={defences.rule} combines the sites' models, and method '{method}' has no "
                          "global model to combine (no weights travel); leave robust.rule at mean")
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
    return rule, stages, defences


def typed_robust(robust: Mapping[str, Any]) -> dict[str, Any]:
    """The run's own robust settings, typed and range-checked; ``off: true`` becomes both defences at 0 (refused
    beside a defence it would silently drop)."""
    settings = dict(robust)
    valid = [field.name for field in dataclasses.fields(RobustConfig)]
    unknown = sorted(set(settings) - {*valid, ROBUST_OFF_KEY})
    if unknown:
        raise ConfigError(f"robust: unknown option(s) {', '.join(unknown)}; valid options: "
                          f"{', '.join([*valid, ROBUST_OFF_KEY])}")
    off = check_value(settings.pop(ROBUST_OFF_KEY, False), bool, f"robust.{ROBUST_OFF_KEY}", True)
    typed = fields_typed(RobustConfig, settings, "robust")
    defences = RobustConfig(**typed)  # the ranges
    unused = sorted(set(typed) & set(RULE_OPTION_NAMES) - set(RULE_OPTIONS.get(defences.rule, ())))
    if unused:
        raise ConfigError(f"robust.{unused[0]} is an option of another rule than robust.rule={defences.rule} "
                          f"(it takes {', '.join(RULE_OPTIONS.get(defences.rule, ())) or 'no options'})")
    kept_on = [f"robust.{key}={typed[key]:g}" for key in ROBUST_OFF if typed.get(key)]
    kept_on += [f"robust.rule={defences.rule}"] if defences.rule != "mean" else []
    if off and kept_on:
        raise ConfigError(f"robust.off=true turns every defence off, but {' and '.join(kept_on)} keeps one on; "
                          "drop one of the two")
    return dict(ROBUST_OFF) if off else typed


def deployment_robust(robust: Mapping[str, Any], encrypted: bool = False) -> dict[str, float]:
    """:data:`DEPLOY_ROBUST` under the run's own settings, key by key: a defence is off only where the run says so,
    never because a setting was left out. An ``encrypted`` job defaults the norm bound to off (the server cannot
    read the updates); the share cap stays, as it bounds the server's own plaintext weights."""
    defaults = {**DEPLOY_ROBUST, "max_norm_ratio": 0.0} if encrypted else DEPLOY_ROBUST
    return {**defaults, **typed_robust(robust)}


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
    """The global network as the server keeps it: its state dict leaves out the method's private keys (a personal
    head is neither stored nor broadcast). A method without a server model gets an empty state dict, so FLARE's
    persistor stores nothing and the job still runs."""

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
    per_stage = [(stage, stage_round) for stage in stages for stage_round in range(stage.rounds)]
    return [RoundContext(round=index, total_rounds=total_rounds, stage=stage.name, stage_round=stage_round,
                         stage_rounds=stage.rounds, scored=stage.scored)
            for index, (stage, stage_round) in enumerate(per_stage)]


@dataclass(frozen=True)
class GlobalNetwork:
    """What a job's initial global network is built from, as one typed value (``RunPlan.network``, or a saved
    model's facts): the method and its config, the model, the task's shape, the initial weights, the seed and
    whether it trains with DP-SGD."""

    spec: MethodSpec
    method_cfg: Any
    model: str
    num_classes: int
    in_channels: int
    image_size: int
    pretrained: str | None = None
    seed: int = 0
    dp_sgd: bool = False


def global_model(network: GlobalNetwork) -> nn.Module:
    """Initial global network of ``network.spec``, seeded so a job starts from the same weights in the simulator,
    POC and production; with ``dp_sgd``, the DP-compatible one every site builds."""
    spec = network.spec
    if not spec.server_model:
        return ServerModel(None, None)
    torch.manual_seed(network.seed)
    built = spec.build_model(network.model, network.num_classes, network.in_channels, network.image_size,
                             network.pretrained, spec.config_of(network.method_cfg))
    if network.dp_sgd:
        from medflare.dp_sgd import dp_compatible_model

        built = dp_compatible_model(built)
    return ServerModel(built, spec.payload.private_keys)
