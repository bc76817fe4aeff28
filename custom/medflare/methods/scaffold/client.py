"""SCAFFOLD's site update (Karimireddy et al. 2020, Algorithm 1 with option II): each local SGD step is corrected by
the control variates, y ← y − η_l (g(y) − c_i + c), and after the round's K steps the site's own control becomes
c_i⁺ = c_i − c + (x − y) / (K η_l). The site sends its weights y (the usual weight path: the server's average of y
is x + avg Δy) and Δc_i = c_i⁺ − c_i; c_i itself stays in the site's state (:meth:`ScaffoldTrainer.extra_state`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from medflare.errors import ConfigError, PayloadError
from medflare.methods.base import LocalTrainer, RoundContext, TrainConfig
from medflare.methods.scaffold.control import DELTA_CONTROL, SERVER_CONTROL, control_keys

Controls = dict[str, torch.Tensor]  # parameter name -> one control variate's entries for it


def plain_sgd_problem(train: TrainConfig) -> str:
    """Why ``train`` is not the plain SGD SCAFFOLD's correction assumes ("" when it is): with momentum or Adam the
    step is no longer η_l (g − c_i + c), and (x − y) / (K η_l) no longer estimates the mean corrected gradient."""
    if train.optimizer != "sgd":
        return f"train.optimizer={train.optimizer}"
    if train.momentum != 0 or train.nesterov:
        return f"train.momentum={train.momentum:g}" + (" with train.nesterov" if train.nesterov else "")
    return ""


def drift_correction(params: Mapping[str, nn.Parameter], correction: Controls) -> torch.Tensor:
    """Σ_p ⟨p, c − c_i⟩ minus its own value: it adds c − c_i to each parameter's gradient (scaled with the loss under
    AMP, like the rest of it) and exactly 0 to the loss, so the round's reported loss stays the supervised loss."""
    terms = [(param * correction[name]).sum() for name, param in params.items()]
    if not terms:
        return torch.zeros(())
    linear = torch.stack(terms).sum()
    return linear - linear.detach()


class ScaffoldTrainer(LocalTrainer):
    """Cross-entropy (BCE over known entries for multi-label tasks) with every gradient corrected by c − c_i."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.control: Controls = {}  # c_i: the site's own control variate, kept in its state, never sent
        self.server_control: Controls = {}  # c, as received with the last train task
        self._correction: Controls = {}  # c − c_i, fixed for the round
        self._start: Controls = {}  # x: the weights received this round
        self._lr_sums: dict[str, float] = {}  # Σ_k η_k per parameter over the round's steps (K η_l at a constant lr)
        self._delta: np.ndarray | None = None  # Δc_i of the last round trained, flat (control.py's layout)
        self._params: dict[str, nn.Parameter] = {}  # the parameters the round's controls cover (_controlled)

    # ----- what travels -----------------------------------------------------------------------------------------
    def receive(self, arrays: Mapping[str, np.ndarray]) -> None:
        super().receive(arrays)
        if SERVER_CONTROL in self.received:
            self.server_control = self._unflatten(self.received[SERVER_CONTROL])

    def outgoing_arrays(self, ctx: RoundContext | None = None) -> dict[str, np.ndarray]:
        """The weights y, and after a round's training (``ctx`` given) Δc_i; never c_i."""
        arrays = super().outgoing_arrays(ctx)
        if ctx is not None and self._delta is not None:
            arrays[DELTA_CONTROL] = self._delta
        return arrays

    def extra_state(self) -> dict[str, Any]:
        return {"control": {name: value.detach().cpu() for name, value in self.control.items()}}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.control = {name: value.to(self.device) for name, value in (state.get("control") or {}).items()}

    # ----- the local update -------------------------------------------------------------------------------------
    def on_round_start(self, ctx: RoundContext) -> None:
        problem = plain_sgd_problem(self.train_cfg)
        if problem:
            raise ConfigError(f"scaffold's corrected step y ← y − η_l (g − c_i + c) needs plain SGD, got {problem}: "
                              "set train.optimizer=sgd and train.momentum=0")
        params = self._params = self._controlled()
        self._start = {name: param.detach().clone() for name, param in params.items()}
        self._correction = {name: self._server_c(name, param) - self._own_c(name, param)
                            for name, param in params.items()}
        self._lr_sums = dict.fromkeys(params, 0.0)
        self._delta = None

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        supervised = self.supervised_loss(self.model(images), labels)  # CE, or BCE for multi-label tasks
        return supervised + drift_correction(self._params, self._correction)

    def after_step(self) -> None:
        assert self.optimizer is not None
        lr_of = {id(param): group["lr"] for group in self.optimizer.param_groups for param in group["params"]}
        for name, param in self._params.items():
            self._lr_sums[name] += float(lr_of.get(id(param), 0.0))

    def train_round(self, ctx: RoundContext, should_abort: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        meta = super().train_round(ctx, should_abort)
        self._update_control()
        return meta

    def _update_control(self) -> None:
        """c_i⁺ = c_i − c + (x − y) / (K η_l) for every parameter that stepped; Δc_i = c_i⁺ − c_i (0 for one that did
        not: without a step the round says nothing about its gradient)."""
        updated = {}
        for name, param in self._params.items():
            own, server = self._own_c(name, param), self._server_c(name, param)
            steps_lr = self._lr_sums[name]
            updated[name] = own - server + (self._start[name] - param.detach()) / steps_lr if steps_lr > 0 else own
        self._delta = self._flatten({name: updated[name] - self._own_c(name, value)
                                     for name, value in updated.items()})
        self.control = updated

    # ----- layout -----------------------------------------------------------------------------------------------
    def _controlled(self) -> dict[str, nn.Parameter]:
        """The trained parameters a control variate covers (the float buffers of the layout take no gradient)."""
        keys = set(control_keys(self.model.state_dict(), self.payload))
        return {name: param for name, param in self.model.named_parameters() if param.requires_grad and name in keys}

    def _own_c(self, name: str, param: torch.Tensor) -> torch.Tensor:
        return self.control.get(name, torch.zeros_like(param.detach()))

    def _server_c(self, name: str, param: torch.Tensor) -> torch.Tensor:
        return self.server_control.get(name, torch.zeros_like(param.detach()))

    def _flatten(self, controls: Controls) -> np.ndarray:
        """``controls`` as the wire's flat float32 vector; zeros for the layout's entries they do not cover."""
        state = self.model.state_dict()
        parts = [controls[key].detach().cpu().numpy().ravel() if key in controls else np.zeros(state[key].numel())
                 for key in control_keys(state, self.payload)]
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)

    def _unflatten(self, vector: np.ndarray) -> Controls:
        """The server's flat c as one tensor per trained parameter; PayloadError when it does not fit the model."""
        state, params = self.model.state_dict(), self._controlled()
        keys = control_keys(state, self.payload)
        sizes = [state[key].numel() for key in keys]
        values = np.asarray(vector)
        if values.shape != (sum(sizes),) or values.dtype.kind != "f" or not np.all(np.isfinite(values)):
            raise PayloadError(f"the server's control variate '{SERVER_CONTROL}' must be {sum(sizes)} finite floats "
                               f"(this model's), got shape {values.shape}, dtype {values.dtype}")
        pieces = np.split(values, np.cumsum(sizes)[:-1]) if keys else []
        return {key: torch.as_tensor(piece.reshape(tuple(state[key].shape)), dtype=params[key].dtype,
                                     device=params[key].device)
                for key, piece in zip(keys, pieces) if key in params}
