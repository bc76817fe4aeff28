"""Loaded at start-up by every Python process of a test's FLARE simulator (this folder is first on PYTHONPATH): the
process sees medflare's job package only (issue 64). Any ``medflare`` on sys.path outside $MEDFLARE_JOB_ONLY_ROOT
(the checkout, the venv's editable install) is taken off, so medflare comes from the job's own app/custom; importing
``medflare.console`` raises ImportError. Each process appends what it did to $MEDFLARE_JOB_ONLY_LOG, one JSON line:
it started (its argv), it found medflare (where), it refused a console import (which)."""

import importlib.abc
import importlib.machinery
import json
import os
import sys

ROOT = os.path.realpath(os.environ["MEDFLARE_JOB_ONLY_ROOT"])
LOG = os.environ["MEDFLARE_JOB_ONLY_LOG"]


def record(**event) -> None:
    with open(LOG, "a") as log:
        log.write(json.dumps({"pid": os.getpid(), **event}) + "\n")


def outside_the_job(entry: str) -> bool:
    folder = os.path.realpath(entry or os.getcwd())
    inside = folder == ROOT or folder.startswith(ROOT + os.sep)
    return not inside and os.path.isfile(os.path.join(folder, "medflare", "__init__.py"))


class JobPackageOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "medflare.console" or name.startswith("medflare.console."):
            record(refused=name)
            raise ImportError(f"{name}: a job's processes have medflare's job package only (issue 64)")
        if name == "medflare":
            sys.path[:] = [entry for entry in sys.path if not outside_the_job(entry)]  # FLARE adds paths later
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            record(medflare=spec.origin if spec else None)
            return spec
        return None


sys.path[:] = [entry for entry in sys.path if not outside_the_job(entry)]
sys.meta_path.insert(0, JobPackageOnly())
record(argv=sys.argv)
