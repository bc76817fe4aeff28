"""Every hospital kit gets a commented ``local/medflare_site.json.example`` that the site's own loader accepts once
copied to ``medflare_site.json``; the server's kit gets none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from medflare.config import from_dict
from medflare.console.deploy.policies import flare_defaults
from medflare.console.deploy.provision import (
    COMMENT_PREFIX,
    SITE_CONFIG_EXAMPLE,
    install_policies,
    main,
    site_config_example,
)
from medflare.data import DataConfig, make_site_data
from medflare.distributed import site_distributed_config
from medflare.errors import ConfigError, DataError
from medflare.registry import get_method
from medflare.site_config import SITE_CONFIG_FILE, SITE_ONLY_DATA_KEYS, read_site_data_config, resolve_site_model


def fake_kit(folder: Path, kind: str) -> Path:
    """A kit as ``nvflare provision`` leaves it: ``startup/fed_<kind>.json`` and FLARE's ``local/*.default``."""
    (folder / "startup").mkdir(parents=True)
    (folder / "startup" / f"fed_{kind}.json").write_text("{}")
    (folder / "local").mkdir()
    for name, content in flare_defaults(kind).items():
        (folder / "local" / f"{name}.default").write_text(json.dumps(content))
    return folder


def example_as_site_file(tmp_path: Path, source: str | None = None) -> Path:
    """The example copied to ``local/medflare_site.json``, as hospital IT does, optionally with another source."""
    example = site_config_example()
    if source is not None:
        example["data"]["source"] = source
    local = tmp_path / "local"
    local.mkdir(exist_ok=True)
    (local / SITE_CONFIG_FILE).write_text(json.dumps(example, indent=2))
    return local


def test_provisioning_writes_the_example_into_hospital_kits_only(tmp_path: Path) -> None:
    hospital = fake_kit(tmp_path / "prod_00" / "hospital-a", "client")
    server = fake_kit(tmp_path / "prod_00" / "fl-server", "server")
    written = install_policies(tmp_path / "prod_00")
    example = hospital / "local" / SITE_CONFIG_EXAMPLE
    assert example in written["hospital-a"]
    assert json.loads(example.read_text()) == site_config_example()
    assert not (hospital / "local" / SITE_CONFIG_FILE).exists()  # only the example: the site decides its data
    assert not list((server / "local").glob("medflare_site*"))
    moved = shutil.copytree(hospital, tmp_path / "moved-hospital")
    (moved / "local" / SITE_CONFIG_EXAMPLE).unlink()
    assert main(["--reinstall", str(moved), "--mode", "preinstalled"]) == 0
    assert (moved / "local" / SITE_CONFIG_EXAMPLE).is_file()


def test_the_copied_example_is_a_valid_site_file_for_the_site_loader(tmp_path: Path) -> None:
    local = example_as_site_file(tmp_path)
    data = read_site_data_config(local, {"source": "site", "augment": "basic", "seed": 1})
    assert data["source"] == site_config_example()["data"]["source"] and data["augment"] == "basic"
    from_dict(DataConfig, {**data, "num_classes": 2}, "data")  # every data key is a valid option
    assert site_distributed_config(local).processes == 1
    assert resolve_site_model(get_method("fedavg"), "cnn", None, "site-1", local) == "cnn"


def test_a_site_reads_its_images_through_the_example_once_it_names_them(tmp_path: Path) -> None:
    local = example_as_site_file(tmp_path, source="synthetic:n=60,classes=2,channels=1")
    data = read_site_data_config(local, {"source": "site"})
    site = make_site_data(from_dict(DataConfig, {**data, "num_classes": 2}, "data"), 0, "site-1")
    assert len(site.train) == 60 and site.channels == 1


def test_the_example_refuses_job_data_and_foreign_models_as_its_comments_say(tmp_path: Path) -> None:
    local = example_as_site_file(tmp_path)
    with pytest.raises(DataError, match="refused: the job names its own data"):
        read_site_data_config(local, {"source": "synthetic:n=60"})
    with_model = {**site_config_example(), "model": "resnet18"}
    (local / SITE_CONFIG_FILE).write_text(json.dumps(with_model))
    with pytest.raises(ConfigError, match="every site must train the job's model 'cnn'"):
        resolve_site_model(get_method("fedavg"), "cnn", None, "site-1", local)
    assert resolve_site_model(get_method("local-only"), "cnn", None, "site-1", local) == "resnet18"


def test_every_setting_is_commented_and_the_data_block_sets_only_site_keys() -> None:
    example = site_config_example()
    keys = list(example)
    settings = [key for key in keys if not key.startswith(COMMENT_PREFIX)]
    for key in settings:  # each setting's comment comes right before it
        assert keys[keys.index(key) - 1] == f"{COMMENT_PREFIX}_{key}", key
    assert f"{COMMENT_PREFIX}_model" in example  # the optional key left out is explained too
    # A site's keys win over a job's: the example sets none a job may choose, so copying it changes no job's setting.
    assert set(example["data"]) <= SITE_ONLY_DATA_KEYS
    for key in example["data"]:
        assert f"{key}:" in example[f"{COMMENT_PREFIX}_data"], key


def test_a_poc_sites_kit_gets_the_example_too_and_its_server_none(tmp_path: Path) -> None:
    """Issue 61 (minors): POC kits had no example, so a POC rehearsal of a hospital's set-up had nothing to copy."""
    from medflare.console.deploy.poc import PocSession

    session = PocSession(tmp_path / "poc", echo=lambda line: None)
    with session.hold():
        session.prepare(2, allow_job_data=False)
    for site in session.state["sites"]:
        assert json.loads((session.kit(site) / "local" / SITE_CONFIG_EXAMPLE).read_text()) == site_config_example()
    assert not (session.kit(session.state["server"]) / "local" / SITE_CONFIG_EXAMPLE).exists()
