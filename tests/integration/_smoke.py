"""Every method's smallest meaningful job and the check of what its sites sent against its declaration, shared by
the every-method runs in-process (``make test``) and in FLARE's simulator (``make test-heavy``); not collected (no
``test_`` prefix).

Each method may give the smallest meaningful settings for its job in ``MethodSpec.smoke`` (a ViT for SSL-FL,
per-site models for a heterogeneous method, multi-label data, ...); they are merged over :data:`DEFAULTS`.
"""

from collections import Counter

from medflare.config import from_dict
from medflare.registry import get_method
from medflare.run_config import RunConfig, merge_sections

DEFAULTS = {
    "rounds": 1,
    "clients": 2,
    "data": {"source": "synthetic:n=300,imbalance=5", "partition": "dirichlet:1.0"},
    "train": {"max_steps": 2, "batch_size": 32},
    "audit": True,
}


def smoke_run(method: str) -> RunConfig:
    """The method's smoke job: one round per stage (SSL-FL's smallest: one pre-training, one fine-tuning round)."""
    settings = merge_sections(DEFAULTS, dict(get_method(method).smoke))
    return from_dict(RunConfig, {**settings, "method": method}, "smoke settings")


def check_audit(records: list[dict], method: str, global_keys: list[str]) -> Counter:
    """Every message at a site (a payload audit's records: a task, then the site's result) against the method's
    declaration; returns the checked results by task name."""
    payload = get_method(method).payload
    task, checked = None, Counter()
    for record in records:
        assert "return_code" not in record, f"{method}: a task failed at the site: {record}"
        sent = set(record["arrays"])
        assert not any(payload.is_private(k) for k in sent), f"{method}: a private key travelled: {record}"
        if record["direction"] == "task":
            task = record
            assert sent <= set(global_keys) | set(payload.receives), f"{method}: server sent undeclared {sent}"
            continue
        phase, stage = record["task"], task["header"].get("stage", "train")
        expected = set(payload.shared_keys(global_keys, stage)) if phase == "train" else set()
        expected |= set(payload.arrays_for(phase))
        assert sent == expected, f"{method} {phase}/{stage}: sent {sorted(sent ^ expected)[:5]} against the declaration"
        assert set(record["meta"]) <= set(payload.allowed_meta()), f"{method}: undeclared meta {record['meta']}"
        checked[phase] += 1
    return checked
