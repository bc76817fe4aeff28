"""The server's round, without FLARE: every incoming update validated and bounded, then combined by the method's
ServerRule (with the robust rule, the share cap, the update-norm bound and the server optimizer). FLARE's
aggregator (:class:`medflare.flare.aggregator.MedflareAggregator`) and the in-process engine (``benchmarks/inprocess.py``)
drive it alike."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from medflare import contracts
from medflare.contracts import ContractContext, Expected, validate_update
from medflare.errors import MedflareError, PayloadError
from medflare.methods.base import (
    LARGEST_SHARE,
    AggregateResult,
    MethodSpec,
    PerSite,
    RoundContext,
    SiteUpdate,
    aggregate_updates,
)
from medflare.ops import normalise_weights, robust_rules, wire
from medflare.ops.aggregate import SiteOrderedSum
from medflare.ops.influence import Mixture, combine, mix
from medflare.ops.server_opt import ServerOptConfig, ServerOptimizer, check_server_optimizer
from medflare.ops.wire import decode_weights
from medflare.plan import RunPlan
from medflare.server_setup import server_rule

SHARES = "shares"
INFO = "info"
STREAM_INFO = "stream_aggregation"  # a round's record: whether its results were summed as they arrived
NORM_BOUND_INFO = "norm_bound"  # a round's record: why the update-norm bound named no outlier, when it could not
RULE_INFO = "robust_rule"  # a round's record: the robust rule's kept sites and whether its guarantee held
SERVER_OPT_INFO = "server_optimizer"  # a round's record: the server optimizer's rule and η
MODEL_PART = "model"  # the norm bound's name for an update's model step (beside its declared float arrays)
MIN_SITES_FOR_OUTLIER = 3  # with two sites each one's reference median is the other: a tiny update evicts the other


class RoundAggregation:
    """FLARE-free core of one round: accept (validate) results phase by phase, then aggregate. The arguments are a
    :class:`~medflare.plan.RunPlan`'s (:meth:`of_plan`); ``robust``: :class:`medflare.server_setup.RobustConfig`
    fields; float weights travel in ``transfer_dtype``/``download_dtype``, up as ``transfer_kind`` "weights" or
    "diff" (the server keeps its own precision); ``stream_aggregation`` adds each accepted train result to one float64
    running sum in site-name order instead of holding every update (linear rules; :meth:`expect_sites` frees results
    early); ``min_clients``: no robust decision may leave fewer valid results (the round fails instead);
    ``server_optimizer``: :class:`medflare.ops.server_opt.ServerOptConfig` fields, the rule that steps the global model
    on the pseudo-gradient after the bounded aggregate (its buffers stay here, never in what is sent)."""

    reads_plaintext = True  # the results are plaintext arrays (False: flare.he.EncryptedRoundAggregation)

    def __init__(self, spec: MethodSpec, method_args: Any, num_classes: int, num_rounds: int,
                 robust: Mapping[str, Any] | None = None, transfer_dtype: str = "float32",
                 transfer_kind: str = "weights", multi_label: bool = False, stream_aggregation: bool = False,
                 download_dtype: str = "float32", min_clients: int = 1, local_epochs: int = 1,
                 server_optimizer: ServerOptConfig | Mapping[str, Any] | None = None):
        self.min_clients, self.local_epochs = min_clients, local_epochs
        self.spec = spec
        self.rule, self.stages, self.robust = server_rule(spec, method_args, num_rounds, robust, transfer_dtype,
                                                          transfer_kind, download_dtype, multi_label)
        self.robust.check_quorum(min_clients)
        self.multi_label = multi_label
        self.transfer_dtype, self.transfer_kind, self.download_dtype = transfer_dtype, transfer_kind, download_dtype
        self.num_classes = num_classes
        self.contract = ContractContext(num_classes=num_classes, multi_label=multi_label, local_epochs=local_epochs)
        self.global_params: dict[str, np.ndarray] = {}
        self.ctx = RoundContext(round=0, total_rounds=num_rounds)
        self.phase = ""
        self.expected: dict[str, Expected] = {}
        self.updates: dict[str, SiteUpdate] = {}
        self.rejected: dict[str, str] = {}
        self.earlier: dict[str, list[SiteUpdate]] = {}  # this round's completed phases
        self.first_samples: dict[str, float] = {}  # site -> n_samples of its first accepted update
        self.stream_aggregation = stream_aggregation
        self.stream: SiteOrderedSum | None = None  # the train phase's running sum while it streams
        # site -> {part: norm} of its update's model step and declared float arrays, taken as it arrives (the norm
        # bound's input)
        self.norms: dict[str, dict[str, float]] = {}
        opt_config = server_optimizer if isinstance(server_optimizer, ServerOptConfig) else \
            ServerOptConfig(**dict(server_optimizer or {}))  # typed by the plan; a test may give options
        check_server_optimizer(opt_config, spec.name, spec.server_model, not self.reads_plaintext)
        self.server_opt = ServerOptimizer(opt_config) if opt_config.on else None

    @classmethod
    def of_plan(cls, plan: RunPlan) -> RoundAggregation:
        """The round core a job of ``plan`` runs (the FLARE aggregator's, and the in-process loop's)."""
        return cls(plan.spec, plan.method_cfg, plan.task.num_classes, len(plan.rounds), plan.defences,
                   plan.transfer_dtype, plan.transfer_kind, plan.task.multi_label, plan.stream_aggregation,
                   plan.download_dtype, plan.min_clients, plan.max_local_epochs, plan.server_opt)

    def start_round(self, global_params: Mapping[str, np.ndarray], ctx: RoundContext) -> None:
        """Forget the previous round."""
        self.global_params = {k: np.asarray(v) for k, v in global_params.items()}
        self.ctx = dataclasses.replace(ctx, server_meta={**ctx.server_meta, **self._wire_header()})
        self.earlier, self.updates, self.rejected, self.phase, self.stream = {}, {}, {}, "", None

    def start_phase(self, phase: str) -> dict[str, np.ndarray] | PerSite:
        """Begin a phase of the round: returns what to send, and fixes what valid results look like (after the
        task is built, so the phase's array dimensions may depend on what the rule learnt in earlier phases)."""
        if self.phase:
            self.earlier[self.phase] = self.accepted()
        self.phase = phase
        self.updates, self.rejected, self.norms = {}, {}, {}
        streams = self.stream_aggregation and phase == contracts.TRAIN_PHASE and not self.batch_reason()
        self.stream = SiteOrderedSum() if streams else None
        outgoing = self.rule.phase_arrays(phase, self.ctx, self.global_params, self.earlier)
        if isinstance(outgoing, Mixture):  # arrays built from what the sites sent: bounded like any aggregate
            outgoing = PerSite(mix(outgoing, self.robust.max_share))
        dims = dict(self.rule.array_dims(phase, self.ctx))
        self.contract = ContractContext(self.num_classes, dims=dims, multi_label=self.multi_label,
                                        local_epochs=self.local_epochs)
        self.expected = self.rule.expected_arrays(phase, self.ctx, self.global_params, self.contract)
        if isinstance(outgoing, PerSite):
            return PerSite({site: self.downloaded(arrays) for site, arrays in outgoing.arrays.items()})
        return self.downloaded(outgoing)

    def downloaded(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``arrays`` as the server sends them: the model's float weights in ``download_dtype``."""
        return wire.encode_download(arrays, self.global_params, self.download_dtype)

    def batch_reason(self) -> str:
        """Why this round's results are aggregated in one batch despite ``stream_aggregation`` ("" = they stream):
        only a linear rule (Σ weight·arrays / Σ weight) can add results one at a time."""
        if self.robust.rule != "mean":
            return f"robust.rule={self.robust.rule} compares every site's update with the others'"
        if self.robust.max_norm_ratio > 0:
            return "the update-norm bound (robust.max_norm_ratio) compares every site's update with the others'"
        if self.robust.max_share > 0:
            return "the share cap (robust.max_share) needs every site's weight"
        if not self.rule.streams(self.ctx):
            return (f"method '{self.spec.name}' with these options needs every site's update at once (a share cap, "
                    "row-wise weights, several phases or its own aggregate)")
        return ""

    def expect_sites(self, sites: Iterable[str]) -> None:
        """Name the sites the current phase was sent to, so a streamed result need only wait for the sites that
        sort before it (without this, every streamed result waits until :meth:`aggregate`)."""
        if self.stream is not None:
            self.stream.expect(sites)

    def awaits_site_list(self) -> bool:
        """Whether the phase streams but has not been told which sites it was sent to."""
        return self.stream is not None and self.stream.expected is None

    def task_header(self) -> dict[str, Any]:
        """Meta the server adds to this phase's task besides the round: array dimensions and the wire format."""
        return {contracts.ARRAY_DIMS: dict(self.contract.dims), **self._wire_header()}

    def _wire_header(self) -> dict[str, str]:
        return {contracts.TRANSFER_DTYPE: self.transfer_dtype, contracts.TRANSFER_KIND: self.transfer_kind}

    def accepted(self) -> list[SiteUpdate]:
        """Accepted updates of the current phase, in site-name order (for reproducibility)."""
        return [self.updates[site] for site in sorted(self.updates)]

    def accept(self, site: str, arrays: Mapping[str, Any], meta: Mapping[str, Any], kind: str = "weights") -> str | None:
        """Validate and keep ``site``'s result (``kind``: "weights" or "diff", what it says it carries, which must
        be what the job asked for). Returns None when accepted, else the rejection reason."""
        expected_kind = self.transfer_kind if self.phase == contracts.TRAIN_PHASE else "weights"
        if site in self.updates:
            reason = "a second update in the same round"
        elif kind != expected_kind:
            reason = f"the result carries {kind}, the job sends {expected_kind}"
        else:
            try:
                clean, clean_meta = validate_update(arrays, meta, self.expected, self.rule.payload, self.contract)
                if self.phase == contracts.TRAIN_PHASE:  # against the frozen parts as the sites received them
                    frozen = {k: self.global_params[k] for k in clean
                              if self.spec.payload.is_frozen(k) and k in self.global_params}
                    contracts.check_frozen_unchanged(clean, self.downloaded(frozen), self.spec.payload,
                                                     self.transfer_dtype, kind)
                update = SiteUpdate(site, decode_weights(clean, self.global_params, kind), clean_meta)
                self.rule.check_update(self.phase, update, self.ctx)
                if self.phase == contracts.TRAIN_PHASE:
                    self._check_sample_count(update)
                    weight = self.rule.site_weight(update, self.ctx)  # the aggregation weight must be computable
                    if self.stream is not None:
                        update = self._stream(update, weight)
                    elif self.robust.max_norm_ratio > 0 and self.global_params:  # while later results travel
                        self.norms[site] = self.part_norms(update)
                self.updates[site] = update
                return None
            except (MedflareError, KeyError, TypeError, ValueError) as exc:
                reason = str(exc) or type(exc).__name__
        self.rejected[site] = reason
        if self.stream is not None:
            self.stream.mark_absent(site)
        return reason

    def _stream(self, update: SiteUpdate, weight: float) -> SiteUpdate:
        """Hand a validated update's model arrays to the running sum; the update keeps its meta and the declared
        arrays (small) that the rule's ``round_info`` may read."""
        assert self.stream is not None
        model = {k: v for k, v in update.arrays.items() if k in self.global_params}
        self.stream.arrive(update.site, model, weight)
        rest = {k: v for k, v in update.arrays.items() if k not in self.global_params}
        return SiteUpdate(update.site, rest, update.meta)

    def part_norms(self, update: SiteUpdate) -> dict[str, float]:
        """The norms the update-norm bound compares between sites: the model step ‖θ_site − θ_global‖ under
        :data:`MODEL_PART`, and the L2 norm of each float array the method declares for the train phase (e.g.
        SCAFFOLD's Δc_i), so a hostile site can no more send a huge declared array than a huge step."""
        declared = self.spec.payload.arrays_for(contracts.TRAIN_PHASE)
        norms = {MODEL_PART: update_norm(update.arrays, self.global_params)}
        for name, spec in sorted(declared.items()):
            value = update.arrays.get(name)
            if value is not None and not spec.integral and np.asarray(value).dtype.kind == "f":
                norms[name] = float(np.linalg.norm(np.asarray(value, np.float64).ravel()))
        return norms

    def _check_sample_count(self, update: SiteUpdate) -> None:
        """A site's training-set size does not change within a job: a jump is a forged aggregation weight."""
        n = update.meta.get(contracts.N_SAMPLES)
        if n is None:
            return
        first = self.first_samples.setdefault(update.site, float(n))
        if not first / 2 <= float(n) <= 2 * first:
            raise PayloadError(f"n_samples={n:g} is implausible: this site reported {first:g} in its first round")

    def aggregate(self) -> AggregateResult:
        """The next global model from the last phase's accepted updates, after the robust checks; a
        :class:`PayloadError` when nothing is left to aggregate or the aggregate is not finite."""
        if self.stream is not None:
            result = self._streamed_aggregate(self.stream)
        else:
            updates, note = self._drop_outlier_updates(self.accepted())
            self._require_rule_sites(updates)
            updates = self._select(updates)
            self._require_quorum(updates)
            result = aggregate_updates(self.rule, self.global_params, updates, self.ctx, self.robust.max_share,
                                       self._combiner())
            if note:
                result = dataclasses.replace(result, info={**result.info, NORM_BOUND_INFO: note})
            if self.robust.rule != "mean":
                result = dataclasses.replace(result, info={**result.info, RULE_INFO: self._rule_facts(result)})
        if self.stream_aggregation:
            result = dataclasses.replace(result, info={**result.info, STREAM_INFO: self._stream_facts()})
        return self._server_step(require_finite(result))

    def _server_step(self, result: AggregateResult) -> AggregateResult:
        """The server optimizer's step on the pseudo-gradient (the bounded aggregate − the global model) over the
        float arrays this round's stage trains (the shared, not frozen keys); the aggregate itself without one."""
        if self.server_opt is None:
            return result
        payload = self.spec.payload
        keys = [k for k in payload.shared_keys(list(self.global_params), self.ctx.stage)
                if not payload.is_frozen(k) and k in result.params]
        params = self.server_opt.step(self.global_params, result.params, keys)
        facts = {"name": self.server_opt.config.name, "lr": self.server_opt.config.step_size}
        return dataclasses.replace(result, params=params, info={**result.info, SERVER_OPT_INFO: facts})

    def _streamed_aggregate(self, stream: SiteOrderedSum) -> AggregateResult:
        """What ``ServerRule.aggregate`` gives for a linear rule, from the running sum."""
        total = stream.finish()
        dtypes = {k: np.asarray(v).dtype for k, v in self.global_params.items()}
        return AggregateResult(params={**self.global_params, **total.average(dtypes)},
                               shares=normalise_weights(total.weights), info=self.rule.round_info(self.accepted(), self.ctx))

    def _stream_facts(self) -> dict[str, Any]:
        """A round's record of streaming: "batch" and why, or "streamed" with the most results held at once and
        whether every addition came in site order (a "mode" text keeps reports from taking it for a per-site value)."""
        if self.stream is None:
            return {"mode": "batch", "reason": self.batch_reason() or f"phase '{self.phase}' is not aggregated"}
        return {"mode": "streamed", "most_results_held": self.stream.most_waiting,
                "in_site_order": not self.stream.out_of_order}

    def _require_quorum(self, updates: list[SiteUpdate]) -> None:
        """No robust decision leaves fewer than ``min_clients`` sites: the round fails instead (a
        :class:`PayloadError` naming them all; the previous model is kept)."""
        if len(updates) >= self.min_clients or not self.rejected:
            return
        kept = sorted(update.site for update in updates)
        raise PayloadError(
            f"the robust rules would leave {len(kept)} site(s) ({', '.join(kept) or 'none'}) after rejecting "
            f"{'; '.join(f'{site}: {why}' for site, why in sorted(self.rejected.items()))}; the job needs "
            f"min_clients={self.min_clients}, so this round is not aggregated and the previous global model is kept")

    def _require_rule_sites(self, updates: list[SiteUpdate]) -> None:
        """A round whose answering sites (after the norm bound) are fewer than ``robust.rule`` needs for its
        guarantee (:meth:`~medflare.server_setup.RobustConfig.sites_needed`; a selecting rule also the sites it
        keeps) fails (a :class:`PayloadError`; the previous global model is kept): the median of two sites would be
        their mean."""
        robust = self.robust
        if robust.rule == "mean" or not updates:
            return
        answered, keep = len(updates), robust.kept(len(updates))
        if answered < robust.sites_needed() or not 1 <= keep <= answered:
            raise PayloadError(
                f"{robust.needs(max(robust.sites_needed(), keep))}; {answered} answered "
                f"({', '.join(u.site for u in updates)}), so this round is not aggregated and the previous "
                "global model is kept")

    def _select(self, updates: list[SiteUpdate]) -> list[SiteUpdate]:
        """The sites a selecting ``robust.rule`` (Krum, Multi-Krum, Bulyan) keeps, by the distances between their
        model arrays; the others are rejected with their score (:meth:`_require_rule_sites` has checked that
        enough sites answered)."""
        robust = self.robust
        if not robust.selects or not updates:
            return updates
        answered, keep = len(updates), robust.kept(len(updates))
        keys = [k for k, v in self.global_params.items()
                if np.asarray(v).dtype.kind == "f" and all(k in u.arrays for u in updates)]
        distances = robust_rules.squared_distances([u.arrays for u in updates], keys)
        f = robust.hostile_sites
        picks = (robust_rules.bulyan_picks(distances, f) if robust.rule == "bulyan"
                 else robust_rules.multi_krum_picks(distances, f, keep))
        scores = robust_rules.krum_scores_of(distances, f, max(answered - f - 2, 1))
        for index, update in enumerate(updates):
            if index not in picks:
                highest = max(scores[i] for i in picks)
                self._reject(update.site, f"not among the {len(picks)} of {answered} sites robust.rule={robust.rule} "
                                          f"keeps (Krum score {scores[index]:.4g}; the highest kept {highest:.4g})")
        return [updates[index] for index in sorted(picks)]

    def _rule_facts(self, result: AggregateResult) -> dict[str, Any]:
        """What a round's record says about ``robust.rule``: the sites it kept, the largest share any of them had
        (of any row too), and whether that share was within what the rule tolerates from one site (a round with too
        few sites for the cap was refused by :meth:`_require_rule_sites`; a Krum rule's f >= 1 by RobustConfig)."""
        largest = max(result.info.get(LARGEST_SHARE, result.shares).values())
        tolerated = {"median": largest < 0.5, "trimmed_mean": largest <= self.robust.trim_fraction + 1e-12}
        return {"rule": self.robust.rule, "kept": sorted(result.shares), "largest_share": round(float(largest), 6),
                "tolerates_one_site": tolerated.get(self.robust.rule, True)}

    def _combiner(self) -> Callable[..., dict[str, Any]]:
        """How the kept sites' model arrays are combined under their bounded shares."""
        robust = self.robust
        if robust.rule == "median":
            return robust_rules.robust_combiner(robust_rules.weighted_median)
        if robust.rule == "trimmed_mean":
            return robust_rules.robust_combiner(
                lambda values, weights: robust_rules.weighted_trimmed_mean(values, weights, robust.trim_fraction))
        if robust.rule == "bulyan":
            return robust_rules.robust_combiner(lambda values, weights: robust_rules.closest_to_median_mean(
                values, weights, values.shape[0] - 2 * robust.hostile_sites))
        return combine

    def _drop_outlier_updates(self, updates: list[SiteUpdate]) -> tuple[list[SiteUpdate], str]:
        """Reject sites whose update norm exceeds ``max_norm_ratio`` × the median norm of the other sites; with
        fewer than :data:`MIN_SITES_FOR_OUTLIER` updates reject none and say why (the second value)."""
        ratio = self.robust.max_norm_ratio
        if ratio <= 0 or len(updates) < 2 or not self.global_params:
            return updates, ""
        if len(updates) < MIN_SITES_FOR_OUTLIER:
            return updates, (f"not applied: {len(updates)} sites answered, and naming an outlier needs at least "
                             f"{MIN_SITES_FOR_OUTLIER} (with two, each site's reference is the other's norm)")
        norms = {u.site: self.norms[u.site] if u.site in self.norms else self.part_norms(u) for u in updates}
        kept = []
        for update in updates:
            excess = next((why for part in norms[update.site] if (why := self._norm_excess(norms, update.site, part))),
                          "")
            if excess:
                self._reject(update.site, excess)
            else:
                kept.append(update)
        return kept, ""

    def _norm_excess(self, norms: Mapping[str, Mapping[str, float]], site: str, part: str) -> str:
        """Why ``site``'s norm of ``part`` exceeds ``max_norm_ratio`` × the other sites' median of it ("" if not)."""
        ratio, mine = self.robust.max_norm_ratio, norms[site][part]
        others = float(np.median([n[part] for s, n in norms.items() if s != site and part in n] or [0.0]))
        if others <= 0 or mine <= ratio * others:
            return ""
        what = "update norm" if part == MODEL_PART else f"the norm of '{part}'"
        return f"{what} {mine:.4g} exceeds {ratio:g} x the other sites' median {others:.4g}"

    def _reject(self, site: str, reason: str) -> None:
        """A robust decision drops ``site``'s accepted update."""
        self.rejected[site] = reason
        self.updates.pop(site, None)


def require_finite(result: AggregateResult) -> AggregateResult:
    """``result``, unless a float array of it holds NaN/Inf (a ciphertext is no float array: it is not read)."""
    broken = sorted(k for k, v in result.params.items()
                    if np.asarray(v).dtype.kind == "f" and not np.all(np.isfinite(v)))
    if broken:
        raise PayloadError(f"the aggregate has NaN/Inf in {broken[:5]}; the previous global model is kept")
    return result


def update_norm(arrays: Mapping[str, np.ndarray], global_params: Mapping[str, np.ndarray]) -> float:
    """‖θ_site − θ_global‖₂ over the floating-point keys both carry (computed in float64)."""
    total = 0.0
    for key, value in arrays.items():
        reference = global_params.get(key)
        if reference is not None and np.asarray(reference).dtype.kind == "f":
            diff = np.subtract(value, reference, dtype=np.float64).ravel()  # one float64 temporary, not three
            total += float(np.dot(diff, diff))
    return float(np.sqrt(total))
