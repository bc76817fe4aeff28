"""Build the site wheel (issue 64): medflare's job package without its console, for sites that pre-install medflare.

    python tools/site_wheel.py OUT_DIR      # make site-wheel

The job package is staged in a temporary folder exactly as a BYOC job ships it (``copy_job_package``), beside
packaging/site/pyproject.toml, and built there with ``pip wheel --no-deps --no-build-isolation``: nothing is installed
and nothing is written into the checkout. Prints the wheel's path.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from medflare.console.job_export import copy_job_package

PROJECT = Path(__file__).resolve().parents[1] / "packaging" / "site" / "pyproject.toml"


def build_site_wheel(out_dir: Path) -> Path:
    """The site wheel, built into ``out_dir`` (created); returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="medflare-site-") as staging:
        shutil.copy(PROJECT, Path(staging) / "pyproject.toml")
        copy_job_package(Path(staging) / "medflare")
        before = set(out_dir.glob("medflare_site-*.whl"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                        "-w", str(out_dir), staging], check=True)
    built = sorted(set(out_dir.glob("medflare_site-*.whl")) - before) or sorted(out_dir.glob("medflare_site-*.whl"))
    return built[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    print(build_site_wheel(parser.parse_args(argv).out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
