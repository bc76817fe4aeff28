"""The FLARE releases with known security holes, and the check of a FLARE version against them.

NVIDIA's security bulletin of April 2026 lists three advisories of NVIDIA FLARE, fixed in nvflare 2.7.2. A FLARE
below that release runs where a job starts (the server's controller, each site's executor, and each site hears the
server's version in every task) and where an admin checks a site (``medflare preflight``): there it is a FAIL, and at
a job's start the participant refuses to run. A FLARE that is safe but not the release the job was exported with is
a WARN only (medflare pins one release; another may still work).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class Advisory:
    """One published advisory: its CVE and CVSS base score."""

    cve: str
    cvss: float


BULLETIN = "NVIDIA security bulletin, April 2026"
ADVISORIES = (Advisory("CVE-2026-24178", 9.8), Advisory("CVE-2026-24186", 8.8), Advisory("CVE-2026-24204", 6.5))
NVFLARE_FLOOR = "2.7.2"  # the first release without ADVISORIES


def installed_nvflare() -> str:
    """The nvflare version installed here ("none" when it is not installed)."""
    try:
        return version("nvflare")
    except PackageNotFoundError:
        return "none"


def advisories_text() -> str:
    """The advisories, each with its CVSS score, for a message."""
    return ", ".join(f"{a.cve} ({a.cvss:g})" for a in ADVISORIES)


def platform_refusal(nvflare: object, who: str) -> str:
    """Why ``who`` (e.g. "this site", "the server") must not run a job on FLARE ``nvflare`` ("" when it may)."""
    try:
        found = Version(str(nvflare))
    except InvalidVersion:
        return f"{who} runs nvflare {str(nvflare)[:40]!r}, which is not a version medflare can check against the " \
               f"known advisories; install nvflare>={NVFLARE_FLOOR}"
    if found < Version(NVFLARE_FLOOR):
        return f"{who} runs nvflare {found}, below {NVFLARE_FLOOR}, the first release without {advisories_text()} " \
               f"({BULLETIN}); install nvflare>={NVFLARE_FLOOR}"
    return ""


def startup_check(who: str, exported: str) -> tuple[str, str]:
    """What ``who`` makes of the FLARE installed here when a job exported with ``exported`` starts: (why it must not
    run, "" when it may; a warning's text, "" when none)."""
    nvflare = installed_nvflare()
    other = exported_mismatch(nvflare, exported, who)
    return platform_refusal(nvflare, who), f"{other}; medflare was tested with the job's" if other else ""


def exported_mismatch(nvflare: str, exported: str, who: str) -> str:
    """A WARN's text when ``who`` runs another FLARE than the job was exported with ("" when the same or unknown)."""
    if not exported or nvflare == exported:
        return ""
    return f"{who} runs nvflare {nvflare}, the job was exported with {exported}"
