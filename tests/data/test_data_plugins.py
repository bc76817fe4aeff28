"""Data-source plugins: ``--data KIND:ARGUMENT`` for a kind a plugin registers or a package installs, and
``splits_from_datasets``, which turns a user's datasets (MONAI-style items too) into medflare's splits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from medflare.data import DataSplits, load_source, plugins
from medflare.data.plugins import ENTRY_POINT_GROUP, find_source, register_source, splits_from_datasets
from medflare.data.sources import clear_source_cache
from medflare.errors import ConfigError, DataError
from tests._packages import installed_package

CLASSES = ["normal", "finding"]


@pytest.fixture(autouse=True)
def own_sources(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Kinds registered by a test stay in that test, and no cached source outlives it."""
    monkeypatch.setattr(plugins, "_SOURCES", {})
    clear_source_cache()
    yield
    clear_source_cache()


def float_items(count: int, label: int, value: float = 0.5, side: int = 8) -> list[tuple[torch.Tensor, int]]:
    """``count`` channel-first grey float images of one value, as a torch Dataset returns them."""
    return [(torch.full((1, side, side), value), label) for _ in range(count)]


def toy_splits() -> DataSplits:
    return splits_from_datasets(float_items(4, 0) + float_items(4, 1), float_items(2, 1), float_items(2, 0),
                                class_names=CLASSES)


def test_splits_from_datasets_reads_tuples_and_monai_dictionaries() -> None:
    monai_style = [{"image": np.full((1, 8, 8), 200, dtype=np.uint8), "label": k % 2} for k in range(4)]
    splits = splits_from_datasets(monai_style, float_items(2, 1, value=1.0), float_items(2, 0, value=0.0),
                                  class_names=CLASSES)
    assert splits.train.images.shape == (4, 8, 8, 1) and splits.train.images.dtype == np.uint8
    assert (splits.train.images == 200).all() and splits.train.labels.tolist() == [0, 1, 0, 1]
    assert (splits.val.images == 255).all() and (splits.test.images == 0).all()
    assert splits.info == {"class_names": CLASSES, "named_classes": True}


def test_float_pixels_scale_to_uint8_and_rounding_overshoot_is_clipped() -> None:
    image = torch.tensor([[[0.0, 0.5], [1.0004, -0.0002]]])  # a resize after scaling overshoots a little
    splits = splits_from_datasets([(image, 0), (image, 1)], [(image, 0)], [(image, 1)], class_names=CLASSES)
    assert splits.train.images[0, :, :, 0].tolist() == [[0, 128], [255, 0]]


def test_multi_label_vectors_become_multi_hot_rows() -> None:
    items = [(torch.zeros(1, 8, 8), torch.tensor([1, 0, -1])), (torch.zeros(1, 8, 8), torch.tensor([0, 1, 1]))]
    splits = splits_from_datasets(items, items, items, class_names=["a", "b", "c"])
    assert splits.train.multi_label and splits.train.labels.tolist() == [[1, 0, -1], [0, 1, 1]]


@pytest.mark.parametrize(
    "train, message",
    [
        ([(torch.full((1, 8, 8), 2.0), 0)], r"values in \[2, 2\]; give uint8 pixels or floats in \[0, 1\]"),
        ([(torch.zeros(1, 8, 8), 0), (torch.zeros(1, 9, 9), 1)], r"images come in 2 shapes .*Resize"),
        ([(torch.zeros(3, 8, 8), 0)], r"the splits' images differ in shape .*'train': \(8, 8, 3\), 'val': \(8, 8, 1\)"),
        ([(torch.zeros(4, 8, 8), 0)], r"image shape \(4, 8, 8\) is not \[C, H, W\] with C 1 or 3"),
        ([], r"dataset 'train' is empty"),
        ([(torch.zeros(1, 8, 8), 0.5)], r"labels must be whole numbers"),
        ([torch.zeros(1, 8, 8)], r"item 0 is a Tensor; return \(image, label\)"),
        ([(torch.zeros(1, 8, 8), 2)], r"label 2 at row 0 is outside \[0, 2\)"),
    ],
    ids=["out-of-range", "mixed-sizes", "rgb-beside-grey", "four-channels", "empty", "fractional-label", "no-label",
         "unknown-class"],
)
def test_what_cannot_become_a_split_is_refused_in_one_line(train: list, message: str) -> None:
    with pytest.raises(DataError, match=message) as error:
        splits_from_datasets(train, float_items(1, 0), float_items(1, 1), class_names=CLASSES)
    assert "\n" not in str(error.value)


def test_a_registered_kind_loads_through_load_source() -> None:
    calls = []

    @register_source("toy")
    def load_toy(argument: str, seed: int) -> DataSplits:
        calls.append((argument, seed))
        return toy_splits()

    splits = load_source("toy:/data/toy", seed=3)
    assert calls == [("/data/toy", 3)]
    assert splits.info["kind"] == "toy" and splits.info["class_names"] == CLASSES
    assert splits.info["counts"]["train"] == [4, 4] and splits.info["image_size"] == 8
    with pytest.raises(DataError, match=r"has 2 classes but num_classes=3 is declared"):
        load_source("toy:/data/toy", seed=3, num_classes=3)
    with pytest.raises(ConfigError, match=r"Unknown data source 'nothing:x'; valid forms: .*csv:FILE, toy:\.\.\."):
        load_source("nothing:x")


def test_medflare_kinds_cannot_be_taken_over_nor_registered_twice() -> None:
    with pytest.raises(ConfigError, match="other than medflare's own"):
        register_source("folder")(lambda argument, seed: toy_splits())
    register_source("mine")(lambda argument, seed: toy_splits())
    with pytest.raises(ConfigError, match="'mine' is registered twice"):
        register_source("mine")(lambda argument, seed: toy_splits())


def test_a_plugin_that_returns_no_splits_is_refused() -> None:
    register_source("wrong")(lambda argument, seed: [1, 2, 3])
    with pytest.raises(DataError, match=r"'wrong:x' .* returned a list, not DataSplits"):
        load_source("wrong:x")


INSTALLED_SOURCE = '''
import torch
from medflare.data.plugins import splits_from_datasets

def load(argument, seed):
    items = [(torch.full((1, 8, 8), 0.25), k % 2) for k in range(int(argument))]
    return splits_from_datasets(items, items, items, class_names=["x", "y"])
'''


def test_an_installed_source_is_found_by_its_entry_point_on_first_use(tmp_path: Path) -> None:
    entries = {ENTRY_POINT_GROUP: {"counted": "user_data_counted:load"}}
    with installed_package(tmp_path, "user-data", entries, {"user_data_counted": INSTALLED_SOURCE}):
        assert "counted" in plugins.source_kinds()
        splits = load_source("counted:6")
        assert len(splits.train) == 6 and splits.info["class_names"] == ["x", "y"]
        assert find_source("counted").__module__ == "user_data_counted"
