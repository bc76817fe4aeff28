"""Encrypted aggregation in FLARE (``secure_aggregation=he``): sites encrypt, the server weighs ciphertexts it
cannot read, sites decrypt. Built on the TenSEAL CKKS contexts FLARE's ``HEBuilder`` writes into provisioned kits
(the secret key at every site, none on the server), loaded through FLARE's signature-checking loader. FLARE's
``HEModelEncryptor`` and HE aggregator are not used: they weigh each site at the site by its step count and send the
context (~660 KB) with every array, while medflare's rules weigh sites on the server under a share cap.

Sites encrypt after their own filters saw the result in plaintext; the server checks shapes, meta and declared arrays
on zero-stride stand-ins and bounds the rule's plaintext weights before it weighs the ciphertexts. What it can no
longer do is refused or recorded (docs/privacy.md); the simulator, without contexts, refuses the option.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from nvflare.apis.dxo import from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from medflare import contracts
from medflare.errors import ConfigError, MedflareError, PayloadError
from medflare.flare.aggregator import MedflareAggregator
from medflare.flare.tasks import deployed_plan
from medflare.methods.base import AggregateResult, PerSite, aggregate_updates
from medflare.ops import he_aggregate
from medflare.ops.he_aggregate import EncryptedArray, stand_in
from medflare.ops.influence import Shares, combine
from medflare.plan import PLAN_FILE
from medflare.server_round import RoundAggregation, require_finite

MODE = "he"  # RunConfig.secure_aggregation's value that turns it on
SERVER_CONTEXT_FILE = "server_context.tenseal"  # FLARE's ProvFileName.SERVER_CONTEXT_TENSEAL (HEBuilder)
CLIENT_CONTEXT_FILE = "client_context.tenseal"  # FLARE's ProvFileName.CLIENT_CONTEXT_TENSEAL
MODEL_FILE = "FL_global_model.ckks.npz"  # the final global model, encrypted: only a site can read it
_HEADER = "__medflare_he__"  # MODEL_FILE's entry naming each array's shape, dtype and whether it is encrypted


def load_workspace_context(file_name: str, fl_ctx: FLContext) -> Any:
    """A TenSEAL context from this participant's startup kit, through FLARE's loader (which refuses an unsigned or
    tampered context in secure mode); a :class:`ConfigError` without TenSEAL or without the kit's context."""
    he_aggregate.tenseal()
    from nvflare.app_opt.he.homomorphic_encrypt import load_tenseal_context_from_workspace

    try:
        return load_tenseal_context_from_workspace(file_name, fl_ctx)
    except ValueError as exc:
        raise ConfigError(f"secure_aggregation=he: {exc}; provision the kits with FLARE's HEBuilder "
                          "(docs/deploy.md, 'Encrypted aggregation')") from exc


class EncryptedRoundAggregation(RoundAggregation):
    """:class:`RoundAggregation` over encrypted train results: the server never holds a decryptable model array.
    The rule and every shape check see zero-stride stand-ins of the aggregated :class:`EncryptedArray` s; frozen
    parts travel in plaintext as the server sent them (and are checked). :meth:`use_context` sets the server's
    context (no secret key) before the first result arrives."""

    reads_plaintext = False  # no server optimizer can step on an encrypted aggregate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        he_aggregate.check_encrypted_run(
            self.spec, stream_aggregation=self.stream_aggregation, transfer_kind=self.transfer_kind,
            transfer_dtype=self.transfer_dtype, download_dtype=self.download_dtype,
            max_norm_ratio=self.robust.max_norm_ratio, robust_rule=self.robust.rule)
        self.context: Any = None
        self.encrypted: dict[str, EncryptedArray] = {}  # the global model's aggregated arrays
        self.stand_ins: dict[str, np.ndarray] = {}
        self.sent_encrypted: dict[str, list] = {}  # what the current task carries encrypted (its header says so)

    def use_context(self, context: Any) -> None:
        """The server's TenSEAL context; refused when it holds a secret key."""
        if context.is_private():
            raise ConfigError("the server's TenSEAL context holds a secret key, so the server could decrypt every "
                              "site's update; provision the server kit with HEBuilder's server context")
        self.context = context

    def start_round(self, global_params: Mapping[str, Any], ctx: Any) -> None:
        self.encrypted = {k: v for k, v in global_params.items() if isinstance(v, EncryptedArray)}
        self.stand_ins = {k: stand_in(v.shape, v.dtype) for k, v in self.encrypted.items()}
        plain = {k: v for k, v in global_params.items() if k not in self.encrypted}
        super().start_round({**plain, **self.stand_ins}, ctx)
        self.sent_encrypted = {}

    def start_phase(self, phase: str) -> dict[str, np.ndarray] | PerSite:
        self.sent_encrypted = {}
        return super().start_phase(phase)

    def downloaded(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
        """``arrays`` as the server sends them: the encrypted global arrays as ciphertext bytes (the task header
        declares them), the rest as :meth:`RoundAggregation.downloaded` sends them."""
        sealed = {k for k, v in arrays.items() if isinstance(v, EncryptedArray) or v is self.stand_ins.get(k)}
        sent = super().downloaded({k: v for k, v in arrays.items() if k not in sealed})
        for key in sealed:
            array = self.encrypted[key]
            sent[key] = array.serialize()
            self.sent_encrypted[key] = [list(array.shape), array.dtype]
        return sent

    def task_header(self) -> dict[str, Any]:
        header = super().task_header()
        return {**header, contracts.ENCRYPTED_ARRAYS: dict(self.sent_encrypted)} if self.sent_encrypted else header

    def batch_reason(self) -> str:
        return "encrypted aggregation holds every site's ciphertexts until the round ends"

    def encrypted_keys(self) -> list[str]:
        """The arrays a train result must carry encrypted: the shared model arrays, frozen parts excepted."""
        return sorted(k for k in self.expected if k in self.global_params and not self.spec.payload.is_frozen(k))

    def accept(self, site: str, arrays: Mapping[str, Any], meta: Mapping[str, Any],
               kind: str = "weights") -> str | None:
        """Read the ciphertexts, then run every plaintext check on stand-ins of them (shapes, meta, declared
        arrays, the rule's checks, the weight); keep the ciphertexts for the aggregate."""
        if self.phase != contracts.TRAIN_PHASE:
            return super().accept(site, arrays, meta, kind)
        try:
            ciphertexts = self._ciphertexts(arrays, meta)
        except PayloadError as exc:
            self.rejected[site] = str(exc)
            return str(exc)
        plain = {k: stand_in(np.shape(self.global_params[k]), np.asarray(self.global_params[k]).dtype.name)
                 if k in ciphertexts else v for k, v in arrays.items()}
        reason = super().accept(site, plain, {k: v for k, v in meta.items() if k != contracts.ENCRYPTED_ARRAYS}, kind)
        if reason is None:
            self.updates[site].arrays.update(ciphertexts)
        return reason

    def _ciphertexts(self, arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, EncryptedArray]:
        """key -> the site's ciphertext of that model array, read under the server's context; PayloadError for a
        model array in plaintext or missing, a declaration not matching the model, or bytes of no such ciphertext."""
        if self.context is None:
            raise PayloadError("the server has no TenSEAL context: this server kit was not provisioned for "
                               "encrypted aggregation")
        wanted = self.encrypted_keys()
        declared = he_aggregate.declared_encrypted(meta, contracts.ENCRYPTED_ARRAYS)
        if sorted(declared) != wanted:
            plain = sorted(set(wanted) - set(declared))
            raise PayloadError(f"the job aggregates encrypted updates, but {plain[:5] or sorted(declared)[:5]} "
                               f"arrived {'in plaintext' if plain else 'encrypted without being model arrays'}")
        ciphertexts = {}
        for key in wanted:
            model = np.asarray(self.global_params[key])
            if declared[key] != (tuple(model.shape), model.dtype.name):
                raise PayloadError(f"'{key}' is declared {declared[key]}, the model has {tuple(model.shape)} "
                                   f"{model.dtype.name}")
            ciphertexts[key] = he_aggregate.read_ciphertext(self.context, key, arrays.get(key), model.shape,
                                                            model.dtype.name)
        return ciphertexts

    def aggregate(self) -> AggregateResult:
        """The rule's weights, bounded in plaintext (the share cap), then the ciphertexts weighed and added.

        Raises:
            PayloadError: nothing to aggregate, or a plaintext (frozen) aggregate that is not finite.
        """
        result = aggregate_updates(self.rule, self.global_params, self.accepted(), self.ctx, self.robust.max_share,
                                   combiner=combine_sealed)
        params = {k: self.encrypted[k] if v is self.stand_ins.get(k) else v for k, v in result.params.items()}
        return require_finite(AggregateResult(params=params, shares=result.shares, info=result.info))


def combine_sealed(updates: Mapping[str, Mapping[str, Any]], shares: Shares,
                   dtypes: Mapping[str, np.dtype] | None = None) -> dict[str, Any]:
    """``combine`` for a mix of ciphertexts and plaintext (frozen) arrays: each key the way its arrays are."""
    sites = list(updates)
    sealed = {k for k, v in updates[sites[0]].items() if isinstance(v, EncryptedArray)} if sites else set()
    parts = [{site: {k: v for k, v in arrays.items() if (k in sealed) == encrypted} for site, arrays in updates.items()}
             for encrypted in (True, False)]
    combined = he_aggregate.combine_encrypted(parts[0], shares) if sealed else {}
    if any(parts[1].values()):
        combined.update(combine(parts[1], shares, dtypes))
    return combined


class EncryptedAggregator(MedflareAggregator):
    """:class:`MedflareAggregator` over ciphertexts (:class:`EncryptedRoundAggregation`), with the server kit's
    TenSEAL context (no secret key), loaded when the job starts."""

    holds_plaintext = False
    core_cls = EncryptedRoundAggregation

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        super().handle_event(event_type, fl_ctx)  # the round core, from the job's plan
        if event_type == EventType.START_RUN and self._core is not None:
            try:
                self.core.use_context(load_workspace_context(SERVER_CONTEXT_FILE, fl_ctx))
            except ConfigError as exc:
                self.system_panic(str(exc), fl_ctx)

    def encryption_record(self) -> dict[str, Any]:
        """What the results file says about the job's encryption and what the server did not write."""
        return {
            "mode": MODE,
            "model_file": f"{MODEL_FILE}: the final global model as CKKS ciphertexts; only a site decrypts it "
                          "(medflare.flare.he.read_encrypted_model with its client_context.tenseal)",
            "best_model_file": "not written: the server cannot save a plaintext model",
            "checkpoint": "not written: the server holds ciphertexts only, and an encrypted job cannot be resumed",
            "norm_bound": "off: the server cannot read the updates; each site checks its own before encrypting",
        }

    def save_model(self, params: Mapping[str, Any], folder: str | Path) -> Path:
        """Write the global model as the server holds it (ciphertexts and plaintext arrays) to ``folder``."""
        return save_encrypted_model(Path(folder) / MODEL_FILE, params)


def save_encrypted_model(path: str | Path, params: Mapping[str, Any]) -> Path:
    """``params`` (ciphertexts and plaintext arrays) as one ``.npz``: each ciphertext's bytes as a uint8 array, a
    JSON header with every array's shape and dtype. No pickle, no key."""
    header, entries = {}, {}
    for index, (key, value) in enumerate(params.items()):
        name, sealed = f"a{index}", isinstance(value, EncryptedArray)
        array = value if sealed else np.asarray(value)
        entries[name] = np.frombuffer(value.serialize(), dtype=np.uint8) if sealed else array
        header[key] = {"entry": name, "shape": list(array.shape), "dtype": value.dtype if sealed else array.dtype.name,
                       "encrypted": sealed}
    entries[_HEADER] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    with Path(path).open("wb") as f:
        np.savez(f, **entries)
    return Path(path)


def read_encrypted_model(path: str | Path, context: Any) -> dict[str, np.ndarray]:
    """The plaintext model from :func:`save_encrypted_model`'s file, decrypted with a site's context (one with the
    secret key, or a :class:`ConfigError`)."""
    if not context.is_private():
        raise ConfigError(f"{path} is encrypted: decrypt it with a site's client_context.tenseal (the server's "
                          "context has no secret key)")
    with np.load(path, allow_pickle=False) as stored:
        header = json.loads(stored[_HEADER].tobytes().decode())
        return {key: he_aggregate.decrypt_array(context, stored[e["entry"]].tobytes(), tuple(e["shape"]), e["dtype"])
                if e["encrypted"] else stored[e["entry"]] for key, e in header.items()}


class _SiteContext(Filter):
    """A site filter holding the site kit's TenSEAL context (with the secret key), loaded when first needed. The
    file is always the kit's own ``client_context.tenseal``: a job cannot name another."""

    context_file = CLIENT_CONTEXT_FILE

    def __init__(self) -> None:
        super().__init__()
        self._context: Any = None

    def context(self, fl_ctx: FLContext) -> Any:
        if self._context is None:
            context = load_workspace_context(self.context_file, fl_ctx)
            if not context.is_private():
                raise ConfigError(f"{self.context_file} has no secret key: this site could not read the global "
                                  "model; provision the site kit with HEBuilder's client context")
            self._context = context
        return self._context


# A decrypted aggregate the site refuses to train on: the server cannot look inside it (a ciphertext made under
# another key decrypts to noise of about 1e9 and more; an update far out of range is a convex mix of the sites')
MAX_DECRYPTED_ABS = 1e6  # no weight of a trained classifier comes near it
MAX_CHANGE_RATIO = 10.0  # ||new - last|| <= 10 x ||last|| over the model: ten times any round's step seen


def implausible(arrays: Mapping[str, np.ndarray], last: Mapping[str, np.ndarray], since: str = "the last round") -> str:
    """Why a decrypted global model is not one a site should train on ("" when it is plausible): an array that is
    not finite or holds a value above :data:`MAX_DECRYPTED_ABS`, or a model that moved more than
    :data:`MAX_CHANGE_RATIO` times its own norm since ``last``, the last model this site received or, before the
    first, the job's initial model (over the arrays both hold: one array's norm can be near zero, a freshly trained
    bias, say); ``since`` names ``last`` in the reason."""
    for key, value in arrays.items():
        value = np.asarray(value, np.float64)
        if not np.all(np.isfinite(value)):
            return f"'{key}' is not finite"
        largest = float(np.max(np.abs(value))) if value.size else 0.0
        if largest > MAX_DECRYPTED_ABS:
            return f"'{key}' holds {largest:.3g}, beyond {MAX_DECRYPTED_ABS:g} (a ciphertext under another key?)"
    common = [k for k in arrays if k in last and np.shape(last[k]) == np.shape(arrays[k])]
    if not common:
        return ""
    change = float(np.sqrt(sum(np.sum((np.asarray(arrays[k], np.float64) - last[k]) ** 2) for k in common)))
    norm = float(np.sqrt(sum(np.sum(np.asarray(last[k], np.float64) ** 2) for k in common)))
    if change > MAX_CHANGE_RATIO * max(norm, 1e-3):
        return f"the model moved {change:.3g} since {since}, over {MAX_CHANGE_RATIO:g} x its norm {norm:.3g}"
    return ""


class DecryptTask(_SiteContext):
    """Site task-data filter: decrypts the arrays a task declares encrypted (``contracts.ENCRYPTED_ARRAYS``) into
    the shapes and dtypes it declares. A decrypted model the site finds :func:`implausible` (the server could not
    look) against the last one it decrypted, or the job's initial model before the first, gets
    :data:`contracts.REFUSED_TASK_HEADER`: the executor declines the task instead of training on garbage."""

    def __init__(self) -> None:
        super().__init__()
        self._last: dict[str, np.ndarray] = {}  # the last plausible decrypted model (stays at the site)
        self._initial: dict[str, np.ndarray] = {}  # the job's initial model, built for the first one

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        try:
            dxo = from_shareable(shareable)
        except (ValueError, TypeError):
            return shareable
        declared = he_aggregate.declared_encrypted(dxo.meta or {}, contracts.ENCRYPTED_ARRAYS)
        if not declared:
            return shareable
        context = self.context(fl_ctx)
        data = dict(dxo.data or {})
        for key, (shape, dtype) in declared.items():
            data[key] = he_aggregate.decrypt_array(context, data[key], shape, dtype)
        opened = {key: data[key] for key in declared if np.asarray(data[key]).dtype.kind == "f"}
        try:
            why = implausible(opened, *self._reference(fl_ctx))
        except MedflareError as exc:
            why = f"this site cannot build the job's initial model to check it against: {exc}"
        if why:
            shareable.set_header(contracts.REFUSED_TASK_HEADER, f"the decrypted global model is implausible: {why}")
            return shareable
        self._last = {key: np.array(value, copy=True) for key, value in opened.items()}
        dxo.data = data
        dxo.remove_meta_props([contracts.ENCRYPTED_ARRAYS])
        dxo.update_shareable(shareable)
        return shareable

    def _reference(self, fl_ctx: FLContext) -> tuple[dict[str, np.ndarray], str]:
        """(the model a decrypted one is checked against, its name): the last plausible model this site decrypted,
        or before the first (whose only other bound was |w| <= 1e6) the job's initial model, built from the
        deployed plan as the server's persistor builds it (same model, seed and warm start)."""
        if self._last:
            return self._last, "the last round"
        import torch

        from medflare.flare.models import global_model_of  # local: only an encrypted job's first task builds it

        if not self._initial:
            # global_model seeds torch's generators; this site's training must draw what it draws without HE
            with torch.random.fork_rng():
                network = global_model_of(deployed_plan(fl_ctx, PLAN_FILE)[0])
            self._initial = {key: value.detach().cpu().numpy() for key, value in network.state_dict().items()
                             if value.is_floating_point()}
        return self._initial, "the job's initial model"


class EncryptResult(_SiteContext):
    """Site task-result filter: encrypts and declares every array of a result except the method's declared
    arrays (the server's rule reads them) and its frozen parts, after the site's own filters have checked it.
    ``plan_file``: the job's plan (``medflare_plan.json`` in its ``app/config``), which names the method."""

    def __init__(self, plan_file: str = PLAN_FILE) -> None:
        super().__init__()
        self.plan_file = plan_file

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        if shareable.get_return_code() not in (None, ReturnCode.OK):
            return shareable
        dxo = from_shareable(shareable)
        data = dict(dxo.data or {})
        payload = deployed_plan(fl_ctx, self.plan_file)[0].spec.payload
        plain = payload.arrays_for(contracts.TRAIN_PHASE)
        sealed = [k for k in data if k not in plain and not payload.is_frozen(k)]
        if not sealed:
            return shareable
        context = self.context(fl_ctx)
        arrays = {key: np.asarray(data[key]) for key in sealed}
        data.update({key: he_aggregate.encrypt_array(context, array) for key, array in arrays.items()})
        declared = {key: [list(array.shape), array.dtype.name] for key, array in arrays.items()}
        dxo.data = data
        dxo.set_meta_prop(contracts.ENCRYPTED_ARRAYS, declared)
        dxo.update_shareable(shareable)
        return shareable
