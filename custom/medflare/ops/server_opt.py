"""Server optimizers: the FedOpt family (Reddi et al. 2021, "Adaptive Federated Optimization", Algorithm 2: FedAdam,
FedYogi, FedAdagrad) and FedAvgM (Hsu et al. 2019), stepping the global model on the pseudo-gradient
Δ = aggregate − global after whatever (bounded, robust) aggregate the method's weighting produced.

Pure numpy. Every rule keeps its buffers (m, v per float array, in float64) on the server only: they never enter
the global model, so nothing of them is sent to a site. Integer buffers (BatchNorm's ``num_batches_tracked``) keep the
plain aggregate. Reddi et al.'s Algorithm 2, per coordinate, with v₋₁ = τ² and m₋₁ = 0 (no bias correction)::

    m = β₁ m + (1 − β₁) Δ
    v = β₂ v + (1 − β₂) Δ²                     (Adam)
    v = v − (1 − β₂) Δ² sign(v − Δ²)           (Yogi)
    v = v + Δ²                                 (Adagrad)
    x = x + η m / (√v + τ)

FedAvgM (Hsu et al. 2019, §3): v = β v + Δ, x = x + η v.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Mapping

import numpy as np

from medflare.config import bounded, check_fields, fields_typed
from medflare.errors import ConfigError

OPTIMIZERS = ("none", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
ADAPTIVE = ("fedadam", "fedyogi", "fedadagrad")
# η when server_optimizer.lr is 0: FedAvgM's server learning rate 1 (Hsu et al. 2019, §3: plain FedAvg at β = 0);
# the adaptive rules' η are Flower's strategy defaults (FedAdam, FedAdagrad 1e-1; FedYogi 1e-2): Reddi et al. tune η
# per task (Table 2, Appendix D)
DEFAULT_LR = {"fedavgm": 1.0, "fedadam": 1e-1, "fedyogi": 1e-2, "fedadagrad": 1e-1}
# the options each rule reads (any other one set beside it is refused: it would be silently ignored)
RULE_OPTIONS = {"fedavgm": ("lr", "momentum"), "fedadam": ("lr", "beta1", "beta2", "tau"),
                "fedyogi": ("lr", "beta1", "beta2", "tau"), "fedadagrad": ("lr", "beta1", "tau"), "none": ()}
SECTION = "server_optimizer"
STATE_PREFIX = "server_optimizer:"  # a checkpoint's optimizer buffers: "server_optimizer:m/<key>", ".../v/<key>"


@dataclass(frozen=True)
class ServerOptConfig:
    """A job's server optimizer (``--set server_optimizer.name=fedadam``; empty or ``name=none``: the aggregate is
    the next global model, as in FedAvg).

    Attributes:
        name: none, fedavgm, fedadam, fedyogi or fedadagrad.
        lr: the server learning rate η (0: the rule's default, :data:`DEFAULT_LR`).
        beta1: β₁, the decay of the first moment m (Reddi et al. 2021, §5: 0.9).
        beta2: β₂, the decay of the second moment v, Adam and Yogi (Reddi et al. 2021, §5: 0.99).
        tau: τ, the adaptivity (Reddi et al. 2021 tune it; 1e-3 is Flower's FedYogi default).
        momentum: β of FedAvgM's server momentum (Hsu et al. 2019: 0.9).
    """

    name: Literal["none", "fedavgm", "fedadam", "fedyogi", "fedadagrad"] = bounded("none", choices=OPTIMIZERS)
    lr: float = bounded(0.0, low=0, zero="the rule's default")
    beta1: float = bounded(0.9, low=0, high=1, high_open=True)
    beta2: float = bounded(0.99, low=0, high=1, high_open=True)
    tau: float = bounded(1e-3, low=0, low_open=True)
    momentum: float = bounded(0.9, low=0, high=1, high_open=True)

    def __post_init__(self) -> None:
        check_fields(self, SECTION)

    @property
    def on(self) -> bool:
        return self.name != "none"

    @property
    def step_size(self) -> float:
        """η: the configured one, else the rule's default."""
        return self.lr or DEFAULT_LR[self.name]


def typed_server_optimizer(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The run's ``server_optimizer`` section typed and range-checked (unknown keys refused); an option the chosen
    rule does not read is refused, as it would be ignored."""
    typed = fields_typed(ServerOptConfig, dict(settings), SECTION)
    config = ServerOptConfig(**typed)
    unused = sorted(set(typed) - {"name", *RULE_OPTIONS[config.name]})
    if unused:
        raise ConfigError(f"{SECTION}.{unused[0]} is not read by {SECTION}.name={config.name} (it reads "
                          f"{', '.join(RULE_OPTIONS[config.name]) or 'nothing'}); drop it")
    return typed


def written_server_optimizer(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The section as a job carries it: every option the rule reads, η resolved (empty when there is no rule), so
    the plan says exactly what ran."""
    config = ServerOptConfig(**typed_server_optimizer(settings))
    if not config.on:
        return {}
    values = {option: getattr(config, option) for option in RULE_OPTIONS[config.name]}
    return {"name": config.name, **values, "lr": config.step_size}


def server_optimizer_refusal(config: ServerOptConfig, method: str, server_model: bool, encrypted: bool) -> str:
    """Why ``config`` cannot run with this job ("" = it can): the rule steps a global model the server must hold
    and read in plaintext."""
    if not config.on:
        return ""
    if not server_model:
        return (f"{SECTION}.name={config.name} steps the server's global model, and method '{method}' has no "
                "global model on the server; drop server_optimizer")
    if encrypted:
        return (f"{SECTION}.name={config.name} needs the aggregate in plaintext, and secure_aggregation=he keeps "
                "it encrypted on the server; drop one of them")
    return ""


def check_server_optimizer(config: ServerOptConfig, method: str, server_model: bool, encrypted: bool) -> None:
    """ConfigError (one line) unless ``config`` can run with the job (:func:`server_optimizer_refusal`)."""
    refusal = server_optimizer_refusal(config, method, server_model, encrypted)
    if refusal:
        raise ConfigError(refusal)


# ----- the rules ------------------------------------------------------------------------------------------------
def adam_moment(v: np.ndarray, squared: np.ndarray, beta2: float) -> np.ndarray:
    """Adam's second moment: the β₂ moving average of Δ²."""
    return beta2 * v + (1 - beta2) * squared


def yogi_moment(v: np.ndarray, squared: np.ndarray, beta2: float) -> np.ndarray:
    """Yogi's additive update: v moves towards Δ² by (1 − β₂) Δ², never multiplied down by β₂."""
    return v - (1 - beta2) * squared * np.sign(v - squared)


def adagrad_moment(v: np.ndarray, squared: np.ndarray, beta2: float) -> np.ndarray:
    """Adagrad's second moment: the sum of every Δ² (β₂ unused)."""
    return v + squared


SECOND_MOMENTS: dict[str, Callable[[np.ndarray, np.ndarray, float], np.ndarray]] = {
    "fedadam": adam_moment, "fedyogi": yogi_moment, "fedadagrad": adagrad_moment}


@dataclass
class ServerOptimizer:
    """One job's server optimizer and its buffers (``m``, ``v``: key -> float64 array; FedAvgM keeps its momentum
    in ``m``). The state lives here, on the server, and only here."""

    config: ServerOptConfig
    m: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    v: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def step(self, current: Mapping[str, np.ndarray], aggregate: Mapping[str, np.ndarray],
             keys: Iterable[str]) -> dict[str, np.ndarray]:
        """The next global model: ``aggregate`` with each float array of ``keys`` replaced by the rule's step from
        ``current`` on Δ = aggregate − current (in float64, back in the current array's dtype); the other arrays
        (integer buffers, keys the round did not train) as aggregated."""
        stepped = dict(aggregate)
        for key in keys:
            x = np.asarray(current[key])
            if x.dtype.kind != "f":
                continue
            delta = np.asarray(aggregate[key], np.float64) - x.astype(np.float64)
            stepped[key] = (x.astype(np.float64) + self._update(key, delta)).astype(x.dtype)
        return stepped

    def _update(self, key: str, delta: np.ndarray) -> np.ndarray:
        """The step added to the current array for pseudo-gradient ``delta``; updates the key's buffers."""
        cfg, eta = self.config, self.config.step_size
        if cfg.name == "fedavgm":
            self.m[key] = cfg.momentum * self.m.get(key, np.zeros_like(delta)) + delta
            return eta * self.m[key]
        self.m[key] = cfg.beta1 * self.m.get(key, np.zeros_like(delta)) + (1 - cfg.beta1) * delta
        previous = self.v.get(key, np.full_like(delta, cfg.tau ** 2))  # Algorithm 2: v₋₁ >= τ²
        self.v[key] = SECOND_MOMENTS[cfg.name](previous, delta * delta, cfg.beta2)
        return eta * self.m[key] / (np.sqrt(self.v[key]) + cfg.tau)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """The buffers as checkpoint arrays (:data:`STATE_PREFIX`), for the server's resume checkpoint only; each
        round's step replaces the arrays, so a background write of these needs no copy."""
        return {f"{STATE_PREFIX}{name}/{key}": value for name, buffers in (("m", self.m), ("v", self.v))
                for key, value in buffers.items()}

    def restore(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Continue from :meth:`state_arrays` of an earlier job (its other arrays ignored)."""
        for name, value in arrays.items():
            if name.startswith(STATE_PREFIX):
                buffer, _, key = name[len(STATE_PREFIX):].partition("/")
                {"m": self.m, "v": self.v}[buffer][key] = np.asarray(value, np.float64)


def split_state(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A checkpoint's arrays as (the model, the server optimizer's buffers)."""
    model = {k: v for k, v in arrays.items() if not k.startswith(STATE_PREFIX)}
    return model, {k: v for k, v in arrays.items() if k.startswith(STATE_PREFIX)}
