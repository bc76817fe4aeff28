"""Encrypted aggregation: the server weighs and adds CKKS ciphertexts of the sites' arrays with plaintext shares.

Each site encrypts every model array as one flat TenSEAL ``CKKSVector`` under the project's context from its kit
(FLARE's ``HEBuilder``, with the secret key). The server's context has none: it multiplies ciphertexts by its own
plaintext shares, bounded before any ciphertext is touched, and adds them (:func:`combine_encrypted`), but never
reads one. With FLARE's default parameters a decrypted average is within about 1e-5 of the plaintext one for
weights of magnitude 1; the one plaintext multiplication per round uses the one level the moduli leave.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from medflare.errors import ConfigError, PayloadError
from medflare.ops.influence import Shares, cast_like

if TYPE_CHECKING:  # the run's checks read a method's declaration; no import of the methods layer at run time
    from medflare.methods.base import MethodSpec

# FLARE's HEBuilder defaults: the parameters a provisioned kit's contexts have (tests build the same, smaller data)
POLY_MODULUS_DEGREE = 8192
COEFF_MOD_BIT_SIZES = (60, 40, 40)
SCALE_BITS = 40


def tenseal() -> Any:
    """The ``tenseal`` module, or a one-line error naming the extra that installs it."""
    try:
        import tenseal as ts
    except ImportError as exc:
        raise ConfigError("secure_aggregation=he needs TenSEAL: pip install 'medflare[he]' (tenseal==0.3.18) on "
                          "the server and at every site") from exc
    return ts


@dataclass(frozen=True)
class EncryptedArray:
    """One array as a CKKS ciphertext (``vector``, flattened in C order; None when empty) with the shape and the
    dtype name it decrypts back to (integers rounded)."""

    vector: Any
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def serialize(self) -> bytes:
        """The ciphertext as it travels (no context, no key); an empty array travels as no bytes."""
        return self.vector.serialize() if self.vector is not None else b""


def make_context(poly_modulus_degree: int = POLY_MODULUS_DEGREE,
                 coeff_mod_bit_sizes: tuple[int, ...] = COEFF_MOD_BIT_SIZES, scale_bits: int = SCALE_BITS) -> Any:
    """A CKKS context with its secret key, made as FLARE's ``HEBuilder`` makes a project's (tests, benchmarks)."""
    ts = tenseal()
    context = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=poly_modulus_degree,
                         coeff_mod_bit_sizes=list(coeff_mod_bit_sizes), encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC)
    context.generate_relin_keys()
    context.global_scale = 2**scale_bits
    return context


def server_copy(context: Any) -> bytes:
    """``context`` serialized as ``HEBuilder`` writes the server's: relinearisation keys, no public or secret key."""
    return context.serialize(save_public_key=False, save_secret_key=False, save_galois_keys=False,
                             save_relin_keys=True)


def server_context(data: bytes) -> Any:
    """The server's context from its serialized form; ConfigError when it holds a secret key (a site's)."""
    context = tenseal().context_from(data)
    if context.is_private():
        raise ConfigError("the server's TenSEAL context holds a secret key, so the server could decrypt every "
                          "site's update; provision the server kit with HEBuilder's server context (no secret key)")
    return context


def encrypt_array(context: Any, array: np.ndarray) -> bytes:
    """A site's array as a serialized CKKS ciphertext (float64, C order); PayloadError for NaN or Inf, which a
    ciphertext would hide from every check."""
    values = np.asarray(array, dtype=np.float64).ravel()
    if not np.all(np.isfinite(values)):
        raise PayloadError("refusing to encrypt an array with NaN or Inf: the server could not see it")
    return tenseal().ckks_vector(context, values).serialize() if values.size else b""


def read_ciphertext(context: Any, name: str, data: Any, shape: tuple[int, ...], dtype: str) -> EncryptedArray:
    """A received ciphertext under ``context``; PayloadError unless it is one of this context holding
    ``prod(shape)`` values."""
    size = int(np.prod(shape, dtype=np.int64))
    if not isinstance(data, (bytes, bytearray)):
        raise PayloadError(f"'{name}' must arrive encrypted (serialized CKKS bytes), got {type(data).__name__}")
    if not size:
        return EncryptedArray(None, tuple(shape), dtype)
    try:
        vector = tenseal().ckks_vector_from(context, bytes(data))
    except Exception as exc:  # TenSEAL raises ValueError/RuntimeError on a malformed or foreign ciphertext
        raise PayloadError(f"'{name}' is not a CKKS ciphertext of this project's context: {exc}") from exc
    if vector.size() != size:
        raise PayloadError(f"'{name}' encrypts {vector.size()} values, the array has {size} {tuple(shape)}")
    return EncryptedArray(vector, tuple(shape), dtype)


def decrypt_array(context: Any, data: bytes, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """What a site with the secret key reads from a serialized ciphertext: the array in its own shape and dtype."""
    size = int(np.prod(shape, dtype=np.int64))
    if not size:
        return np.zeros(shape, dtype=dtype)
    values = np.asarray(tenseal().ckks_vector_from(context, data).decrypt(), dtype=np.float64)
    if values.size != size:
        raise PayloadError(f"a ciphertext decrypts to {values.size} values, the array has {size} {tuple(shape)}")
    return cast_like(values.reshape(shape), np.dtype(dtype))


def combine_encrypted(updates: Mapping[str, Mapping[str, Any]], shares: Shares,
                      dtypes: Mapping[str, np.dtype] | None = None) -> dict[str, EncryptedArray]:
    """key -> Σ_site share · ciphertext (row-wise where ``shares.rows`` says so): the ciphertext twin of
    :func:`medflare.ops.influence.combine` (``dtypes`` unused: each array keeps its own). A site whose share is
    zero everywhere adds nothing (CKKS cannot multiply by an all-zero plaintext).

    Raises:
        PayloadError: nothing to aggregate, or an array that is not encrypted.
    """
    if not updates:
        raise PayloadError("nothing to aggregate: no site update was accepted")
    sites = list(updates)
    result: dict[str, EncryptedArray] = {}
    for key in updates[sites[0]]:
        arrays = [updates[site][key] for site in sites]
        if not all(isinstance(a, EncryptedArray) for a in arrays):
            raise PayloadError(f"'{key}' is not encrypted at every site; an encrypted job aggregates ciphertexts only")
        first = arrays[0]
        if not first.size:  # nothing to weigh (an empty buffer): it travels as an empty ciphertext
            result[key] = first
            continue
        if key in shares.rows:
            matrix = shares.rows[key][[shares.order.index(site) for site in sites]]
            weights = [_per_entry(row, first.shape) for row in matrix]
        else:
            weights = [shares.sites[site] for site in sites]
        result[key] = EncryptedArray(_weighted_ciphertext_sum([a.vector for a in arrays], weights),
                                     first.shape, first.dtype)
    return result


def _per_entry(row_shares: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """One site's share of each row, repeated over that row's entries (the array flattened in C order)."""
    if not shape or row_shares.shape[0] != shape[0]:
        raise PayloadError(f"row weights have {row_shares.shape[0]} rows, the array has shape {tuple(shape)}")
    return np.repeat(np.asarray(row_shares, dtype=np.float64), int(np.prod(shape[1:], dtype=np.int64)))


def _weighted_ciphertext_sum(vectors: list[Any], weights: list[Any]) -> Any:
    """Σ weight·vector over the terms whose weight is not zero everywhere (scalars or per-entry vectors)."""
    total = None
    for vector, weight in zip(vectors, weights):
        if vector is None or not np.any(np.asarray(weight) != 0):
            continue
        term = vector * (float(weight) if np.ndim(weight) == 0 else np.asarray(weight).tolist())
        total = term if total is None else total + term
    if total is None:
        raise PayloadError("every site's share of an encrypted array is zero")
    return total


def stand_in(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A zero-stride array of ``shape`` and ``dtype`` standing for a ciphertext wherever only the shape and dtype
    are checked (it costs no memory per value)."""
    return np.broadcast_to(np.zeros((), dtype=np.dtype(dtype)), tuple(shape))


def declared_encrypted(meta: Mapping[str, Any], key: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of the ciphertexts a message declares under ``meta[key]`` ({} when none);
    PayloadError unless it is {name: [shape, dtype]} with a whole, non-negative shape and a numeric dtype."""
    declared = meta.get(key)
    if declared is None:
        return {}
    if not isinstance(declared, Mapping):
        raise PayloadError(f"'{key}' must map array names to [shape, dtype], got {type(declared).__name__}")
    result = {}
    for name, entry in declared.items():
        try:
            shape, dtype = entry
            shape = tuple(int(d) for d in shape)
            kind = np.dtype(str(dtype)).kind
        except (TypeError, ValueError) as exc:
            raise PayloadError(f"'{key}' declares '{name}' as {entry!r}, not [shape, dtype]") from exc
        if any(d < 0 for d in shape) or kind not in "fiub":
            raise PayloadError(f"'{key}' declares '{name}' with shape {shape} and dtype {dtype}")
        result[str(name)] = (shape, str(np.dtype(str(dtype))))
    return result


# ----- what an encrypted job asks that the server can do (checked by the run config and the aggregator) -----
def encryption_refusal(spec: MethodSpec) -> str:
    """Why ``spec``'s method cannot aggregate encrypted ("" when it can), from its rule's declaration
    (``ServerRule.encrypted_aggregation_refusal``) and whether its sites send weights at all."""
    reason = spec.server_rule_cls.encrypted_aggregation_refusal
    if not reason and not spec.payload.sends_weights:
        reason = "its sites send no weights, so there is nothing to encrypt"
    return f"method '{spec.name}' cannot aggregate encrypted: {reason}" if reason else ""


def encrypted_run_problems(
    spec: MethodSpec, *, stream_aggregation: bool = False, transfer_kind: str = "weights",
    transfer_dtype: str = "float32", download_dtype: str = "float32", max_norm_ratio: float = 0.0,
    resume: bool = False, robust_rule: str = "mean",
) -> list[str]:
    """What a job with encrypted aggregation asks that the server can no longer do, one sentence each."""
    refusal = encryption_refusal(spec)
    conditions = [
        (max_norm_ratio > 0, "robust.max_norm_ratio compares the sites' update norms, which the server cannot read "
                             "under encryption; set robust.max_norm_ratio=0 (each site still checks its own update "
                             "for NaN/Inf and its method's contract before encrypting)"),
        (robust_rule != "mean", f"robust.rule={robust_rule} compares the sites' model arrays, which the server "
                                "cannot read under encryption; leave robust.rule at mean"),
        (stream_aggregation, "stream_aggregation adds plaintext arrays as they arrive; encrypted aggregation holds "
                             "the ciphertexts until the round ends"),
        (transfer_kind != "weights", "transfer_kind=diff (for DP filters) needs plaintext differences; encrypted "
                                     "updates travel as weights"),
        ("float32" != transfer_dtype or download_dtype != "float32",
         "transfer_dtype and download_dtype must be float32: ciphertexts hold float64 values whatever the dtype"),
        (resume, "resume_from continues from a plaintext checkpoint, which an encrypted job does not write"),
    ]
    return ([refusal] if refusal else []) + [text for applies, text in conditions if applies]


def check_encrypted_run(spec: MethodSpec, **options: Any) -> None:
    """Raise ConfigError naming all an encrypted job asks that cannot be done (:func:`encrypted_run_problems`)."""
    problems = encrypted_run_problems(spec, **options)
    if problems:
        raise ConfigError("secure_aggregation=he: " + "; ".join(problems))
