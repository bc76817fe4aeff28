"""Every file or folder a job names is made absolute where the user typed it (issue 30, item 1).

FLARE starts the simulator's server and each site (and a POC's) in a workspace folder of its own, so a relative
``medmnist:``/``folder:``/``csv:`` source, public set or weights file used to pass validation here and fail at every
site minutes later. A path that names nothing here is refused before anything starts, in one line naming it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import medflare.console.simulate as simulate_module
from medflare.console.cli import main
from medflare.data import DataConfig, make_site_data
from medflare.errors import DataError, MedflareError
from medflare.plan import PLAN_FILE, validated
from medflare.run_config import RunConfig

from .conftest import SHARED_DATA


def write_tiny_medmnist(path: Path) -> Path:
    """A MedMNIST-layout file of 2 classes, 40/20/20 images of 8x8 pixels."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split, count in (("train", 40), ("val", 20), ("test", 20)):
        arrays[f"{split}_images"] = rng.integers(0, 256, (count, 8, 8), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(count) % 2).reshape(-1, 1).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return path


@pytest.fixture
def user_folder(tmp_path: Path, monkeypatch) -> Path:
    """The folder the user runs medflare in (``tmp/here``), with ``tmp/data/tiny.npz`` beside it."""
    write_tiny_medmnist(tmp_path / "data" / "tiny.npz")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    return here


def test_a_relative_medmnist_path_reaches_the_sites_absolute_and_they_read_it_from_their_own_folder(
    user_folder: Path, tmp_path: Path, monkeypatch
) -> None:
    run = RunConfig(method="fedavg", data={"source": "medmnist:../data/tiny.npz", "min_size": 1})
    run = validated(run)
    expected = f"medmnist:{tmp_path / 'data' / 'tiny.npz'}"
    assert run.data["source"] == expected
    assert run.site_data()["source"] == expected  # what the job carries to every site

    site_workspace = tmp_path / "workspace" / "site-1"  # where FLARE starts a site
    site_workspace.mkdir(parents=True)
    monkeypatch.chdir(site_workspace)
    site = make_site_data(DataConfig(**run.site_data()), site_index=0)
    assert len(site.train) > 0


@pytest.mark.parametrize("spec, make", [
    ("folder:images", lambda root: (root / "images").mkdir()),
    ("csv:manifest.csv", lambda root: (root / "manifest.csv").write_text("path,label\n")),
])
def test_relative_folder_and_csv_sources_become_absolute(spec: str, make, user_folder: Path) -> None:
    make(user_folder)
    run = RunConfig(method="fedavg", data={"source": spec})
    run = validated(run, check_files=False)  # validation alone: the (empty) data is read later
    kind, _, path = spec.partition(":")
    assert run.data["source"] == f"{kind}:{user_folder / path}"


def test_a_relative_public_set_and_weights_file_become_absolute(user_folder: Path) -> None:
    (user_folder / "public").mkdir()
    (user_folder / "weights.pt").write_bytes(b"")
    run = RunConfig(method="fedavg", pretrained="weights.pt",
                    data={"source": "synthetic:n=200", "public_source": "images:public"})
    run = validated(run)
    assert run.data["public_source"] == f"images:{user_folder / 'public'}"
    assert run.pretrained == str(user_folder / "weights.pt")


def test_a_missing_relative_path_is_refused_before_launch_in_one_line_naming_it(
    user_folder: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(simulate_module, "run_simulation", lambda *a, **k: pytest.fail("the simulator started"))
    code = main(["run", "fedprox", "--data", "medmnist:../data/absent.npz", "--out", str(user_folder / "out")])
    error = capsys.readouterr().err
    assert code == 2
    assert error.count("\n") == 1 and "'../data/absent.npz' does not exist" in error
    assert str(user_folder.parent / "data" / "absent.npz") in error  # where it was looked for
    assert not (user_folder / "out").exists() and not (user_folder / "out.partial").exists()


@pytest.mark.parametrize("data, option", [
    ({"source": "folder:no-such-folder"}, "data.source: folder 'no-such-folder'"),
    ({"source": "synthetic:n=200", "public_source": "images:no-such-folder"},
     "data.public_source: folder 'no-such-folder'"),
])
def test_every_path_option_is_checked_here(data: dict, option: str, user_folder: Path) -> None:
    with pytest.raises(DataError, match=option):
        validated(RunConfig(method="fedavg", data=data))


def test_a_missing_weights_file_names_where_it_was_looked_for(user_folder: Path) -> None:
    with pytest.raises(MedflareError, match=f"weights file '{user_folder / 'absent.pt'}' not found"):
        validated(RunConfig(method="fedavg", pretrained="absent.pt", data={"source": "synthetic:n=200"}))


def test_export_makes_paths_absolute_without_requiring_them_here(user_folder: Path) -> None:
    run = RunConfig(method="fedavg", pretrained="server-only.pt", data={"source": "medmnist:elsewhere.npz"})
    run = validated(run, check_files=False)  # export: the machines that read them may be others
    assert run.data["source"] == f"medmnist:{user_folder / 'elsewhere.npz'}"
    assert run.pretrained == str(user_folder / "server-only.pt")


def test_site_data_keeps_no_path_in_the_job(user_folder: Path) -> None:
    run = RunConfig(method="fedavg", data={"source": "site"},
                    task={"num_classes": 2, "in_channels": 1, "image_size": 28})
    run = validated(run, check_files=False)
    assert run.data == {"source": "site"}  # each hospital names its own paths in local/medflare_site.json


def test_an_exported_job_carries_the_absolute_path(user_folder: Path, tmp_path: Path) -> None:
    assert main(["export", "fedavg", "--data", "medmnist:../data/tiny.npz", "-o", str(tmp_path / "jobs")]) == 0
    plan = (tmp_path / "jobs" / "fedavg" / "app" / "config" / PLAN_FILE).read_text()
    assert f"medmnist:{tmp_path / 'data' / 'tiny.npz'}" in plan and "../data" not in plan


def test_the_readme_command_gives_the_sites_an_absolute_path(monkeypatch) -> None:
    readme_file = SHARED_DATA / "medmnist" / "pneumoniamnist.npz"
    if not readme_file.is_file():
        pytest.skip(f"{readme_file} is absent: the README's data lies in ../shared/data beside the repository")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the repository root, where the README's commands run
    run = RunConfig(method="fedprox", data={"source": "medmnist:../shared/data/medmnist/pneumoniamnist.npz"})
    run = validated(run)
    assert run.site_data()["source"] == f"medmnist:{readme_file}"


def test_a_plugin_sources_relative_path_becomes_absolute_and_other_arguments_stay(user_folder: Path) -> None:
    """Issue 48, item 6: a plugin reads its argument at the site, from the site's own folder."""
    from medflare.data.sources import absolute_source

    (user_folder / "lesions").mkdir()
    assert absolute_source("lesions:lesions") == f"lesions:{user_folder / 'lesions'}"
    assert absolute_source("lesions:../data/tiny.npz") == f"lesions:{user_folder.parent / 'data' / 'tiny.npz'}"
    assert absolute_source("lesions:fold=3") == "lesions:fold=3"  # not a file here: the plugin's own argument
    assert absolute_source("lesions:/abs/path") == "lesions:/abs/path"
