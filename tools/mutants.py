"""Run every method's invariant ledger: apply each mutant in a scratch copy, run only its tests, report killed/survived.

Each method folder keeps ``ledger.toml``: its key invariants, each with the paper or spec line it comes from, one or
more mutants (a file, an exact text that occurs once in it, its replacement) and the tests that must kill them::

    [[invariant]]
    name = "the EMA teacher follows the student every step"
    source = "spec §5(a) step 4; paper Eq. 2"
    tests = ["tests/methods/test_fedlsm.py::test_the_ema_teacher_moves_towards_the_student"]
    seam = "stage schedule"  # optional: the seam class the invariant pins (SEAMS), counted in the report

    [[invariant.mutant]]
    file = "custom/medflare/methods/fedlsm/client.py"
    find = "self.teacher.update(self.model)"
    replace = "pass"

A curated ledger rather than a mutation tool (mutmut, cosmic-ray): those mutate every operator of every line and
report thousands of survivors, most of them equivalent or irrelevant (a log message, a default no test should pin);
the ledger names the few changes that silently turn one method into another, says where each rule comes from, and
keeps the tests that guard it in one reviewed place. ``tests/test_ledgers.py`` keeps every ledger well formed in
the default suite (each mutant's text occurs exactly once, each named test exists), so a ledger cannot rot.

Usage: ``python tools/mutants.py [--method NAME ...] [--invariant TEXT] [--file PATH ...] [--seam CLASS]
[--out runs/mutants]`` (``make mutants``). Exit code 1 when a
mutant survives, or the unmutated tests fail.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
METHODS = ROOT / "custom" / "medflare" / "methods"
LEDGER = "ledger.toml"
KILLED, SURVIVED, ERROR = "killed", "SURVIVED", "error"
# The seams between a method's parts (issue 62), where a test that hands a function its inputs by hand misses what
# the trainer, the data build or the evaluation really passes on; an invariant that pins one names it (``seam``)
SEAMS = ("evaluation aggregation", "data option", "stage schedule", "gradient reach", "architecture", "preset")


@dataclass(frozen=True)
class Mutant:
    """One change that breaks an invariant, and the tests that must notice it."""

    method: str
    invariant: str
    source: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    seam: str = ""  # one of SEAMS, or "" for an invariant of a part alone


def read_ledger(folder: Path) -> list[Mutant]:
    """Every mutant of one method folder's ledger, in file order."""
    content = tomllib.loads((folder / LEDGER).read_text())
    mutants = []
    for invariant in content.get("invariant", []):
        for mutant in invariant.get("mutant", []):
            mutants.append(Mutant(folder.name, invariant["name"], invariant.get("source", ""), mutant["file"],
                                  mutant["find"], mutant["replace"], tuple(mutant.get("tests", invariant["tests"])),
                                  invariant.get("seam", "")))
    return mutants


def ledgers(methods: list[str] | None = None, invariant: str | None = None,
            files: list[str] | None = None, seam: str | None = None) -> dict[str, list[Mutant]]:
    """method folder -> its mutants (every folder under methods/ that has a ledger), only those of invariants whose
    name contains ``invariant``, those that change one of ``files`` (paths from the root) and those of ``seam`` (a
    class of SEAMS) when given."""
    folders = sorted(p.parent for p in METHODS.glob(f"*/{LEDGER}"))
    found = {f.name: [m for m in read_ledger(f) if (not invariant or invariant in m.invariant)
                      and (not files or m.file in files) and (not seam or m.seam == seam)]
             for f in folders if not methods or f.name in methods}
    return {name: mutants for name, mutants in found.items() if mutants}


def scratch_copy(target: Path) -> Path:
    """The working tree's tracked and not-ignored files, copied to ``target`` (mutants never touch the real tree)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    for name in listed:
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def run_tests(tree: Path, tests: tuple[str, ...], timeout: int) -> int:
    """pytest's exit code for ``tests`` in ``tree``, importing medflare from the tree's own copy."""
    env = {**os.environ, "PYTHONPATH": str(tree / "custom") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        return subprocess.run(command, cwd=tree, env=env, capture_output=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return -1


def try_mutant(tree: Path, mutant: Mutant, timeout: int) -> str:
    """Apply ``mutant`` in ``tree``, run its tests, restore the file; killed when the tests fail."""
    path = tree / mutant.file
    original = path.read_text()
    if original.count(mutant.find) != 1:
        return ERROR
    path.write_text(original.replace(mutant.find, mutant.replace))
    try:
        code = run_tests(tree, mutant.tests, timeout)
    finally:
        path.write_text(original)
    return KILLED if code == 1 else SURVIVED if code == 0 else ERROR


def table(rows: list[tuple[Mutant, str, float]]) -> str:
    """The markdown table ``make mutants`` prints and writes."""
    lines = ["| method | invariant | seam | source | mutant (file: replaced text) | tests | result | s |",
             "|---|---|---|---|---|---|---|---|"]
    for mutant, result, seconds in rows:
        text = mutant.find.strip().splitlines()[0][:60].replace("|", "\\|")
        tests = ", ".join(t.split("::")[-1] for t in mutant.tests)
        lines.append(f"| {mutant.method} | {mutant.invariant} | {mutant.seam or '-'} | {mutant.source} | "
                     f"`{Path(mutant.file).name}`: `{text}` | {tests} | {result} | {seconds:.0f} |")
    return "\n".join(lines)


def seam_counts(rows: list[tuple[Mutant, str, float]]) -> str:
    """Killed of run per seam class (and the invariants of one part alone), the table the docs carry."""
    lines = ["| seam class | mutants | killed |", "|---|---|---|"]
    for seam in (*SEAMS, ""):
        picked = [result for mutant, result, _ in rows if mutant.seam == seam]
        if picked:
            lines.append(f"| {seam or 'one part alone'} | {len(picked)} | {picked.count(KILLED)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", action="append", help="only this method folder (repeatable), e.g. fedlsm")
    parser.add_argument("--invariant", help="only the invariants whose name contains this text")
    parser.add_argument("--file", action="append", help="only the mutants of this file (repeatable), e.g. "
                                                        "custom/medflare/plan.py after a change to it")
    parser.add_argument("--seam", choices=SEAMS, help="only the invariants of this seam class")
    parser.add_argument("--out", default=str(ROOT / "runs" / "mutants"), help="where the table is written")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one mutant's tests may take")
    args = parser.parse_args()
    found = ledgers(args.method, args.invariant, args.file, args.seam)
    if not found:
        print("mutants: no ledger found" + (f" for {args.method}" if args.method else ""), file=sys.stderr)
        return 2
    rows: list[tuple[Mutant, str, float]] = []
    with tempfile.TemporaryDirectory(prefix="medflare-mutants-") as scratch:
        tree = scratch_copy(Path(scratch))
        every_test = tuple(sorted({t for mutants in found.values() for m in mutants for t in m.tests}))
        print(f"mutants: {sum(map(len, found.values()))} mutants in {len(found)} ledgers; unmutated tests first",
              flush=True)
        if run_tests(tree, every_test, args.timeout * 4) != 0:
            print("mutants: the ledgers' tests fail without any mutant; fix them first", file=sys.stderr)
            return 1
        for method, mutants in found.items():
            for index, mutant in enumerate(mutants, 1):
                start = time.perf_counter()
                result = try_mutant(tree, mutant, args.timeout)
                rows.append((mutant, result, time.perf_counter() - start))
                print(f"  {method} {index}/{len(mutants)}: {result:8s} {mutant.invariant}", flush=True)
    report = table(rows) + "\n\n" + seam_counts(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutants.md").write_text(report + "\n")
    survived = [r for r in rows if r[1] != KILLED]
    print(report)
    print(f"mutants: {len(rows) - len(survived)} of {len(rows)} killed; table in {out / 'mutants.md'}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
