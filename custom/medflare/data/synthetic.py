"""Embedded synthetic "skin lesion" data set: deterministic, class-conditioned, long-tail and attribute aware.

A class is a point in a 7-D space of lesion features (eccentricity, border irregularity, satellite spots,
texture frequency and kind, hue, darkness), the points a maximin Latin hypercube, so no single feature separates
the classes; each image jitters its point by `overlap`, a real Bayes error. Position, size, orientation, lobes,
illumination and noise are class-independent nuisances. The attribute is the skin tone (0 light, 1 dark: lower
lesion contrast). The seed only draws samples, from independent streams per split; val and test are
class-balanced (the usual long-tail protocol), train follows `imbalance`.

Multi-label mode (`multilabel=1`): zero or more "findings" on a grey mottled field, each a blob with its own
place, size, elongation and tint. Prevalence falls from 30 % (k = 0) to 30 % / `imbalance`; pairs (0, 1),
(2, 3), ... co-occur through a Gaussian copula with correlation `cooccurrence`. The attribute darkens the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from statistics import NormalDist

import numpy as np

from medflare.data.types import DataSplits, ImageSet
from medflare.errors import ConfigError

# Feature columns of a class prototype, each in [0, 1].
ECCENTRICITY, IRREGULARITY, SPOTS, TEXTURE_FREQUENCY, TEXTURE_KIND, HUE, DARKNESS = range(7)
NUM_FEATURES = 7

# Fixed seed of the class prototypes, so class definitions never change with the sampling seed.
_PROTOTYPE_SEED = 20_240_611
_PROTOTYPE_CANDIDATES = 64
_MAX_SPOTS = 6
_REFERENCE_SIZE = 28.0  # lengths below are in pixels at 28 px and scaled linearly for other sizes
_SPLIT_STREAMS = {"train": 0, "val": 1, "test": 2}
_DARK_CONTRAST_LOSS = 0.3  # share of the background colour mixed into lesions on dark skin
_TEXTURE_CONTRAST = 0.3

_LIGHT_SKIN = np.array([0.88, 0.72, 0.62])
_DARK_SKIN = np.array([0.46, 0.32, 0.24])
_BROWN_LESION = np.array([0.58, 0.30, 0.14])
_BLUE_GREY_LESION = np.array([0.28, 0.32, 0.55])


@dataclass(frozen=True)
class SyntheticConfig:
    """Parameters of the synthetic source; `synthetic:key=val,...` sets any of them. `n`: training images;
    `channels` 1 is the luma of the RGB rendering; `imbalance`: largest/smallest training class (exponential);
    `overlap`: std of the per-image feature jitter; `pixel_noise` in [0, 1] intensity units; `n_val`, `n_test`:
    None = max(300, n // 4)."""

    n: int = 2400
    classes: int = 5
    size: int = 28
    channels: int = 3
    imbalance: float = 1.0
    dark_fraction: float = 0.5
    overlap: float = 0.2
    pixel_noise: float = 0.04
    n_val: int | None = None
    n_test: int | None = None
    multilabel: int = 0
    cooccurrence: float = 0.6

    def __post_init__(self) -> None:
        checks = [
            (self.n >= self.classes, f"n={self.n} must be at least classes={self.classes}"),
            (self.classes >= 2, f"classes={self.classes} must be at least 2"),
            (self.size >= 8, f"size={self.size} must be at least 8 pixels"),
            (self.channels in (1, 3), f"channels={self.channels} must be 1 or 3"),
            (self.imbalance >= 1.0, f"imbalance={self.imbalance} must be >= 1 (max/min class ratio)"),
            (0.0 <= self.dark_fraction <= 1.0, f"dark_fraction={self.dark_fraction} must be in [0, 1]"),
            (self.overlap >= 0.0, f"overlap={self.overlap} must be >= 0"),
            (self.pixel_noise >= 0.0, f"pixel_noise={self.pixel_noise} must be >= 0"),
            (self.n_val is None or self.n_val >= 0, f"n_val={self.n_val} must be >= 0"),
            (self.n_test is None or self.n_test >= 0, f"n_test={self.n_test} must be >= 0"),
            (self.multilabel in (0, 1), f"multilabel={self.multilabel} must be 0 or 1"),
            (0.0 <= self.cooccurrence < 1.0, f"cooccurrence={self.cooccurrence} must be in [0, 1)"),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ConfigError("Invalid synthetic source: " + "; ".join(problems) + ".")

    def split_size(self, split: str) -> int:
        """Images in `split`: `n`, `n_val` or `n_test` (val and test default to max(300, n // 4))."""
        given = {"train": self.n, "val": self.n_val, "test": self.n_test}[split]
        return max(300, self.n // 4) if given is None else given

    @classmethod
    def from_spec(cls, options: str) -> SyntheticConfig:
        """Parses the `key=val,key=val` part of a `synthetic:` spec (ConfigError for a bad pair)."""
        floats = ("imbalance", "dark_fraction", "overlap", "pixel_noise", "cooccurrence")
        types = {f.name: (float if f.name in floats else int) for f in fields(cls)}
        values: dict[str, float | int] = {}
        for pair in filter(None, (part.strip() for part in options.split(","))):
            key, sep, raw = pair.partition("=")
            key = key.strip()
            if not sep or key not in types:
                raise ConfigError(
                    f"Bad synthetic option '{pair}'; use key=value with keys {', '.join(types)} "
                    "(e.g. 'synthetic:n=2400,classes=5,imbalance=20')."
                )
            try:
                values[key] = types[key](raw.strip())
            except ValueError as err:
                raise ConfigError(f"Synthetic option {key}={raw!r} is not a valid {types[key].__name__}.") from err
        return cls(**values)


def long_tail_profile(num_classes: int, imbalance: float) -> np.ndarray:
    """The exponential long-tail profile IR^(-k/(K-1)), k = 0..K-1: 1 for the head, 1/IR for the last class."""
    return float(imbalance) ** (-np.arange(num_classes) / max(num_classes - 1, 1))


def long_tail_counts(total: int, num_classes: int, imbalance: float) -> np.ndarray:
    """Per-class counts n_k ∝ IR^(-k/(K-1)) summing to `total`, each at least 1 (class 0 is the head)."""
    profile = long_tail_profile(num_classes, imbalance)
    counts = np.maximum(np.floor(total * profile / profile.sum()).astype(np.int64), 1)
    # Hand the rounding remainder to the head classes so the total is exact and the profile stays monotone.
    remainder = total - int(counts.sum())
    if remainder >= 0:
        counts[:remainder] += 1
    else:  # the floor of 1 overshot: take the excess back from the head classes
        counts[: -remainder] -= 1
    return counts


def balanced_counts(total: int, num_classes: int) -> np.ndarray:
    """Per-class counts that differ by at most one and sum to `total`."""
    return np.full(num_classes, total // num_classes, dtype=np.int64) + (np.arange(num_classes) < total % num_classes)


def class_prototypes(num_classes: int) -> np.ndarray:
    """Class feature points `[K, NUM_FEATURES]` in [0, 1]: the maximin of a fixed set of Latin hypercubes."""
    rng = np.random.default_rng([_PROTOTYPE_SEED, num_classes])
    levels = np.linspace(0.0, 1.0, num_classes)
    best, best_distance = None, -1.0
    for _ in range(_PROTOTYPE_CANDIDATES):
        candidate = np.stack([rng.permutation(levels) for _ in range(NUM_FEATURES)], axis=1)
        gaps = np.linalg.norm(candidate[:, None, :] - candidate[None, :, :], axis=-1)
        distance = gaps[np.triu_indices(num_classes, k=1)].min()
        if distance > best_distance:
            best, best_distance = candidate, distance
    return best


def make_synthetic(config: SyntheticConfig, seed: int) -> DataSplits:
    """Generates the train/val/test splits of the synthetic source (byte-identical for the same seed)."""
    if seed < 0:
        raise ConfigError(f"Seed must be >= 0 for the synthetic source, got {seed}.")
    if config.multilabel:
        return _make_findings(config, seed)
    split_counts = {
        "train": long_tail_counts(config.n, config.classes, config.imbalance),
        "val": balanced_counts(config.split_size("val"), config.classes),
        "test": balanced_counts(config.split_size("test"), config.classes),
    }
    sets = {split: _make_split(config, counts, seed, split) for split, counts in split_counts.items()}
    info = {
        "kind": "synthetic",
        "class_names": [f"lesion_type_{k}" for k in range(config.classes)],
        "attribute_names": ["light", "dark"],
        "config": {f.name: getattr(config, f.name) for f in fields(config)},
    }
    return DataSplits(train=sets["train"], val=sets["val"], test=sets["test"], info=info)


def generate_images(labels: np.ndarray, attributes: np.ndarray, config: SyntheticConfig,
                    rng: np.random.Generator) -> np.ndarray:
    """Renders one uint8 `[N, size, size, channels]` image per (label, attribute) pair."""
    params = _draw_image_params(labels, attributes, config, rng)
    images = np.empty((len(labels), config.size, config.size, config.channels), dtype=np.uint8)
    # Fixed-size chunks bound memory at large sizes; the chunking only depends on the config, so it is
    # part of the deterministic recipe.
    chunk = max(16, (1 << 20) // (config.size * config.size))
    for start in range(0, len(labels), chunk):
        part = slice(start, start + chunk)
        images[part] = _to_uint8(_render(params, part, config, rng), config.channels)
    return images


def _to_uint8(rgb: np.ndarray, channels: int) -> np.ndarray:
    """float RGB in [0, 1] as uint8 with ``channels`` (1: its luma)."""
    if channels == 1:
        rgb = rgb @ np.array([0.299, 0.587, 0.114], dtype=np.float32)[:, None]
    return np.clip(np.rint(rgb * 255.0), 0, 255).astype(np.uint8)


def apply_site_shift(images: np.ndarray, site_index: int, strength: float, seed: int) -> np.ndarray:
    """Applies a site's acquisition shift (gain, contrast, gamma, colour cast) to uint8 `[N, H, W, C]` images,
    drawn from (`seed`, `site_index`) only and scaled by `strength` (0: an unchanged copy)."""
    if strength < 0:
        raise ConfigError(f"site_shift strength must be >= 0, got {strength}.")
    if site_index < 0 or seed < 0:
        raise ConfigError(f"site_index ({site_index}) and seed ({seed}) must be >= 0 for a site shift.")
    if strength == 0 or len(images) == 0:
        return images.copy()
    rng = np.random.default_rng([seed, site_index, 0x5EED])
    channels = images.shape[-1]
    gain = np.exp(strength * rng.normal(0.0, 0.25))
    contrast = np.exp(strength * rng.normal(0.0, 0.3))
    gamma = np.exp(strength * rng.normal(0.0, 0.25))
    cast = strength * rng.normal(0.0, 0.06, size=channels)
    pixels = images.astype(np.float32) / 255.0
    mean = pixels.mean(axis=(1, 2, 3), keepdims=True)
    pixels = np.clip((pixels - mean) * contrast + mean, 0.0, 1.0) ** gamma
    pixels = pixels * gain + cast.astype(np.float32)
    return np.clip(np.rint(pixels * 255.0), 0, 255).astype(np.uint8)


def _make_split(config: SyntheticConfig, counts: np.ndarray, seed: int, split: str) -> ImageSet:
    rng = np.random.default_rng([seed, _SPLIT_STREAMS[split]])
    labels = rng.permutation(np.repeat(np.arange(config.classes, dtype=np.int64), counts))
    attributes = (rng.random(len(labels)) < config.dark_fraction).astype(np.int64)
    images = generate_images(labels, attributes, config, rng)
    return ImageSet(labels=labels, num_classes=config.classes, channels=config.channels, images=images,
                    attributes=attributes, name=f"synthetic[{split}]")


FINDING_PREVALENCE = 0.3  # prevalence of finding 0; finding K-1 has FINDING_PREVALENCE / imbalance


def finding_prevalence(config: SyntheticConfig) -> np.ndarray:
    """Prevalence of each finding in multi-label mode: 0.3 · imbalance^(−k/(K−1))."""
    k = np.arange(config.classes)
    return FINDING_PREVALENCE * float(config.imbalance) ** (-k / max(config.classes - 1, 1))


def draw_findings(n: int, config: SyntheticConfig, rng: np.random.Generator) -> np.ndarray:
    """int64 `[n, K]` multi-hot labels: Gaussian-copula Bernoullis, pairs (0, 1), (2, 3), ... correlated."""
    k = config.classes
    covariance = np.eye(k)
    for first in range(0, k - 1, 2):
        covariance[first, first + 1] = covariance[first + 1, first] = config.cooccurrence
    latent = rng.multivariate_normal(np.zeros(k), covariance, size=n, method="cholesky")
    thresholds = np.array([NormalDist().inv_cdf(1.0 - p) for p in finding_prevalence(config)])
    return (latent > thresholds).astype(np.int64)


def _make_findings(config: SyntheticConfig, seed: int) -> DataSplits:
    """The multi-label splits: every split draws its own findings from the same prevalence and co-occurrence."""
    sets = {}
    for split, stream in _SPLIT_STREAMS.items():
        n = config.split_size(split)
        rng = np.random.default_rng([seed, stream, 1])
        labels = draw_findings(n, config, rng)
        attributes = (rng.random(n) < config.dark_fraction).astype(np.int64)
        images = _to_uint8(_render_findings(labels, attributes, config, rng), config.channels)
        sets[split] = ImageSet(labels=labels, num_classes=config.classes, channels=config.channels, images=images,
                               attributes=attributes, name=f"synthetic-multilabel[{split}]")
    info = {
        "kind": "synthetic",
        "class_names": [f"finding_{k}" for k in range(config.classes)],
        "attribute_names": ["bright", "dark"],
        "prevalence": finding_prevalence(config).tolist(),
        "config": {f.name: getattr(config, f.name) for f in fields(config)},
    }
    return DataSplits(train=sets["train"], val=sets["val"], test=sets["test"], info=info)


def _finding_looks(num_classes: int) -> dict[str, np.ndarray]:
    """Fixed appearance of each finding: place on a ring, radius, elongation and RGB tint (seed-independent)."""
    angle = 2 * np.pi * np.arange(num_classes) / num_classes
    step = np.arange(num_classes) * 0.618034 % 1.0  # golden-ratio steps spread sizes and tints
    return {
        "centre": 0.5 + 0.27 * np.stack([np.cos(angle), np.sin(angle)], axis=1),
        "radius": 0.07 + 0.06 * step,
        "elongation": 1.0 + 1.2 * ((np.arange(num_classes) * 0.381966) % 1.0),
        "tint": 0.55 + 0.4 * np.stack([np.cos(2 * np.pi * (step + shift)) for shift in (0.0, 1 / 3, 2 / 3)], axis=1),
        "angle": angle,
    }


def _render_findings(labels: np.ndarray, attributes: np.ndarray, config: SyntheticConfig,
                     rng: np.random.Generator) -> np.ndarray:
    """float32 RGB `[n, size, size, 3]` in about [0, 1]: a mottled grey field plus one blob per positive finding,
    its place jittered by `overlap` × 0.15 of the image and its strength varied (a pattern, not a fixed pixel)."""
    n, size = labels.shape[0], config.size
    looks = _finding_looks(config.classes)
    coords = (np.arange(size, dtype=np.float32) + 0.5) / size
    grid = rng.normal(0.0, 1.0, (n, 6, 6)).astype(np.float32)
    lift = _bilinear_lift(6, size)
    mottling = np.einsum("sg,ngh,th->nst", lift, grid, lift, optimize=True)
    base = np.where(attributes.astype(bool), 0.32, 0.45)[:, None, None] + 0.04 * mottling
    image = np.repeat(base[..., None], 3, axis=-1).astype(np.float32)
    for k in range(config.classes):
        rows = np.flatnonzero(labels[:, k] == 1)
        if len(rows) == 0:
            continue
        centre = looks["centre"][k] + 0.15 * config.overlap * rng.standard_normal((len(rows), 2))
        strength = rng.uniform(0.6, 1.0, len(rows)).astype(np.float32)
        cos, sin = np.cos(looks["angle"][k]), np.sin(looks["angle"][k])
        dx = coords[None, None, :] - centre[:, 0, None, None]
        dy = coords[None, :, None] - centre[:, 1, None, None]
        along, across = dx * cos + dy * sin, -dx * sin + dy * cos
        radius = looks["radius"][k]
        distance2 = (along / (radius * looks["elongation"][k])) ** 2 + (across / radius) ** 2
        blob = (strength[:, None, None] * np.exp(-distance2)).astype(np.float32)[..., None]
        image[rows] = image[rows] * (1 - blob) + looks["tint"][k].astype(np.float32) * blob
    image += config.pixel_noise * rng.standard_normal(image.shape, dtype=np.float32)
    return image


def _draw_image_params(labels: np.ndarray, attributes: np.ndarray, config: SyntheticConfig,
                       rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Draws every per-image random quantity up front, so rendering is a pure function of these arrays."""
    n, size = len(labels), float(config.size)
    scale = size / _REFERENCE_SIZE
    features = class_prototypes(config.classes)[labels]
    features = np.clip(features + config.overlap * rng.standard_normal(features.shape), 0.0, 1.0)
    dark = attributes.astype(bool)

    # Skin tone varies mostly in brightness, a little in hue.
    skin = np.where(dark[:, None], _DARK_SKIN, _LIGHT_SKIN) * rng.normal(1.0, 0.06, (n, 1))
    skin = skin + rng.normal(0.0, 0.02, (n, 3))
    lesion = ((1 - features[:, HUE:HUE + 1]) * _BROWN_LESION + features[:, HUE:HUE + 1] * _BLUE_GREY_LESION)
    lesion = lesion * (1.15 - 0.65 * features[:, DARKNESS:DARKNESS + 1]) + rng.normal(0.0, 0.04, (n, 3))
    # Lesions on dark skin are harder to see: pull their colour towards the background.
    lesion = np.where(dark[:, None], (1 - _DARK_CONTRAST_LOSS) * lesion + _DARK_CONTRAST_LOSS * skin, lesion)

    major = size * rng.uniform(0.20, 0.30, n)
    spot_angles = rng.uniform(0.0, 2 * np.pi, (n, _MAX_SPOTS))
    spot_radii = rng.uniform(1.15, 1.7, (n, _MAX_SPOTS))
    return {
        "features": features,
        "skin": skin,
        "lesion": lesion,
        "centre": size / 2 + rng.normal(0.0, 0.06 * size, (n, 2)),
        "major": major,
        "minor": major * (1.0 - 0.65 * features[:, ECCENTRICITY]),
        "angle": rng.uniform(0.0, np.pi, n),
        "lobes": rng.integers(3, 8, n).astype(np.float64),
        "lobe_phase": rng.uniform(0.0, 2 * np.pi, (n, 2)),
        "texture_angle": rng.uniform(0.0, np.pi, n),
        "texture_phase": rng.uniform(0.0, 2 * np.pi, n),
        "texture_frequency": (0.10 + 0.22 * features[:, TEXTURE_FREQUENCY]) / scale,
        "spot_count": np.minimum(rng.poisson(0.3 + 4.5 * features[:, SPOTS]), _MAX_SPOTS),
        "spot_angles": spot_angles,
        "spot_radii": spot_radii,
        "spot_sigma": scale * rng.uniform(0.7, 1.3, (n, _MAX_SPOTS)),
        "background_grid": rng.normal(0.0, 1.0, (n, 6, 6)),
        "illumination": rng.normal(0.0, 0.06, (n, 2)),
    }


def _render(params: dict[str, np.ndarray], part: slice, config: SyntheticConfig,
            rng: np.random.Generator) -> np.ndarray:
    """Renders images `part` of `params` as float32 RGB `[n, size, size, 3]` in roughly [0, 1]."""
    p = {key: value[part] for key, value in params.items()}
    n, size = len(p["major"]), config.size
    f32 = np.float32
    coords = (np.arange(size, dtype=f32) + 0.5)
    dy = coords[None, :, None] - p["centre"][:, 1, None, None].astype(f32)
    dx = coords[None, None, :] - p["centre"][:, 0, None, None].astype(f32)
    cos, sin = np.cos(p["angle"])[:, None, None].astype(f32), np.sin(p["angle"])[:, None, None].astype(f32)
    along, across = dx * cos + dy * sin, -dx * sin + dy * cos
    major, minor = p["major"][:, None, None].astype(f32), p["minor"][:, None, None].astype(f32)

    # Lesion body: an ellipse whose border radius is modulated by two harmonics (irregular border).
    radius = np.sqrt((along / major) ** 2 + (across / minor) ** 2)
    polar = np.arctan2(across / minor, along / major)
    irregularity = p["features"][:, IRREGULARITY, None, None].astype(f32)
    lobes = p["lobes"][:, None, None].astype(f32)
    border = (1.0 + 0.30 * irregularity * np.sin(lobes * polar + p["lobe_phase"][:, 0, None, None])
              + 0.12 * irregularity * np.sin((lobes + 2) * polar + p["lobe_phase"][:, 1, None, None]))
    sharpness = major / (0.9 * size / _REFERENCE_SIZE)  # about one pixel of blur at the border
    body = 1.0 / (1.0 + np.exp(-np.clip((border - radius) * sharpness, -30, 30)))

    # Lesion texture: a blend of stripes and dots at a class-dependent spatial frequency.
    omega = (2 * np.pi * p["texture_frequency"])[:, None, None].astype(f32)
    t_cos = np.cos(p["texture_angle"])[:, None, None].astype(f32)
    t_sin = np.sin(p["texture_angle"])[:, None, None].astype(f32)
    t_along, t_across = dx * t_cos + dy * t_sin, -dx * t_sin + dy * t_cos
    phase = p["texture_phase"][:, None, None].astype(f32)
    stripes = np.sin(omega * t_along + phase)
    dots = np.sin(omega * t_along + phase) * np.sin(omega * t_across)
    kind = p["features"][:, TEXTURE_KIND, None, None].astype(f32)
    texture = (1 - kind) * stripes + kind * dots

    # Satellite spots: small Gaussian blots just outside the border.
    spots = np.zeros((n, size, size), dtype=f32)
    for s in range(_MAX_SPOTS):
        active = (p["spot_count"] > s)[:, None, None]
        reach = p["spot_radii"][:, s] * p["major"]
        sx = p["centre"][:, 0] + reach * np.cos(p["spot_angles"][:, s])
        sy = p["centre"][:, 1] + reach * np.sin(p["spot_angles"][:, s])
        dist2 = ((coords[None, None, :] - sx[:, None, None].astype(f32)) ** 2
                 + (coords[None, :, None] - sy[:, None, None].astype(f32)) ** 2)
        blot = np.exp(-dist2 / (2 * p["spot_sigma"][:, s, None, None].astype(f32) ** 2))
        spots = np.maximum(spots, np.where(active, blot, 0.0))

    # Background: skin tone with smooth mottling, an illumination gradient and fine grain.
    grid = p["background_grid"].astype(f32)
    lift = _bilinear_lift(grid.shape[-1], size)
    mottling = np.einsum("sg,ngh,th->nst", lift, grid, lift, optimize=True)
    ramp = (coords / size - 0.5)
    illumination = (p["illumination"][:, 0, None, None] * ramp[None, :, None]
                    + p["illumination"][:, 1, None, None] * ramp[None, None, :]).astype(f32)
    shade = (1.0 + 0.05 * mottling + illumination)[..., None]
    background = p["skin"][:, None, None, :].astype(f32) * shade

    lesion = p["lesion"][:, None, None, :].astype(f32) * (1.0 + _TEXTURE_CONTRAST * texture)[..., None]
    coverage = (0.92 * body)[..., None]
    image = background * (1 - coverage) + lesion * coverage
    blot = (0.8 * spots)[..., None]
    image = image * (1 - blot) + p["lesion"][:, None, None, :].astype(f32) * blot
    image += config.pixel_noise * rng.standard_normal(image.shape, dtype=f32)
    return image


def _bilinear_lift(grid: int, size: int) -> np.ndarray:
    """Matrix `[size, grid]` that bilinearly upsamples a `grid`-point signal to `size` pixels."""
    position = (np.arange(size) + 0.5) * grid / size - 0.5
    low = np.clip(np.floor(position).astype(int), 0, grid - 1)
    high = np.clip(low + 1, 0, grid - 1)
    weight = np.clip(position - low, 0.0, 1.0)
    lift = np.zeros((size, grid), dtype=np.float32)
    lift[np.arange(size), low] += 1 - weight
    lift[np.arange(size), high] += weight
    return lift
