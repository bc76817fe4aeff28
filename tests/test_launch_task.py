"""What ``medflare run``, ``compare`` and ``export`` show before anything starts: the task they inferred (classes
with their names, channels, image size), each simulated site's images, and a note on an image size nobody chose
that is large or squashes the images (issue 48, item 3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from medflare.console.launch import task_lines
from medflare.plan import describe_sites, resolve, task_of, validated
from medflare.run_config import RunConfig


def folder(root: Path, shapes: list[tuple[int, int]]) -> Path:
    """Two class folders, ``normal`` and ``effusion``, of 30 images each, cycling through ``shapes`` (h, w)."""
    for name in ("normal", "effusion"):
        (root / name).mkdir(parents=True)
        for i in range(30):
            height, width = shapes[i % len(shapes)]
            Image.fromarray(np.full((height, width), 8 * i, np.uint8)).save(root / name / f"{i}.png")
    return root


def lines_for(run: RunConfig) -> list[str]:
    plan = resolve(run, "byoc")
    return task_lines(plan, describe_sites(plan)[0], run)


def test_the_task_and_each_sites_images_are_shown(tmp_path: Path) -> None:
    run = RunConfig(method="fedavg", clients=2, data={"source": f"folder:{folder(tmp_path, [(32, 32)])}"})
    lines = lines_for(run)
    assert lines[0] == "medflare: task: 2 classes (effusion, normal), 1 channel(s), 32 x 32 px"
    assert [line.split(":")[1].strip() for line in lines[1:]] == ["site-1", "site-2"]
    assert all(" train / " in line and " val / " in line and " test images" in line for line in lines[1:])
    assert not any("note" in line for line in lines)


def test_large_or_mixed_sizes_read_off_the_data_get_a_note_naming_the_option(tmp_path: Path) -> None:
    source = f"folder:{folder(tmp_path, [(600, 520), (600, 600)])}"
    notes = [line for line in lines_for(RunConfig(method="fedavg", data={"source": source})) if "note" in line]
    assert len(notes) == 2 and all("--set data.image_size" in note for note in notes)
    assert "the images are 600 px (the first image's height)" in notes[0]
    assert "not all 600 x 600 px (600 x 520, 600 x 600)" in notes[1] and "squashes" in notes[1]
    chosen = RunConfig(method="fedavg", data={"source": source, "image_size": 64})
    assert not any("note" in line for line in lines_for(chosen))  # a size the user set is theirs


def test_a_job_on_site_data_shows_the_declared_task(tmp_path: Path) -> None:
    task = {"num_classes": 3, "in_channels": 1, "image_size": 28, "class_names": ["a", "b", "c"]}
    lines = lines_for(RunConfig(method="fedavg", data={"source": "site"}, task=task))
    assert lines == ["medflare: task: 3 classes (a, b, c), 1 channel(s), 28 x 28 px",
                     "medflare:   each site reads its own images and checks them against this task"]


def test_a_window_the_images_cannot_take_is_refused_before_launch(tmp_path: Path) -> None:
    """A window for colour images (or a DICOM's own window for PNGs) failed inside the job at every site, 34-85 s
    later, behind a generic count of valid results (issue 48, item 4): the task's first image is read with it."""
    import pytest

    from medflare.errors import DataError

    for shape, window, expected in (((16, 16, 3), "40,80", "is a colour image"), ((16, 16), "file", "is not a DICOM")):
        root = tmp_path / f"{len(shape)}d"
        for name in ("a", "b"):
            (root / name).mkdir(parents=True)
            for i in range(30):
                Image.fromarray(np.full(shape, i, np.uint8)).save(root / name / f"{i}.png")
        run = RunConfig(method="fedavg", data={"source": f"folder:{root}", "window": window})
        run = validated(run)
        with pytest.raises(DataError, match=expected):
            task_of(run)
