"""DP-SGD at a site: per-sample clipping and Gaussian noise from Opacus, and one privacy accountant per site.

Each site's released models are (ε, δ)-DP with respect to one of its training samples, ε from the accountant
over every step the site took in the job. Sampling is Poisson with rate ``batch_size / N`` (an empty batch is
still a noised step), as the RDP and PRV accountants assume; ``DPOptimizer`` clips each sample's gradient to C,
sums, adds N(0, (σ·C)²) and divides by the expected batch size. What is *not* covered is listed per method in
``docs/privacy.md``. With ``dp_sgd``, the server and every site build the same DP-compatible model
(:func:`dp_compatible_model`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Mapping

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from medflare.config import bounded, check_fields
from medflare.errors import ConfigError, SiteDeclined

ACCOUNTANTS = ("rdp", "prv")
# Adam divides each coordinate by its own running scale, so a coordinate holding only noise moves by about lr every
# step; with C = 1 and lr 1e-3 the cnn went to the majority class at every ε <= 8 (docs/privacy.md)
ADAPTIVE_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)
ADAPTIVE_WARNING = ("dp_sgd with train.optimizer={name}: Adam-type optimizers scale DP-SGD's noise up to lr-sized "
                    "steps in every coordinate; the tested recipe is train.optimizer=sgd, momentum 0.9, lr ≈ 0.5/C, "
                    "C ≈ the median per-sample gradient norm (docs/privacy.md)")
INSTALL_HINT = "pip install 'medflare[dp]'"
SITE_POLICY_KEY = "dp_sgd"  # the object in a site's medflare_site.json


@dataclass
class DPSGDConfig:
    """A job's DP-SGD settings (``--set dp_sgd.noise_multiplier=1.1``; an empty section = DP-SGD off); the tested
    recipe is in docs/privacy.md.

    Attributes:
        noise_multiplier: σ, the noise's standard deviation over the clipping bound C (``max_grad_norm``, L2).
        delta: δ of the reported (ε, δ); keep it below 1 / (a site's training samples).
        max_epsilon: the job's budget per site (0 = none; a site's own lower one wins): a site whose next round
            would take its ε above it stops contributing.
        accountant: "rdp" (Rényi DP, Mironov 2017) or "prv" (privacy random variables, Gopi et al. 2021; tighter).
    """

    noise_multiplier: float = bounded(1.0, low=0, low_open=True)
    max_grad_norm: float = bounded(1.0, low=0, low_open=True)
    delta: float = bounded(1e-5, low=0, high=1, low_open=True, high_open=True)
    max_epsilon: float = bounded(0.0, low=0, zero="no budget")
    accountant: Literal["rdp", "prv"] = bounded("rdp", choices=ACCOUNTANTS)

    def __post_init__(self) -> None:
        check_fields(self, "dp_sgd")


@dataclass
class SiteDPPolicy:
    """What a hospital demands of DP-SGD, in its ``local/medflare_site.json`` (``"dp_sgd": {...}``): DP-SGD
    ``required`` (implied by any bound), its budget ``max_epsilon`` per job (0 = none; a job with a higher one is
    refused), the lowest σ, the largest clipping bound (0 = any) and the largest δ it accepts."""

    required: bool = False
    max_epsilon: float = 0.0
    min_noise_multiplier: float = 0.0
    max_grad_norm: float = 0.0
    max_delta: float = 1e-5

    def __post_init__(self) -> None:
        if min(self.max_epsilon, self.min_noise_multiplier, self.max_grad_norm) < 0 or not 0 < self.max_delta < 1:
            raise ConfigError("dp_sgd in medflare_site.json: max_epsilon, min_noise_multiplier and max_grad_norm must "
                              f"be >= 0 and max_delta in (0, 1), got {self}")


def site_dp_settings(cfg: DPSGDConfig | None, rules: SiteDPPolicy, site: str) -> DPSGDConfig | None:
    """The DP-SGD settings this site trains with: the job's ``cfg`` (None: it has none), checked against the site's
    ``rules`` (whose lower ``max_epsilon`` wins); None = off. Both come typed from
    :func:`medflare.site_config.resolve_site_dp`.

    Raises:
        SiteDeclined: one line naming what the job asks for and what the site demands (before any training).
    """
    if cfg is None:
        # fail closed: a floor, a ceiling or a budget demands DP-SGD as "required" does (without it ε is unbounded)
        demands = [name for name, set_ in (("required", rules.required), ("min_noise_multiplier",
                   rules.min_noise_multiplier > 0), ("max_grad_norm", rules.max_grad_norm > 0),
                   ("max_epsilon", rules.max_epsilon > 0)) if set_]
        if demands:
            raise SiteDeclined(f"{site} declines the job: its medflare_site.json's dp_sgd ({', '.join(demands)}) "
                               "requires DP-SGD and the job has none; submit it with a dp_sgd section (e.g. --set "
                               "dp_sgd.noise_multiplier=1.0)", reason="dp_policy")
        return None
    refusals = [
        (cfg.noise_multiplier < rules.min_noise_multiplier,
         f"noise_multiplier {cfg.noise_multiplier:g} is below its floor {rules.min_noise_multiplier:g}"),
        (0 < rules.max_grad_norm < cfg.max_grad_norm,
         f"max_grad_norm {cfg.max_grad_norm:g} is above its ceiling {rules.max_grad_norm:g}"),
        (cfg.delta > rules.max_delta, f"delta {cfg.delta:g} is above its max_delta {rules.max_delta:g}"),
        (0 < rules.max_epsilon < cfg.max_epsilon,
         f"max_epsilon {cfg.max_epsilon:g} is above its budget {rules.max_epsilon:g}"),
    ]
    reasons = [reason for refused, reason in refusals if refused]
    if reasons:
        raise SiteDeclined(f"{site} declines the job's dp_sgd: {'; '.join(reasons)} (its medflare_site.json)",
                           reason="dp_policy")
    budgets = [b for b in (cfg.max_epsilon, rules.max_epsilon) if b > 0]
    return dataclasses.replace(cfg, max_epsilon=min(budgets, default=0.0))


def check_method_supports_dp(method: str, blocker: str) -> None:
    """ConfigError for a method whose local update cannot be made DP (its MethodSpec's ``dp_sgd_blocker``)."""
    if blocker:
        raise ConfigError(f"dp_sgd: method '{method}' cannot train with DP-SGD: {blocker}")


def opacus() -> Any:
    """The opacus package, or a one-line ConfigError saying how to install it."""
    try:
        import opacus as package
    except ImportError:
        raise ConfigError(f"dp_sgd needs the opacus package: {INSTALL_HINT}") from None
    return package


def dp_compatible_model(model: nn.Module) -> nn.Module:
    """``model`` with every layer that mixes samples replaced by a per-sample one (BatchNorm -> GroupNorm), by
    Opacus's ``ModuleValidator.fix``, and in-place activations made out-of-place (same weights, same keys); the
    same on the server and at every site of a job with ``dp_sgd``.

    Raises:
        ConfigError: a layer Opacus cannot fix or compute per-sample gradients of (the first one, in one line).
    """
    validator = opacus().validators.ModuleValidator
    fixed = validator.fix(model)
    for layer in fixed.modules():  # an in-place activation would overwrite the output Opacus's backward hook reads
        if getattr(layer, "inplace", False) is True:
            layer.inplace = False
    problems = validator.validate(fixed, strict=False)
    if problems:
        raise ConfigError(f"dp_sgd: {type(model).__name__} cannot train with DP-SGD: {problems[0]}; choose another "
                          "--model (cnn and the resnets can)")
    return fixed


def make_accountant(kind: str) -> Any:
    """A fresh Opacus accountant: RDP or PRV."""
    accountants = opacus().accountants
    return accountants.RDPAccountant() if kind == "rdp" else accountants.PRVAccountant()


def epsilon_of(history: list[tuple[float, float, int]], delta: float, kind: str = "rdp") -> float:
    """ε at ``delta`` after the steps in ``history``: (noise multiplier, sample rate, steps) entries, as Opacus's
    accountants keep them; 0 before any step."""
    if not history:
        return 0.0
    accountant = make_accountant(kind)
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta=delta))


def noise_for_epsilon(target_epsilon: float, delta: float, sample_rate: float, steps: int, kind: str = "rdp") -> float:
    """The noise multiplier σ that spends ``target_epsilon`` at ``delta`` over ``steps`` Poisson-sampled steps
    (Opacus's ``get_noise_multiplier``); e.g. for a benchmark that sweeps ε."""
    utils = opacus().accountants.utils
    return float(utils.get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                            sample_rate=sample_rate, steps=steps, accountant=kind))


class PrivateTraining:
    """One site's DP-SGD for a whole job: the per-sample gradient hooks on its (DP-compatible) model's layers (so
    the trainer calls the model itself and its keys stay), its accountant and budget; N = ``num_samples``."""

    def __init__(self, cfg: DPSGDConfig, model: nn.Module, num_samples: int) -> None:
        if num_samples < 1:
            raise ConfigError("dp_sgd needs at least one training sample at the site")
        self.cfg = cfg
        self.num_samples = num_samples
        self.accountant = make_accountant(cfg.accountant)
        # torch notes, every step, that the first layer's input needs no gradient: true and harmless (images)
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                                "respect to module outputs since no inputs require gradients")
        # The hooks live on the model's layers; this wrapper only owns them (it is never called)
        self._hooks = opacus().GradSampleModule(model, batch_first=True, loss_reduction="mean")

    def sample_rate(self, batch_size: int) -> float:
        """q = batch_size / N, at most 1."""
        return min(1.0, batch_size / self.num_samples)

    def loader(self, dataset: Dataset, batch_size: int, num_workers: int = 0, pin_memory: bool = False) -> DataLoader:
        """Poisson-sampled batches: each sample joins each batch with probability q, 1/q batches an epoch."""
        return opacus().data_loader.DPDataLoader(dataset, sample_rate=self.sample_rate(batch_size),
                                                 num_workers=num_workers, pin_memory=pin_memory)

    def wrap(self, optimizer: torch.optim.Optimizer, batch_size: int) -> torch.optim.Optimizer:
        """``optimizer`` behind Opacus's ``DPOptimizer`` (clip each sample's gradient, sum, add noise, average over
        the expected batch size), each of its steps counted by this site's accountant. An Adam-type optimizer is
        kept as configured, with a one-line warning (:data:`ADAPTIVE_WARNING`)."""
        if isinstance(optimizer, ADAPTIVE_OPTIMIZERS):
            warnings.warn(ADAPTIVE_WARNING.format(name=type(optimizer).__name__.lower()), UserWarning, stacklevel=2)
        dp_optimizer = opacus().optimizers.DPOptimizer(
            optimizer, noise_multiplier=self.cfg.noise_multiplier, max_grad_norm=self.cfg.max_grad_norm,
            expected_batch_size=max(1, round(self.sample_rate(batch_size) * self.num_samples)), loss_reduction="mean",
        )
        dp_optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=self.sample_rate(batch_size)))
        return dp_optimizer

    @staticmethod
    def clear_per_sample_gradients(model: nn.Module) -> None:
        """Drop per-sample gradients a step left on parameters its optimizer does not hold (a frozen part)."""
        for parameter in model.parameters():
            parameter.grad_sample = None

    def epsilon(self) -> float:
        """ε spent so far at the configured δ (0 before the first step)."""
        return epsilon_of(self.accountant.history, self.cfg.delta, self.cfg.accountant)

    def epsilon_after(self, steps: int, batch_size: int) -> float:
        """ε after ``steps`` more steps at this batch size (the accountant itself is left as it is)."""
        planned = (self.cfg.noise_multiplier, self.sample_rate(batch_size), steps)
        return epsilon_of([*self.accountant.history, planned], self.cfg.delta, self.cfg.accountant)

    def check_budget(self, steps: int, batch_size: int) -> None:
        """SiteDeclined (naming ε spent, ε after and the budget) when ``steps`` more would take ε above the budget:
        the site stops contributing *before* it would overspend."""
        budget = self.cfg.max_epsilon
        if budget <= 0:
            return
        after = self.epsilon_after(steps, batch_size)
        if after > budget or math.isnan(after):
            raise SiteDeclined(
                f"DP-SGD budget spent: ε = {self.epsilon():.3f} at δ = {self.cfg.delta:g} so far, one more round "
                f"({steps} steps) would reach {after:.3f} > max_epsilon {budget:g}; this site stops contributing",
                reason="dp_budget",
            )

    def state_dict(self) -> dict[str, Any]:
        """The accountant's history (kept in the site's state file, so a restarted site keeps counting)."""
        return {"history": [list(entry) for entry in self.accountant.history], "accountant": self.cfg.accountant}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; ConfigError when another accountant than this job's kept it."""
        if state.get("accountant") != self.cfg.accountant:
            raise ConfigError(f"the site's saved DP-SGD state was kept by accountant '{state.get('accountant')}', "
                              f"this job uses '{self.cfg.accountant}'")
        self.accountant.history = [(float(s), float(q), int(n)) for s, q, n in state.get("history") or []]
