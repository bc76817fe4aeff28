"""The digest of the code a job brings (BYOC: its ``app/custom`` folder), by which a site approves it.

``medflare export`` prints the digest of the job it wrote and records it in the job's ``meta.json`` for reviewers;
a site computes it again from the files FLARE deployed (never trusting the recorded one) and runs the job only when
its policy approves that digest (``policy.approved_code`` in ``local/medflare_site.json``). A job without custom code
runs the code the site's administrators installed (:data:`PREINSTALLED`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

PREINSTALLED = "preinstalled"  # the digest of a job that brings no code: it runs what the site installed
DIGEST_PREFIX = "sha256:"
META_KEY = "medflare_code"  # meta.json: the digest export computed (FLARE keeps unknown meta keys and ignores them)


def _skipped(path: Path) -> bool:
    """Interpreter caches, which Python writes beside the code it imports (not code the job brought)."""
    return "__pycache__" in path.parts or path.suffix == ".pyc"


def code_digest(custom_dir: str | Path) -> str:
    """``sha256:<hex>`` over every file under ``custom_dir`` in path order: its path relative to the folder, then its
    length and bytes, so a renamed, added, removed or edited file changes it; :data:`PREINSTALLED` when the folder is
    missing or holds no file. A symlink is hashed as its target's bytes, as Python would import them."""
    root = Path(custom_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not _skipped(p.relative_to(root))) \
        if root.is_dir() else []
    if not files:
        return PREINSTALLED
    digest = hashlib.sha256()
    for path in files:
        content = path.read_bytes()
        name = path.relative_to(root).as_posix().encode()
        digest.update(len(name).to_bytes(8, "big") + name + len(content).to_bytes(8, "big") + content)
    return DIGEST_PREFIX + digest.hexdigest()
