"""A hospital's policy over the jobs it runs, in its own ``local/medflare_site.json`` (``"policy": {...}``), and
its audit log.

The executor checks a job's plan against it before it reads an image and declines a refused job with the reason.
The audit log (:class:`AuditLog`, in ``local/``) gets a hash-chained JSON line as each thing happens: the decision on
a job and its reason, what left the site in each task (array names and bytes, meta keys, the DP-SGD ε spent), the
tasks it could not do, and the job's end; :func:`verify_audit` finds the first line that breaks the chain.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from medflare.config import bounded, check_fields
from medflare.contracts import DP_EPSILON, MAX_SAMPLES
from medflare.errors import ConfigError
from medflare.job_code import PREINSTALLED
from medflare.plan import RunPlan
from medflare.server_setup import DEPLOY_ROBUST
from medflare.site_config import SITE_CONFIG_FILE, SiteFile

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
    ``robust_max_norm_ratio`` x the others' median norm (by default the deployment's, 0.6 and 10).
    ``approved_code``: the digests (:func:`medflare.job_code.code_digest`, as ``medflare export`` prints them) of
    the job code this site runs; None: any; [] only its pre-installed code. A job that brings no code always runs
    the site's own installation."""

    methods: list[str] | None = None
    require: list[str] = field(default_factory=list)
    audit_log: str = AUDIT_FILE
    min_class_samples: int = 0
    robust_max_share: float = bounded(DEPLOY_ROBUST["max_share"], low=0, high=1, low_open=True, high_open=True)
    robust_max_norm_ratio: float = bounded(DEPLOY_ROBUST["max_norm_ratio"], low=0, high=1e6, low_open=True)
    approved_code: list[str] | None = bounded(None, items=1000, pattern=r"sha256:[0-9a-f]{64}",
                                              words="a list of code digests sha256:<64 hex digits> (medflare export "
                                                    "prints a job's)")

    def __post_init__(self) -> None:
        if not 0 <= self.min_class_samples <= MAX_SAMPLES:
            raise ConfigError(f"policy.min_class_samples must be a count in [0, {MAX_SAMPLES}], "
                              f"got {self.min_class_samples}")
        check_fields(self, "policy")  # the robust bounds, where a policy is built directly
        unknown = sorted(set(self.require) - set(REQUIREMENTS))
        if unknown:
            raise ConfigError(f"policy.require names {unknown}; it may require {', '.join(REQUIREMENTS)}")

    def refusal(self, plan: RunPlan) -> str:
        """Why this site declines the job of ``plan`` ("" when it accepts it): every reason, "; "-joined, so that a
        job's author fixes them all in one go."""
        reasons = []
        if self.methods is not None and plan.method not in self.methods:
            reasons.append(f"method '{plan.method}' is not among the methods this site accepts "
                           f"({', '.join(self.methods)})")
        missing = [name for name in self.require if not REQUIREMENTS[name](plan, self)]
        why = f" ({self.robust_shortfall(plan)})" if "robust" in missing else ""
        if missing:
            reasons.append(f"the job has no {', '.join(missing)}, which this site requires{why}")
        return "; ".join(reasons)

    def code_refusal(self, digest: str) -> str:
        """Why this site declines a job whose code has ``digest`` ("" when it runs it)."""
        if digest == PREINSTALLED or self.approved_code is None or digest in self.approved_code:
            return ""
        allowed = "only its pre-installed code" if not self.approved_code else \
            f"{len(self.approved_code)} approved digest(s)"
        return f"the job brings code {digest}, which is not among the code this site approves ({allowed}; " \
               "policy.approved_code)"

    def robust_shortfall(self, plan: RunPlan) -> str:
        """Why the job's defences are not robust by this site's bounds ("" when they are), for the job's sites."""
        return plan.defences.guarantee_refusal(len(plan.sites), self.robust_max_share, self.robust_max_norm_ratio)


def site_policy(site_file: SiteFile) -> SitePolicy:
    """The ``policy`` object of a site's ``medflare_site.json`` (default: none); ConfigError for a bad field."""
    return site_file.section("policy", SitePolicy)


AUDIT_GENESIS = "0" * 64  # the "prev" of an audit log's first line: no line comes before it


def audit_file(local: Path, name: str) -> Path:
    """The audit log ``name`` (a policy's ``audit_log``) inside the site's ``local`` folder, resolved; ConfigError for
    a name that leads out of it (an absolute path, ``..``, or a symlink), so a job's audit stays at the site."""
    folder = local.resolve()
    path = (folder / name).resolve()
    if Path(name).is_absolute() or ".." in Path(name).parts or path == folder or not path.is_relative_to(folder):
        raise ConfigError(f"policy.audit_log '{name}' is not a file inside the site's {local} folder (an absolute "
                          f"path, '..' or a symlink leads out of it); name a file there, e.g. \"{AUDIT_FILE}\", in "
                          f"its {SITE_CONFIG_FILE}")
    return path


def line_hash(line: bytes) -> str:
    """What the next audit line carries as ``prev``: the sha256 of this line's bytes (without its newline)."""
    return hashlib.sha256(line).hexdigest()


class AuditLog:
    """A site's audit record of one job, appended to its audit log as it happens: one JSON line when the job is
    accepted or declined, one per task (what left the site, its bytes, the DP-SGD ε spent so far), one per task it
    could not do, one when the job ends. Each line is flushed to disk (fsync) before the site goes on, so a killed
    job leaves every line up to its kill, and carries ``prev``, the hash of the line before it (:func:`line_hash`;
    the first line :data:`AUDIT_GENESIS`), so :func:`verify_audit` finds an edited, inserted or removed line."""

    def __init__(self, path: Path, job_id: str, plan: RunPlan) -> None:
        self.path = path
        self.job = {"job_id": job_id, "plan": plan.digest(), "method": plan.method}
        self.tasks, self.failures, self.bytes = 0, 0, 0
        self.epsilon: Any = None  # the DP-SGD ε the site last reported spent in this job (None: no DP-SGD)

    def decided(self, decision: str, reason: str = "") -> None:
        """The site's decision on the job: ``decision`` is "accepted" or "declined" (with its ``reason``)."""
        self._append({"event": "decision", "decision": decision, **({"reason": reason} if reason else {})})

    def task(self, name: str, round_index: int, arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """What left the site in one task's result: array names and bytes, meta keys, and ε when DP-SGD trains."""
        sizes = {key: int(getattr(value, "nbytes", 0)) for key, value in sorted(arrays.items())}
        self.tasks, self.bytes = self.tasks + 1, self.bytes + sum(sizes.values())
        spent = _as_number(meta[DP_EPSILON]) if DP_EPSILON in meta else None
        self.epsilon = self.epsilon if spent is None else spent
        self._append({"event": "task", "task": name, "round": round_index, "arrays": sizes, "array_count": len(sizes),
                      "bytes": sum(sizes.values()), "meta_keys": sorted(meta),
                      **({DP_EPSILON: spent} if spent is not None else {})})

    def failed(self, name: str, why: str) -> None:
        """A task the site could not do or declined (its data, a crash, another server plan)."""
        self.failures += 1
        self._append({"event": "failed", "task": name, "why": why[:500]})

    def close(self) -> None:
        """The job's end: how many tasks left results, their bytes, and the ε the job spent."""
        self._append({"event": "end", "tasks": self.tasks, "failed": self.failures, "bytes": self.bytes,
                      **({"dp_epsilon_spent": self.epsilon} if self.epsilon is not None else {})})

    def _append(self, event: dict[str, Any]) -> None:
        """One line after the log's last one, chained to it, on disk before this returns. The log is locked while
        its last line is read and the new one written: another job at this site may append at the same time."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            last, complete = _last_line(fd)
            record = {**self.job, "at": _utc_now(), **event, "prev": AUDIT_GENESIS if last is None else line_hash(last)}
            line = json.dumps(record, default=str).encode() + b"\n"
            os.write(fd, line if complete else b"\n" + line)  # a torn last line stays a line of its own
            os.fsync(fd)
        finally:
            os.close(fd)


def _as_number(value: Any) -> Any:
    """A real number (numpy's too) as a JSON number; anything else as it is, for the verifier to flag."""
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else value


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _last_line(fd: int, chunk: int = 4096) -> tuple[bytes | None, bool]:
    """The last line of the open file ``fd`` (None: the file is empty) and whether a newline ends it, read from
    the end, so a long log costs no more than a short one."""
    end = os.lseek(fd, 0, os.SEEK_END)
    if end == 0:
        return None, True
    tail, stop = b"", end
    while True:
        start = max(0, stop - chunk)
        os.lseek(fd, start, os.SEEK_SET)
        tail = os.read(fd, stop - start) + tail
        complete = tail.endswith(b"\n")
        body = tail[:-1] if complete else tail
        cut = body.rfind(b"\n")
        if cut >= 0 or start == 0:
            return body[cut + 1:], complete
        stop = start


@dataclass(frozen=True)
class AuditChain:
    """An audit log as :func:`verify_audit` read it: its records up to the first broken line, that line's number
    (1-based; None: every line holds) and why, and the hash the next line would carry (keep a copy of it
    elsewhere: only that shows a removed last line or an edited last line)."""

    records: list[dict[str, Any]]
    broken: int | None = None
    why: str = ""
    head: str = AUDIT_GENESIS


def verify_audit(data: bytes) -> AuditChain:
    """The chain of an audit log's bytes: each line a JSON object whose ``prev`` is the hash of the line before."""
    lines = data.split(b"\n")
    if data.endswith(b"\n") or not data:
        lines.pop()
    records: list[dict[str, Any]] = []
    head = AUDIT_GENESIS
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return AuditChain(records, number, "is not JSON", head)
        if not isinstance(record, dict):
            return AuditChain(records, number, f"is a JSON {type(record).__name__}, not an object", head)
        if record.get("prev") != head:
            before = f"the hash of line {number - 1}" if number > 1 else f"the first line's prev ({AUDIT_GENESIS[:8]}...)"
            return AuditChain(records, number, f"does not carry {before}: that line or this one was edited, a line "
                                               "was inserted or removed there, or medflare did not write it", head)
        records.append(record)
        head = line_hash(line)
    return AuditChain(records, head=head)
