"""The generated part of ``docs/privacy.md``: what each registered method sends, straight from its declaration.

``python tools/privacy_doc.py`` rewrites the block between the markers; a test fails when it is stale, so the
document cannot drift from the Payloads the code enforces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from medflare.registry import get_method, list_methods

DOC = Path(__file__).resolve().parents[1] / "docs" / "privacy.md"
BEGIN = "<!-- BEGIN GENERATED: python tools/privacy_doc.py -->"
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


def rendered(text: str) -> str:
    """``text`` with the generated block replaced by the current table."""
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{payload_table()}\n{END}{tail}"


def main() -> None:
    DOC.write_text(rendered(DOC.read_text()))
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
