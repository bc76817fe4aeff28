"""The server proves its plan: every task carries the fingerprint of the server's plan and the defences it runs
with (:func:`server_proof`); a site compares them with its own copy of the plan and its policy
(:func:`task_refusal`) and declines a task of a server that runs another plan, declares weaker defences than the site
requires, runs a FLARE release with known advisories (:mod:`medflare.advisories`), or proves nothing. The server, in turn, refuses a result whose site runs another plan
(:func:`site_plan_refusal`).

What this catches: an edited or misdeployed server app (FLARE's ``deploy_map`` gives the server another app). What it
cannot: a server that lies about its fingerprint, defences or FLARE release (only attestation or encryption bound
that).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from medflare import contracts
from medflare.advisories import installed_nvflare, platform_refusal
from medflare.errors import ConfigError
from medflare.plan import RunPlan
from medflare.server_setup import RobustConfig
from medflare.site_policy import SitePolicy

MAX_SHOWN = 64  # characters of a value the server sent that a site's log line shows


@dataclass(frozen=True)
class TaskRefusal:
    """Why a site declines a task: ``reason``, a key of :data:`medflare.contracts.DECLINE_REASONS` (what the server
    hears), and ``detail``, the site's own log line (both fingerprints, or the missing defence)."""

    reason: str
    detail: str


def server_proof(plan_digest: str, robust: RobustConfig, min_clients: int, encrypted: bool) -> dict[str, Any]:
    """The task meta that proves the server's plan: its fingerprint, the defences its aggregator runs with and the
    FLARE release it runs on."""
    settings = {name: value for name, value in robust.record().items() if name != "on"}  # the rule's own options
    return {contracts.SERVER_PLAN: plan_digest, contracts.SERVER_NVFLARE: installed_nvflare(),
            contracts.SERVER_DEFENCES: {"robust": settings, "min_clients": int(min_clients),
                                        "secure_aggregation": "he" if encrypted else "off"}}


def declared_plan(site_plan: RunPlan, declared: Mapping[str, Any]) -> RunPlan:
    """The site's plan with the server's declared defences in place of its own, so that the policy's requirements
    (:data:`medflare.site_policy.REQUIREMENTS`) judge what the server runs. ConfigError when they do not read."""
    if not isinstance(declared, Mapping) or set(declared) != {"robust", "min_clients", "secure_aggregation"}:
        raise ConfigError("they must name robust, min_clients and secure_aggregation")
    robust, min_clients, secure = declared["robust"], declared["min_clients"], declared["secure_aggregation"]
    if not isinstance(robust, Mapping) or isinstance(min_clients, bool) or not isinstance(min_clients, int) \
            or secure not in ("off", "he"):
        raise ConfigError("robust must be a mapping, min_clients a whole number, secure_aggregation 'off' or 'he'")
    try:
        return dataclasses.replace(site_plan, robust=dict(robust), min_clients=min_clients, secure_aggregation=secure)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from exc


def task_refusal(site_plan: RunPlan, site_digest: str, policy: SitePolicy,
                 meta: Mapping[str, Any]) -> TaskRefusal | None:
    """Why this site declines a task whose meta is ``meta`` (None: the server proved a plan the site runs too)."""
    server_digest, declared = meta.get(contracts.SERVER_PLAN), meta.get(contracts.SERVER_DEFENCES)
    if not isinstance(server_digest, str) or declared is None:
        return TaskRefusal("server_plan", f"the task carries no server plan fingerprint or defences (this site runs "
                                          f"plan {site_digest}): the server does not prove its plan")
    if server_digest != site_digest:
        return TaskRefusal("server_plan", f"the server runs plan {server_digest[:MAX_SHOWN]!r}, this site's copy of "
                                          f"the job's plan is {site_digest!r}")
    unsafe = platform_refusal(meta.get(contracts.SERVER_NVFLARE, "none"), "the server")
    if unsafe:
        return TaskRefusal("platform", unsafe)
    try:
        as_declared = declared_plan(site_plan, declared)
    except ConfigError as exc:
        return TaskRefusal("server_defences", f"the server's declared defences do not read: {str(exc)[:200]}")
    refusal = policy.refusal(as_declared)
    if refusal:
        return TaskRefusal("server_defences", f"the server runs with {defences_text(as_declared)}: {refusal}")
    return None


def defences_text(plan: RunPlan) -> str:
    """The defences a plan runs with, in one phrase for a log line."""
    robust = plan.defences
    return (f"robust.rule={robust.rule}, max_norm_ratio={robust.max_norm_ratio:g}, max_share={robust.max_share:g}, "
            f"min_clients={plan.min_clients}, secure_aggregation={plan.secure_aggregation}")


def site_plan_refusal(site: str, site_digest: Any, server_digest: str) -> str:
    """Why the server refuses ``site``'s result ("" when the site runs the server's plan)."""
    if site_digest == server_digest:
        return ""
    shown = repr(site_digest[:MAX_SHOWN]) if isinstance(site_digest, str) else "none"
    return f"{site} runs plan {shown}, the server runs plan {server_digest!r}"
