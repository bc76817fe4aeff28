"""The site wheel (issue 64): medflare's job package alone, built by ``make site-wheel`` (tools/site_wheel.py from
packaging/site/pyproject.toml), carries the components a job names and no console module."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
# what FLARE starts by class path in a medflare job (config_fed_*.json, a site's privacy.json) and what it builds on
COMPONENT_FILES = ("medflare/flare/executor.py", "medflare/flare/controller.py", "medflare/flare/aggregator.py",
                   "medflare/flare/persistor.py", "medflare/flare/privacy.py", "medflare/flare/he.py",
                   "medflare/flare/audit.py", "medflare/deploy/filters.py", "medflare/flare/mlflow_receiver.py",
                   "medflare/flare/tb_receiver.py", "medflare/site_runtime.py", "medflare/methods/fedavg/client.py",
                   "medflare/catalog.jsonc")


def test_the_site_wheel_asks_for_what_the_package_asks_for() -> None:
    """One dependency list in two files: the site wheel's requirements are the root project's."""
    root = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    site = tomllib.loads((REPO / "packaging" / "site" / "pyproject.toml").read_text())["project"]["dependencies"]
    assert site == root


@pytest.mark.slow
@pytest.mark.heavy
def test_the_site_wheel_holds_the_job_package_and_no_console_file(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "tools" / "site_wheel.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO / "custom")})
    assert done.returncode == 0, done.stderr
    wheel = Path(done.stdout.split()[-1])
    names = set(zipfile.ZipFile(wheel).namelist())
    assert wheel.parent == tmp_path and wheel.name.startswith("medflare_site-")
    assert [name for name in names if name.startswith("medflare/console")] == []
    assert set(COMPONENT_FILES) <= names
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in names)
    assert sorted(path.name for path in REPO.glob("custom/*.egg-info")) == []  # nothing written into the checkout
