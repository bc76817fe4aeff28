"""The generated parts of ``docs/privacy.md``: what each registered method sends, straight from its declaration, and
which methods aggregate encrypted, straight from their server rules.

``python tools/privacy_doc.py`` rewrites each block between its markers; a test fails when one is stale, so the
document cannot drift from the Payloads and rules the code enforces, and a new method needs no hand edit.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from medflare.ops.he_aggregate import encryption_refusal
from medflare.registry import get_method, list_methods

DOC = Path(__file__).resolve().parents[1] / "docs" / "privacy.md"
BEGIN = "<!-- BEGIN GENERATED: python tools/privacy_doc.py -->"
ENCRYPTION_BEGIN = "<!-- BEGIN GENERATED: python tools/privacy_doc.py (encryption) -->"
END = "<!-- END GENERATED -->"


def payload_table() -> str:
    """One markdown row per method: weights, what never leaves, extra arrays and meta, what the server sends."""
    rows = [
        "| method | weights sent | never leaves the site | extra arrays sent | extra meta sent | server sends besides weights | what the extras reveal | with `dp_sgd` |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in list_methods():
        spec = get_method(name)
        payload = spec.payload
        weights = "yes" if payload.sends_weights else "no (the server holds no model)" if not spec.server_model else "no"
        staged = "; ".join(f"in stage {stage}: `{regex}`" for stage, regex in payload.stage_excluded_keys.items())
        kept = ", ".join(filter(None, [f"`{payload.private_keys}`" if payload.private_keys else "", staged])) or "-"
        arrays = ", ".join(
            f"`{n}` {list(a.shape)} {'/'.join(a.dtypes)} (task `{a.phase}`)" for n, a in payload.arrays.items()
        ) or "-"
        meta = ", ".join(f"`{key}`" for key in sorted(payload.meta)) or "-"
        receives = ", ".join(f"`{key}`" for key in payload.receives) or "-"
        rows.append(f"| `{name}` | {weights} | {kept} | {arrays} | {meta} | {receives} | {spec.reveals} | {dp_cell(spec)} |")
    return "\n".join(rows)


def dp_cell(spec: Any) -> str:
    """What a site's DP-SGD ε covers for this method: refused (with the reason), or what it leaves out beyond the
    common meta (``MethodSpec.dp_sgd_blocker`` / ``dp_sgd_uncovered``)."""
    if spec.dp_sgd_blocker:
        return f"refused: {spec.dp_sgd_blocker}"
    return f"ε covers the weights; not covered: {spec.dp_sgd_uncovered}" if spec.dp_sgd_uncovered else \
        "ε covers the weights"


def encryption_paragraph() -> str:
    """The encrypted-aggregation section's "Per method" paragraph: the methods whose rule declares no refusal, then
    the refused ones grouped by their rule's reason (``he_aggregate.encryption_refusal``, as a job is refused)."""
    runs: list[str] = []
    refused: dict[str, list[str]] = {}
    for name in list_methods():
        refusal = encryption_refusal(get_method(name))
        if refusal:
            refused.setdefault(refusal.partition("cannot aggregate encrypted: ")[2], []).append(name)
        else:
            runs.append(name)
    groups = "; ".join(f"for {' and '.join(f'`{n}`' for n in names)}, {reason}" for reason, names in refused.items())
    text = (f"**Per method.** Every method whose aggregate is the server's weighted sum of the sites' models runs "
            f"encrypted: {', '.join(f'`{n}`' for n in runs)}. Refused, from the rule's declared "
            f"`encrypted_aggregation_refusal`: {groups or 'none'}.")
    return textwrap.fill(text, width=118, break_long_words=False, break_on_hyphens=False)


BLOCKS = ((BEGIN, payload_table), (ENCRYPTION_BEGIN, encryption_paragraph))  # marker -> its content, in file order


def rendered(text: str) -> str:
    """``text`` with every generated block replaced by its current content."""
    for begin, content in BLOCKS:
        head, found, rest = text.partition(begin)
        if not found:
            raise ValueError(f"{DOC} lacks the marker {begin}: put it back above its block")
        _, _, tail = rest.partition(END)
        text = f"{head}{begin}\n{content()}\n{END}{tail}"
    return text


def main() -> None:
    DOC.write_text(rendered(DOC.read_text()))
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
