"""The digest of a job's code (issue 64): what a site approves, computed from the files themselves."""

from __future__ import annotations

import json
from pathlib import Path

from medflare.console.job_export import job_code_digest
from medflare.job_code import META_KEY, PREINSTALLED, code_digest
from medflare.run_config import RunConfig
from medflare.site_policy import SitePolicy

from ._plans import write_run_job


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    return root


def test_every_change_to_the_code_changes_the_digest_and_caches_do_not(tmp_path: Path) -> None:
    base = {"pkg/__init__.py": b"", "pkg/a.py": b"x = 1\n"}
    digest = code_digest(tree(tmp_path / "base", base))
    assert digest.startswith("sha256:") and len(digest) == 7 + 64
    assert code_digest(tree(tmp_path / "same", base)) == digest  # the path of the folder itself does not count
    variants = {"edited": {**base, "pkg/a.py": b"x = 2\n"}, "added": {**base, "pkg/b.py": b""},
                "renamed": {"pkg/__init__.py": b"", "pkg/c.py": b"x = 1\n"}, "removed": {"pkg/a.py": b"x = 1\n"},
                # the same bytes split otherwise between a name and its content
                "shifted": {"pkg/__init__.py": b"", "pkg/a.p": b"yx = 1\n"}}
    for name, files in variants.items():
        assert code_digest(tree(tmp_path / name, files)) != digest, name
    cached = tree(tmp_path / "cached", {**base, "pkg/__pycache__/a.cpython-312.pyc": b"\0", "pkg/b.pyc": b"\0"})
    assert code_digest(cached) == digest


def test_a_job_without_code_is_the_sites_preinstalled_installation(tmp_path: Path) -> None:
    assert code_digest(tmp_path / "missing") == PREINSTALLED
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert code_digest(tmp_path / "empty") == PREINSTALLED


def test_export_records_the_digest_of_the_code_it_wrote_and_a_preinstalled_job_brings_none(tmp_path: Path) -> None:
    run = RunConfig(method="fedavg", data={"source": "synthetic:n=40"})
    byoc = write_run_job(run, tmp_path / "byoc")
    digest = json.loads((byoc / "meta.json").read_text())[META_KEY]
    assert digest == job_code_digest(byoc) != PREINSTALLED
    again = write_run_job(run, tmp_path / "again")
    assert job_code_digest(again) == digest  # the same medflare exports the same digest
    preinstalled = write_run_job(run, tmp_path / "pre", mode="preinstalled")
    assert json.loads((preinstalled / "meta.json").read_text())[META_KEY] == PREINSTALLED


def test_a_policy_runs_only_the_code_it_approves_and_always_its_own_installation() -> None:
    approved, other = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    assert SitePolicy().code_refusal(other) == ""  # no approved_code: any code
    assert SitePolicy(approved_code=[approved]).code_refusal(approved) == ""
    refusal = SitePolicy(approved_code=[approved]).code_refusal(other)
    assert other in refusal and "not among the code this site approves" in refusal
    assert "only its pre-installed code" in SitePolicy(approved_code=[]).code_refusal(other)
    assert SitePolicy(approved_code=[]).code_refusal(PREINSTALLED) == ""
