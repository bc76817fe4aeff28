"""Every method keeps an invariant ledger (``methods/<name>/ledger.toml``) that ``make mutants`` can run: this checks
that each one is well formed, so a ledger cannot rot between mutation runs (tools/mutants.py runs them)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from medflare.registry import get_method, list_methods

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import mutants  # noqa: E402  (tools/ is no package)

# every method folder (one per paper or baseline; a folder may register several methods, e.g. fed_mas and bsm-kd)
FOLDERS = sorted(p.parent.name for p in mutants.METHODS.glob("*/__init__.py"))


def test_every_registered_method_lives_in_a_method_folder() -> None:
    homes = {Path(sys.modules[get_method(m).trainer_cls.__module__].__file__).parent.name for m in list_methods()}
    assert homes <= set(FOLDERS)


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_method_folder_keeps_a_ledger(folder: str) -> None:
    path = mutants.METHODS / folder / mutants.LEDGER
    assert path.is_file(), f"methods/{folder} has no {mutants.LEDGER}: a method is not done until its ledger is"
    found = mutants.read_ledger(path.parent)
    assert found, f"{path}: no invariant with a mutant"
    assert all(m.invariant and m.source and m.tests for m in found), f"{path}: every invariant names its source"
    assert {m.seam for m in found} <= {"", *mutants.SEAMS}, f"{path}: a seam must be one of {mutants.SEAMS}"


@pytest.mark.parametrize("mutant", [m for ms in mutants.ledgers().values() for m in ms],
                         ids=lambda m: f"{m.method}:{m.invariant[:40]}")
def test_each_mutant_applies_once_and_names_existing_tests(mutant: mutants.Mutant) -> None:
    text = (ROOT / mutant.file).read_text()
    assert text.count(mutant.find) == 1, f"{mutant.file}: the mutant's text must occur exactly once"
    assert mutant.replace != mutant.find
    for test in mutant.tests:
        file, _, name = test.partition("::")
        assert (ROOT / file).is_file(), f"{test}: no such file"
        function = re.sub(r"\[.*\]$", "", name.split("::")[-1])
        assert re.search(rf"^\s*def {re.escape(function)}\(", (ROOT / file).read_text(), re.M), f"{test}: not found"


def test_an_invariant_filter_keeps_only_the_matching_invariants_and_drops_empty_ledgers() -> None:
    every = mutants.ledgers()
    picked = mutants.ledgers(invariant="token j")
    assert list(picked) == ["ssl_fl"] and len(picked["ssl_fl"]) == 3
    assert all("token j" in m.invariant for m in picked["ssl_fl"]) and len(every["ssl_fl"]) > 3
    assert mutants.ledgers(["fedmd"], invariant="no such invariant") == {}
    plan = mutants.ledgers(files=["custom/medflare/plan.py"])
    assert plan and all(m.file == "custom/medflare/plan.py" for ms in plan.values() for m in ms)


def test_the_report_counts_each_seam_class_and_the_invariants_of_one_part() -> None:
    def mutant(seam: str) -> mutants.Mutant:
        return mutants.Mutant("m", "i", "s", "custom/x.py", "a", "b", ("t",), seam)

    rows = [(mutant("gradient reach"), mutants.KILLED, 1.0), (mutant("gradient reach"), mutants.SURVIVED, 1.0),
            (mutant(""), mutants.KILLED, 1.0)]
    counts = mutants.seam_counts(rows)
    assert "| gradient reach | 2 | 1 |" in counts and "| one part alone | 1 | 1 |" in counts
    assert "preset" not in counts
