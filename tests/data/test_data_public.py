"""The unlabelled public set: held out disjoint from every site, identical on every site, no labels, a digest
that tells copies apart, and the separate-source forms a real site uses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medflare.data import DataConfig, load_source, make_site_data
from medflare.data.longtail import long_tail_indices
from medflare.data.public import hold_out_public, load_public_source, public_digest
from medflare.data.types import ImageSet
from medflare.errors import ConfigError, DataError

SOURCE = "synthetic:n=400,n_val=60,n_test=60,size=12"


def _keys(image_set) -> set[bytes]:
    return {image_set.get_image(i).tobytes() for i in range(len(image_set))}


@pytest.mark.parametrize("imbalance", [1.0, 10.0])
def test_the_held_out_public_set_is_disjoint_from_every_site_and_the_same_everywhere(imbalance: float) -> None:
    """Also after the long-tail cut (data.imbalance), which runs before the hold-out: both draw from the cut pool."""
    cfg = DataConfig(source=SOURCE, partition="dirichlet:0.5", num_sites=3, public_fraction=0.25, imbalance=imbalance)
    sites = [make_site_data(cfg, i) for i in range(3)]
    public = _keys(sites[0].public.images)
    pooled = load_source(SOURCE, seed=cfg.seed).train
    kept = long_tail_indices(pooled.labels, pooled.num_classes, imbalance, cfg.seed) if imbalance > 1 else None
    pool_size = len(pooled) if kept is None else len(kept)
    assert pool_size < len(pooled) or imbalance == 1
    assert len(sites[0].public) == round(0.25 * pool_size)
    for site in sites:
        assert public_digest(site.public.images) == public_digest(sites[0].public.images)
        assert np.all(site.public.labels == -1)  # its labels can never be used
        for split in ("train", "val", "test"):
            assert not public & _keys(getattr(site, split).images), split
    assert sum(len(site.train) for site in sites) + len(public) == pool_size
    if kept is not None:  # the public images come from the kept part of the training split
        assert public <= _keys(pooled.subset(kept))


def test_no_public_set_unless_asked_and_the_partition_is_unchanged() -> None:
    plain = DataConfig(source=SOURCE, partition="dirichlet:0.5", num_sites=3)
    site = make_site_data(plain, 1)
    assert site.public is None
    _, pool = hold_out_public(load_source(SOURCE).train, 0.0, seed=0)
    assert pool is load_source(SOURCE).train


def test_the_digest_changes_with_one_pixel_or_the_order_but_not_with_labels() -> None:
    images = load_source(SOURCE).train.subset(np.arange(20))
    reference = public_digest(images)
    assert public_digest(images.subset(np.arange(20))) == reference
    assert public_digest(images.subset(np.r_[1, 0, 2:20])) != reference
    changed = images.subset(np.arange(20))
    changed.images[7, 3, 3, 0] ^= 1
    assert public_digest(changed) != reference
    relabelled = images.subset(np.arange(20))
    relabelled.labels[:] = 0
    assert public_digest(relabelled) == reference


def _in_memory(images: np.ndarray) -> ImageSet:
    """An unlabelled in-memory set of `[N, H, W, 1]` images, kept in their own dtype."""
    return ImageSet(labels=np.full(len(images), -1), num_classes=2, channels=1, images=images)


@pytest.mark.parametrize("first, second", [
    (np.full((2, 4, 4, 1), 1, np.uint16), np.full((2, 4, 4, 1), 257, np.uint16)),  # one uint8 after a cast
    (np.full((2, 4, 4, 1), 0.5, np.float32), np.full((2, 4, 4, 1), 0.5000001, np.float32)),
    (np.full((2, 4, 4, 1), 7, np.uint8), np.full((2, 4, 4, 1), 7, np.uint16)),  # same values, other dtype
    (np.zeros((2, 4, 4, 1), np.uint8), np.zeros((2, 8, 2, 1), np.uint8)),  # same bytes, other shape
], ids=["uint16-same-uint8-byte", "float32-below-8-bits", "uint8-vs-uint16", "same-bytes-other-shape"])
def test_the_digest_tells_apart_images_that_differ_beyond_8_bits_or_in_dtype_or_shape(
        first: np.ndarray, second: np.ndarray) -> None:
    assert public_digest(_in_memory(first)) != public_digest(_in_memory(second))
    assert public_digest(_in_memory(first)) == public_digest(_in_memory(first.copy()))


def test_the_digest_of_deep_images_follows_their_order() -> None:
    images = np.arange(3 * 16, dtype=np.float32).reshape(3, 4, 4, 1) / 1000  # all below one uint8 level
    assert public_digest(_in_memory(images[[1, 0, 2]])) != public_digest(_in_memory(images))


def test_two_16_bit_png_sets_that_differ_below_8_bits_have_different_digests(tmp_path: Path) -> None:
    """The real case: 16-bit PNGs read as float32, where a cast to uint8 made every such set look the same (each
    image is min-max scaled, so the sets differ in one pixel's level relative to the others, all within one 8-bit
    step)."""
    digests = []
    for middle in (257, 258):
        folder = tmp_path / f"middle-{middle}"
        folder.mkdir()
        for index in range(2):
            image = np.full((6, 6), 256 + index, np.uint16)
            image[0, :3] = (256, middle, 259)
            Image.fromarray(image).save(folder / f"img_{index}.png")
        digests.append(public_digest(load_public_source(f"images:{folder}", num_classes=2, channels=1, seed=0)))
    assert digests[0] != digests[1]


def test_an_image_folder_is_read_sorted_and_converted(tmp_path: Path,
                                                      png_class_folder: Callable[..., Path]) -> None:
    root = png_class_folder({"a": 3, "b": 2}, channels=3)
    public = load_public_source(f"images:{root}", num_classes=2, channels=1, seed=0)
    assert len(public) == 5 and public.get_image(0).shape[-1] == 1 and np.all(public.labels == -1)
    assert public.paths == sorted(public.paths)
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in public.paths:  # the same files at another place: the same digest
        target = copy / Path(path).relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(Path(path).read_bytes())
    assert public_digest(load_public_source(f"images:{copy}", 2, 1, seed=0)) == public_digest(public)


def test_a_medmnist_file_as_public_set_uses_every_split_in_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    sizes = {"train": 6, "val": 2, "test": 3}
    arrays = {f"{split}_images": rng.integers(0, 256, (n, 8, 8), dtype=np.uint8) for split, n in sizes.items()}
    arrays |= {f"{split}_labels": rng.integers(0, 2, (n, 1)) for split, n in sizes.items()}
    np.savez(tmp_path / "public.npz", **arrays)
    public = load_public_source(f"medmnist:{tmp_path / 'public.npz'}", num_classes=2, channels=1, seed=0)
    expected = np.concatenate([arrays[f"{split}_images"] for split in sizes])
    assert np.array_equal(public.images[..., 0], expected) and np.all(public.labels == -1)
    with pytest.raises(DataError, match="channel"):
        load_public_source(f"medmnist:{tmp_path / 'public.npz'}", num_classes=2, channels=3, seed=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"public_fraction": 1.0}, "public_fraction"),
        ({"public_fraction": 0.2, "public_source": "images:/x"}, "not both"),
        ({"public_fraction": 0.2, "local": True}, "local/medflare_site.json"),
    ],
)
def test_bad_public_options_fail_early(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(source=SOURCE, **options)


def test_a_missing_public_folder_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data.public_source"):
        load_public_source(f"images:{tmp_path / 'nowhere'}", 2, 1, seed=0)
