"""docs/privacy.md's per-method table is generated from the Payloads the code enforces; it must be current."""

import privacy_doc

from medflare.registry import list_methods


def test_privacy_doc_is_up_to_date() -> None:
    text = privacy_doc.DOC.read_text()
    assert privacy_doc.rendered(text) == text, "docs/privacy.md is stale: run 'python tools/privacy_doc.py'"


def test_every_method_has_a_row_naming_its_declared_meta() -> None:
    table = privacy_doc.payload_table()
    for name in list_methods():
        assert f"| `{name}` |" in table
    assert "`rf`" in table.split("| `fedmas` |")[1].split("\n")[0]


def test_the_site_filter_section_is_hand_written_and_names_every_check() -> None:
    """It lies outside the generated block (regeneration keeps it) and names each check PayloadGuard makes."""
    text = privacy_doc.DOC.read_text()
    outside = text.split(privacy_doc.BEGIN)[0] + text.split(privacy_doc.END)[1]
    section = outside.split("## What a site's own filter guarantees\n")[1].split("\n## ")[0]
    for check in ("Names", "Private keys", "Shapes", "Dtypes", "Values", "Meta schema", "Fail closed"):
        assert f"- **{check}.**" in section, check
    assert "What it cannot know:" in section


def test_the_encryption_paragraph_names_every_method_as_its_rule_declares() -> None:
    """docs/privacy.md's per-method HE paragraph: each method in the runs-encrypted list or the refused sentence,
    as its server rule's ``encrypted_aggregation_refusal`` says (fedmd shares mdhfl's rule)."""
    from pathlib import Path

    from medflare.registry import get_method

    text = (Path(__file__).resolve().parents[1] / "docs" / "privacy.md").read_text()
    paragraph = text[text.index("**Per method.** Every method whose aggregate"):].split("\n\n")[0]
    runs, refused = paragraph.split("Refused, from the rule's declared", 1)
    for method in list_methods():
        refusal = get_method(method).server_rule_cls.encrypted_aggregation_refusal
        assert f"`{method}`" in (refused if refusal else runs), (method, bool(refusal))
