"""docs/privacy.md's per-method table is generated from the Payloads the code enforces; it must be current."""

from medflare import privacy_doc
from medflare.registry import list_methods


def test_privacy_doc_is_up_to_date() -> None:
    text = privacy_doc.DOC.read_text()
    assert privacy_doc.rendered(text) == text, "docs/privacy.md is stale: run 'python -m medflare.privacy_doc'"


def test_every_method_has_a_row_naming_its_declared_meta() -> None:
    table = privacy_doc.payload_table()
    for name in list_methods():
        assert f"| `{name}` |" in table
    assert "`rf`" in table.split("| `fedmas` |")[1].split("\n")[0]
