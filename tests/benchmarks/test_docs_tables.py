"""benchmarks/docs_tables.py: a benchmark's latest results replace its block of docs/benchmarks.md, nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import load_benchmark

docs_tables = load_benchmark("docs_tables")

PAGE = """# Benchmarks

## Framework cost

<!-- results: bench-overhead -->
old table
<!-- /results: bench-overhead -->

Reading, written by hand.

<!-- results: bench-peer -->
peer table
<!-- /results: bench-peer -->
"""


def test_a_block_is_replaced_and_the_rest_of_the_page_kept(tmp_path: Path) -> None:
    docs, results = tmp_path / "benchmarks.md", tmp_path / "results.md"
    docs.write_text(PAGE)
    results.write_text("# Framework cost: title\n\n## 2 sites\n\n| a |\n|---|\n| 1 |\n\n- ratio: **missed** by 0.1\n")
    docs_tables.main(["bench-overhead", str(results), "--command", "make bench-overhead", "--docs", str(docs)])
    page = docs.read_text()
    block = page.split("<!-- results: bench-overhead -->")[1].split("<!-- /results: bench-overhead -->")[0]
    assert "old table" not in page and "Framework cost: title" not in block
    assert "`make bench-overhead`" in block and "### 2 sites" in block and "**missed** by 0.1" in block
    assert "Reading, written by hand." in page and "peer table" in page  # the other block and the prose stay
    docs_tables.main(["bench-overhead", str(results), "--command", "make bench-overhead", "--docs", str(docs)])
    assert docs.read_text() == page  # a second run of the same results changes nothing


def test_a_page_without_the_block_or_missing_results_stop_with_one_line(tmp_path: Path) -> None:
    docs, results = tmp_path / "benchmarks.md", tmp_path / "results.md"
    docs.write_text(PAGE)
    results.write_text("| a |\n")
    with pytest.raises(SystemExit, match="no block 'bench-scaling'"):
        docs_tables.main(["bench-scaling", str(results), "--command", "x", "--docs", str(docs)])
    with pytest.raises(SystemExit, match="no results at"):
        docs_tables.main(["bench-peer", str(tmp_path / "none.md"), "--command", "x", "--docs", str(docs)])
    assert docs.read_text() == PAGE
