"""FLARE's known advisories (issue 64): a release below 2.7.2 is refused by name at every place a job starts; another
safe release than the job's is a warning only."""

from __future__ import annotations

import pytest

from medflare import advisories
from medflare.advisories import ADVISORIES, NVFLARE_FLOOR, exported_mismatch, platform_refusal


@pytest.mark.parametrize("version", ["2.7.1", "2.6.0", "2.7.2rc1", "1.0"])
def test_a_release_below_the_floor_is_refused_naming_every_advisory_and_the_fix(version: str) -> None:
    refusal = platform_refusal(version, "the server")
    assert refusal.startswith(f"the server runs nvflare {version}, below 2.7.2")
    assert all(f"{a.cve} ({a.cvss:g})" in refusal for a in ADVISORIES) and "install nvflare>=2.7.2" in refusal
    assert [a.cve for a in ADVISORIES] == ["CVE-2026-24178", "CVE-2026-24186", "CVE-2026-24204"]


@pytest.mark.parametrize("version", [NVFLARE_FLOOR, "2.7.3", "2.9.0", "3.0.0"])
def test_the_floor_and_later_releases_pass(version: str) -> None:
    assert platform_refusal(version, "this site") == ""


@pytest.mark.parametrize("version", ["none", "", "2.x", None, "2.9.0; rm -rf /"])
def test_a_version_that_does_not_read_is_refused_not_passed(version: object) -> None:
    refusal = platform_refusal(version, "the server")
    assert "not a version medflare can check" in refusal and len(refusal) < 300


def test_the_installed_release_is_the_pinned_one_and_safe() -> None:
    assert advisories.installed_nvflare() == "2.9.0" and platform_refusal("2.9.0", "here") == ""


def test_another_safe_release_than_the_jobs_is_a_warning_text_and_the_same_or_unknown_none() -> None:
    assert exported_mismatch("2.9.1", "2.9.0", "this site") == "this site runs nvflare 2.9.1, the job was exported " \
                                                                 "with 2.9.0"
    assert exported_mismatch("2.9.0", "2.9.0", "this site") == "" and exported_mismatch("2.9.0", "", "x") == ""
