"""Simulated federated splits of one labelled training set into per-site index sets.

Every scheme draws from `np.random.default_rng(seed)` only (never the global RNG) and visits samples in the
order of the `labels` array, so the same labels and seed give the same partition in every interpreter run.

Schemes (the string forms accepted by `partition`):
    iid                       stratified: every site gets (almost) the same class mix and size
    dirichlet:ALPHA           label skew, FedML convention (spec §1.2)
    quantity:ALPHA            site sizes ~ Dir(ALPHA), labels IID within a site
    attribute:F1/F2/.../FN    site i holds a fraction F_i of attribute-1 ("dark") samples, equal site sizes
    labelset:K                IID samples, each site annotates only K classes (label-set mismatch, spec §5)
    longtail-missing:ALPHA[:M]  Dirichlet label skew, and each site lacks M whole classes (spec §6), M = 1
    class-dirichlet:A1/.../AK[:P]  per-class Dirichlet concentration A_k, and each site drops each class with
                              probability P (default 0): FCA's RSNA-ICH splits (spec §6(d))

Multi-label labels (`[N, K]` multi-hot rows) support the schemes that do not deal classes to sites; iid
stratifies on each sample's first positive finding. `partition_like` splits an evaluation set like training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from medflare.data.types import UNLABELED
from medflare.errors import ConfigError, DataError

SCHEME_FORMS = (
    "iid",
    "dirichlet:ALPHA",
    "quantity:ALPHA",
    "attribute:F1/F2/.../FN",
    "labelset:K",
    "longtail-missing:ALPHA[:M]",
    "class-dirichlet:A1/.../AK[:P]",
)
MAX_REDRAWS = 100
ALPHA_SCHEMES = ("dirichlet", "quantity", "longtail-missing")  # the schemes a concentration ALPHA skews
MULTI_LABEL_SCHEMES = ("iid", "quantity", "attribute", "labelset")


@dataclass
class Partition:
    """Per site, sorted disjoint int64 indices into the partitioned `labels`, and (`labelset` only) the bool
    `[K]` mask of the classes that site annotates."""

    indices: list[np.ndarray]
    identified: list[np.ndarray] | None = None

    def sizes(self) -> list[int]:
        """Number of samples per site."""
        return [len(site) for site in self.indices]


@dataclass(frozen=True)
class PartitionScheme:
    """A parsed scheme string: its kind and the parameters that kind takes (see the module docstring)."""

    kind: str
    alpha: float | None = None
    fractions: tuple[float, ...] | None = None
    classes_per_site: int | None = None
    missing_per_site: int | None = None
    class_alphas: tuple[float, ...] | None = None
    drop_prob: float | None = None


def parse_scheme(scheme: str) -> PartitionScheme:
    """Parses a scheme string such as "dirichlet:0.5"; ConfigError listing the valid forms when it is bad."""
    kind, _, rest = scheme.strip().partition(":")
    args = rest.split(":") if rest else []
    forms = ", ".join(SCHEME_FORMS)

    def fail(reason: str) -> ConfigError:
        return ConfigError(f"Bad partition scheme '{scheme}': {reason}. Valid forms: {forms}.")

    def number(text: str, cast: Callable[[str], float | int], what: str, minimum: float, strict: bool) -> float:
        try:
            value = cast(text)
        except ValueError as err:
            raise fail(f"{what} '{text}' is not a valid {cast.__name__}") from err
        if value < minimum or (strict and value == minimum) or not np.isfinite(value):
            raise fail(f"{what} must be {'>' if strict else '>='} {minimum}, got {text}")
        return value

    arity = {"iid": (0, 0), "dirichlet": (1, 1), "quantity": (1, 1), "attribute": (1, 1), "labelset": (1, 1),
             "longtail-missing": (1, 2), "class-dirichlet": (1, 2)}
    if kind not in arity:
        raise fail(f"unknown scheme '{kind}'")
    low, high = arity[kind]
    if not low <= len(args) <= high:
        raise fail(f"'{kind}' takes {low if low == high else f'{low} to {high}'} ':'-separated parameter(s)")
    if kind == "iid":
        return PartitionScheme(kind)
    if kind in ("dirichlet", "quantity"):
        return PartitionScheme(kind, alpha=number(args[0], float, "ALPHA", 0.0, strict=True))
    if kind == "attribute":
        fractions = tuple(number(f, float, "fraction", 0.0, strict=False) for f in args[0].split("/"))
        if any(f > 1 for f in fractions):
            raise fail("every fraction must be in [0, 1]")
        return PartitionScheme(kind, fractions=fractions)
    if kind == "labelset":
        return PartitionScheme(kind, classes_per_site=int(number(args[0], int, "K", 1, strict=False)))
    if kind == "class-dirichlet":
        alphas = tuple(number(a, float, "A_k", 0.0, strict=True) for a in args[0].split("/"))
        drop = number(args[1], float, "P", 0.0, strict=False) if len(args) == 2 else 0.0
        if drop >= 1:
            raise fail(f"P must be < 1, got {args[1]}")
        return PartitionScheme(kind, class_alphas=alphas, drop_prob=drop)
    missing = int(number(args[1], int, "M", 0, strict=False)) if len(args) == 2 else 1
    return PartitionScheme(kind, alpha=number(args[0], float, "ALPHA", 0.0, strict=True), missing_per_site=missing)


def partition(labels: np.ndarray, num_sites: int, scheme: str, *, seed: int, min_size: int = 10,
              attributes: np.ndarray | None = None, num_classes: int | None = None) -> Partition:
    """Splits sample indices of `labels` (in a deterministic order) into `num_sites` disjoint sites by `scheme`.

    Random schemes redraw (up to `MAX_REDRAWS` times) until every site has `min_size`; `attributes` (binary, per
    sample) feed `attribute:`; `num_classes` defaults to `labels.max() + 1`.

    Raises:
        ConfigError: Bad scheme string or parameters that cannot fit `num_sites` / the class count.
        DataError: A site ends up with fewer than `min_size` samples, or `attributes` is missing.
    """
    parsed = parse_scheme(scheme)
    labels = np.asarray(labels)
    if num_sites < 1:
        raise ConfigError(f"num_sites must be >= 1, got {num_sites}.")
    if labels.ndim == 2:
        if parsed.kind not in MULTI_LABEL_SCHEMES:
            raise ConfigError(f"Partition '{scheme}' deals classes to sites, which needs single-label data; for "
                              f"multi-label data use one of {', '.join(MULTI_LABEL_SCHEMES)}.")
        num_classes = labels.shape[1] if num_classes is None else num_classes
        labels = multi_label_strata(labels)
    else:
        labels = labels.reshape(-1)
        num_classes = _checked_class_count(labels, num_classes, scheme)
    rng = np.random.default_rng(seed)
    identified, allowed = None, None
    if parsed.kind == "iid":
        sites = _stratified_round_robin(labels, num_sites, rng)
    elif parsed.kind == "dirichlet":
        allowed = np.ones((num_classes, num_sites), dtype=bool)
    elif parsed.kind == "quantity":
        sites = _redraw(lambda: _quantity_skew(len(labels), num_sites, parsed.alpha, rng), scheme, min_size)
    elif parsed.kind == "attribute":
        sites = _attribute_mix(attributes, parsed.fractions, num_sites, scheme, rng)
    elif parsed.kind == "labelset":
        sites = _stratified_round_robin(labels, num_sites, rng)
        identified = _identified_classes(num_classes, num_sites, parsed.classes_per_site, scheme, rng)
    elif parsed.kind == "longtail-missing":
        allowed = _kept_classes(num_classes, num_sites, scheme, rng, missing=parsed.missing_per_site).T
    else:  # class-dirichlet
        if len(parsed.class_alphas) != num_classes:
            raise ConfigError(f"Partition '{scheme}' gives {len(parsed.class_alphas)} alphas for {num_classes} "
                              "classes; give one alpha per class.")
        allowed = _kept_classes(num_classes, num_sites, scheme, rng, drop_prob=parsed.drop_prob).T
    if allowed is not None:  # the Dirichlet label-skew schemes
        alphas = np.asarray(parsed.class_alphas or np.full(num_classes, parsed.alpha))
        sites = _redraw(lambda: _dirichlet_label_skew(labels, alphas, allowed, rng), scheme, min_size)
    _check_min_size(sites, min_size, scheme, tries=1)
    return Partition(indices=[np.sort(np.asarray(site, dtype=np.int64)) for site in sites], identified=identified)


def _checked_class_count(labels: np.ndarray, num_classes: int | None, scheme: str) -> int:
    """K of single-label `labels` (declared, or max + 1), which must be clean ids in [0, K)."""
    if len(labels) and labels.min() < 0:
        raise DataError(f"Partition '{scheme}' needs clean labels >= 0; apply label masks after partitioning.")
    if num_classes is None:
        return int(labels.max()) + 1 if len(labels) else 0
    if len(labels) and labels.max() >= num_classes:
        raise DataError(f"Partition '{scheme}': label {int(labels.max())} is >= num_classes={num_classes}; "
                        "declare the right number of classes.")
    return num_classes


def multi_label_strata(labels: np.ndarray) -> np.ndarray:
    """One stratum per multi-hot row: its first positive finding (unknown -1 is not positive), or K when it has
    none; stratifying on it keeps every finding's prevalence about equal across sites in an iid split."""
    labels = np.asarray(labels)
    positive = labels == 1
    return np.where(positive.any(axis=1), positive.argmax(axis=1), labels.shape[1]).astype(np.int64)


def partition_like(labels: np.ndarray, site_class_counts: np.ndarray, *, seed: int) -> Partition:
    """Splits clean evaluation `labels` over sites so each site's class mix follows its training mix.

    Class k's samples are shuffled and cut in proportion to `site_class_counts[:, k]` (`[num_sites, K]`, before
    label masks and noise): a site that trains on no k gets no k; a class no site trains on is spread evenly.
    DataError when a label is negative or not below K.
    """
    labels = np.asarray(labels).reshape(-1)
    counts = np.asarray(site_class_counts, dtype=float)
    if len(labels) and (labels.min() < 0 or labels.max() >= counts.shape[1]):
        raise DataError(f"partition_like needs labels in [0, {counts.shape[1]}), got {int(labels.min())} to "
                        f"{int(labels.max())}; pass the clean evaluation labels and the class count of training.")
    rng = np.random.default_rng(seed)
    sites: list[list[int]] = [[] for _ in range(counts.shape[0])]
    for k in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == k))
        trained = counts[:, k]
        _deal(members, trained if trained.sum() > 0 else np.ones_like(trained), sites)
    return Partition(indices=[np.sort(np.asarray(site, dtype=np.int64)) for site in sites])


def apply_label_mask(labels: np.ndarray, identified: np.ndarray) -> np.ndarray:
    """A copy of `labels` with every class outside the bool mask `identified` set to `UNLABELED` (-1): the
    sample (single-label) or that class's entry (multi-label)."""
    labels = np.asarray(labels, dtype=np.int64)
    masked = labels.copy()
    if labels.ndim == 2:
        masked[:, ~np.asarray(identified, dtype=bool)] = UNLABELED
        return masked
    labelled = labels >= 0
    masked[labelled & ~np.asarray(identified, dtype=bool)[np.where(labelled, labels, 0)]] = UNLABELED
    return masked


def _stratified_round_robin(labels: np.ndarray, num_sites: int, rng: np.random.Generator) -> list[np.ndarray]:
    """IID split: shuffle within each class, lay classes end to end and deal positions to sites in turn."""
    order = np.concatenate([rng.permutation(np.flatnonzero(labels == k)) for k in np.unique(labels)]
                           or [np.empty(0, dtype=np.int64)])
    # A random start site, so site 0 does not always get the one extra sample of a remainder.
    owner = (np.arange(len(order)) + rng.integers(num_sites)) % num_sites
    return [order[owner == site] for site in range(num_sites)]


def _dirichlet_label_skew(labels: np.ndarray, alphas: np.ndarray, allowed: np.ndarray,
                          rng: np.random.Generator) -> list[np.ndarray]:
    """One draw of the FedML Dirichlet partitioner (spec §1.2), restricted to `allowed[class, site]`: per class k,
    p ~ Dir(alphas[k]), zeroed for sites already holding >= N/C samples or not allowed k, cut cumulatively."""
    num_sites = allowed.shape[1]
    cap = len(labels) / num_sites
    sites: list[list[int]] = [[] for _ in range(num_sites)]
    for k in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == k))
        shares = rng.dirichlet(np.full(num_sites, alphas[k]))
        room = np.array([len(site) < cap for site in sites]) & allowed[k]
        shares = shares * room
        if shares.sum() <= 0:
            # Every allowed site is full (or the draw underflowed): fall back to the allowed sites alone.
            shares = allowed[k].astype(float)
        _deal(members, shares, sites)
    return [np.asarray(site, dtype=np.int64) for site in sites]


def _deal(members: np.ndarray, shares: np.ndarray, sites: list[list[int]]) -> None:
    """Cuts `members` at the cumulative proportions of `shares`; piece i goes to site i (zero share: nothing)."""
    shares = shares / shares.sum()
    cuts = (np.cumsum(shares) * len(members)).astype(int)[:-1]
    for site, chunk in zip(sites, np.split(members, cuts)):
        site.extend(chunk.tolist())


def _quantity_skew(num_samples: int, num_sites: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """One draw of a quantity-skew split: site sizes ~ Dir(alpha), samples shuffled (labels IID)."""
    order = rng.permutation(num_samples)
    cuts = (np.cumsum(rng.dirichlet(np.full(num_sites, alpha))) * num_samples).astype(int)[:-1]
    return np.split(order, cuts)


def _attribute_mix(attributes: np.ndarray | None, fractions: tuple[float, ...], num_sites: int, scheme: str,
                   rng: np.random.Generator) -> list[np.ndarray]:
    """Equal-size sites where site i holds a share `fractions[i]` of attribute-1 samples; the size is the largest
    both attribute pools suffice for (some samples stay unused when the mix differs from the data's)."""
    if attributes is None:
        raise DataError(
            f"Partition '{scheme}' needs a per-sample attribute; use a source with an attribute column "
            "(synthetic, or a CSV manifest with an 'attribute' column)."
        )
    if len(fractions) != num_sites:
        raise ConfigError(f"Partition '{scheme}' gives {len(fractions)} fractions for {num_sites} sites; "
                          "give one fraction per site.")
    attributes = np.asarray(attributes).reshape(-1)
    pools = [rng.permutation(np.flatnonzero(attributes != 1)), rng.permutation(np.flatnonzero(attributes == 1))]
    share = np.asarray(fractions)
    site_size = len(attributes) // num_sites
    wanted = np.rint(share * site_size).astype(int)
    while site_size > 0 and (wanted.sum() > len(pools[1]) or (site_size - wanted).sum() > len(pools[0])):
        site_size -= 1
        wanted = np.rint(share * site_size).astype(int)
    dark_ends = np.cumsum(wanted)
    light_ends = np.cumsum(site_size - wanted)
    return [np.concatenate([pools[0][light_ends[i] - (site_size - wanted[i]):light_ends[i]],
                            pools[1][dark_ends[i] - wanted[i]:dark_ends[i]]]) for i in range(num_sites)]


def _identified_classes(num_classes: int, num_sites: int, per_site: int, scheme: str,
                        rng: np.random.Generator) -> list[np.ndarray]:
    """FedLSM's class assignment: deal shuffled classes round-robin, then top every site up to `per_site`."""
    if per_site > num_classes or per_site * num_sites < num_classes:
        raise ConfigError(
            f"Partition '{scheme}': {num_sites} sites x {per_site} classes cannot cover all {num_classes} "
            f"classes with at most {num_classes} per site; choose K between {-(-num_classes // num_sites)} "
            f"and {num_classes}."
        )
    masks = [np.zeros(num_classes, dtype=bool) for _ in range(num_sites)]
    for position, k in enumerate(rng.permutation(num_classes)):
        masks[position % num_sites][k] = True
    for mask in masks:
        missing = per_site - int(mask.sum())
        if missing > 0:
            mask[rng.choice(np.flatnonzero(~mask), size=missing, replace=False)] = True
    return masks


def _kept_classes(num_classes: int, num_sites: int, scheme: str, rng: np.random.Generator, *, missing: int = 0,
                  drop_prob: float = 0.0) -> np.ndarray:
    """bool `[site, class]` of the classes each site may hold (each lacks `missing` random classes, or each class
    with probability `drop_prob`), redrawn until every class stays somewhere and every site keeps one."""
    if missing >= num_classes or (missing > 0 and num_sites == 1):
        raise ConfigError(
            f"Partition '{scheme}': dropping {missing} of {num_classes} classes per site over {num_sites} site(s) "
            "leaves some class nowhere; lower M or add sites."
        )
    for _ in range(MAX_REDRAWS):
        if drop_prob > 0:
            kept = rng.random((num_sites, num_classes)) >= drop_prob
        else:
            kept = np.ones((num_sites, num_classes), dtype=bool)
            for site in range(num_sites):
                kept[site, rng.choice(num_classes, size=missing, replace=False)] = False
        if kept.any(axis=0).all() and kept.any(axis=1).all():
            return kept
    raise ConfigError(f"Partition '{scheme}': could not keep every class on some site in {MAX_REDRAWS} draws; "
                      "lower M (or P) or add sites.")


def _redraw(draw: Callable[[], list[np.ndarray]], scheme: str, min_size: int) -> list[np.ndarray]:
    """Repeats a random partition draw until every site has >= `min_size` samples (at most `MAX_REDRAWS`)."""
    for _ in range(MAX_REDRAWS):
        sites = draw()
        if min(len(site) for site in sites) >= min_size:
            return sites
    _check_min_size(sites, min_size, scheme, tries=MAX_REDRAWS)
    return sites


def _check_min_size(sites: list[np.ndarray], min_size: int, scheme: str, tries: int) -> None:
    sizes = [len(site) for site in sites]
    smallest = int(np.argmin(sizes)) if sizes else 0
    if sizes and sizes[smallest] < min_size:
        alpha = ", raise its ALPHA" if scheme.split(":")[0] in ALPHA_SCHEMES else ""  # only these take one
        raise DataError(
            f"Partition '{scheme}' gives site-{smallest + 1} only {sizes[smallest]} samples (data.min_size="
            f"{min_size}) after {tries} draw(s) over {sum(sizes)} samples; lower the number of sites{alpha}, "
            "or lower data.min_size."
        )
