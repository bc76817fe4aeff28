"""A hospital's policy over the jobs it runs, in its own ``local/medflare_site.json`` (``"policy": {...}``), and
its audit log.

The executor checks a job's plan against it before it reads an image and declines a refused job with the reason.
The audit log gets one JSON line per job: id, plan fingerprint, method, the decision and its reason, and what left
the site in each task (array bytes, meta keys) and the DP-SGD budget spent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from medflare.config import bounded, check_fields
from medflare.contracts import DP_EPSILON, MAX_SAMPLES
from medflare.errors import ConfigError
from medflare.plan import RunPlan
from medflare.server_setup import DEPLOY_ROBUST
from medflare.site_config import SiteFile

AUDIT_FILE = "medflare_audit.jsonl"  # in the site's local/ folder, unless the policy names another
# what a policy may require of a job, and how the job's plan shows it under the policy's own bounds
REQUIREMENTS: dict[str, Callable[[RunPlan, SitePolicy], bool]] = {
    "dp_sgd": lambda plan, policy: bool(plan.dp_sgd),
    "robust": lambda plan, policy: not policy.robust_shortfall(plan),
    "secure_aggregation": lambda plan, policy: plan.secure_aggregation == "he",
}


@dataclass(frozen=True)
class SitePolicy:
    """What a hospital accepts of a job: its ``methods`` (None: any), what every job must have (:data:`REQUIREMENTS`),
    its audit file (relative to ``local/``), and ``min_class_samples``: a class with fewer samples in what a
    statistic describes is left out of every statistic the site sends (evaluation and per-class counts; 0: none).
    ``require: ["robust"]`` holds for a job whose server combines with a robust rule whose guarantee holds for the
    job's sites, or bounds each site's share at ``robust_max_share`` and rejects updates above
    ``robust_max_norm_ratio`` x the others' median norm (by default the deployment's, 0.6 and 10)."""

    methods: list[str] | None = None
    require: list[str] = field(default_factory=list)
    audit_log: str = AUDIT_FILE
    min_class_samples: int = 0
    robust_max_share: float = bounded(DEPLOY_ROBUST["max_share"], low=0, high=1, low_open=True, high_open=True)
    robust_max_norm_ratio: float = bounded(DEPLOY_ROBUST["max_norm_ratio"], low=0, high=1e6, low_open=True)

    def __post_init__(self) -> None:
        if not 0 <= self.min_class_samples <= MAX_SAMPLES:
            raise ConfigError(f"policy.min_class_samples must be a count in [0, {MAX_SAMPLES}], "
                              f"got {self.min_class_samples}")
        check_fields(self, "policy")  # the robust bounds, where a policy is built directly
        unknown = sorted(set(self.require) - set(REQUIREMENTS))
        if unknown:
            raise ConfigError(f"policy.require names {unknown}; it may require {', '.join(REQUIREMENTS)}")

    def refusal(self, plan: RunPlan) -> str:
        """Why this site declines the job of ``plan`` ("" when it accepts it)."""
        if self.methods is not None and plan.method not in self.methods:
            return f"method '{plan.method}' is not among the methods this site accepts ({', '.join(self.methods)})"
        missing = [name for name in self.require if not REQUIREMENTS[name](plan, self)]
        why = f" ({self.robust_shortfall(plan)})" if "robust" in missing else ""
        return f"the job has no {', '.join(missing)}, which this site requires{why}" if missing else ""

    def robust_shortfall(self, plan: RunPlan) -> str:
        """Why the job's defences are not robust by this site's bounds ("" when they are), for the job's sites."""
        return plan.defences.guarantee_refusal(len(plan.sites), self.robust_max_share, self.robust_max_norm_ratio)


def site_policy(site_file: SiteFile) -> SitePolicy:
    """The ``policy`` object of a site's ``medflare_site.json`` (default: none); ConfigError for a bad field."""
    return site_file.section("policy", SitePolicy)


class AuditLog:
    """A site's audit record of one job, written as one JSON line when the job ends (or is declined)."""

    def __init__(self, path: Path, job_id: str, plan: RunPlan) -> None:
        self.path = path
        self.record: dict[str, Any] = {"job_id": job_id, "plan": plan.digest(), "method": plan.method, "tasks": []}

    def task(self, name: str, round_index: int, arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """What left the site in one task's result."""
        self.record["tasks"].append({
            "task": name, "round": round_index, "meta_keys": sorted(meta),
            "arrays": {key: int(getattr(value, "nbytes", 0)) for key, value in sorted(arrays.items())},
        })
        spent = meta.get(DP_EPSILON)
        if spent is not None:
            self.record["dp_epsilon_spent"] = spent

    def failed(self, name: str, why: str) -> None:
        """A task the site could not do (its data, a crash), so the record says what actually ran."""
        self.record.setdefault("failed", []).append({"task": name, "why": why[:500]})

    def close(self, decision: str, reason: str = "") -> None:
        """Append the job's line: ``decision`` is "accepted" or "declined"."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as log:
            log.write(json.dumps({**self.record, "decision": decision, **({"reason": reason} if reason else {})})
                      + "\n")
