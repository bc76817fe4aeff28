"""``medflare new-method``: a bad or taken name is refused in one line before anything is written; in a copy of the
checkout the new method is registered, listed and catalogued, its files lint clean, and (heavy) every test that
reads the registry passes right after."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mutants  # tools/ (tests/conftest.py puts it on the path)
import pytest

from medflare.console import new_method
from medflare.console.new_method import NewMethod, readme_row_added, registry_line_added, table_methods
from medflare.registry import list_methods

from .test_cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
# The name the copies get: demo, or the first free one after it where demo exists (a checkout after
# `medflare new-method demo`, which then runs this suite too)
FRESH = next(name for name in ("demo", *(f"demo{i}" for i in range(2, 100))) if name not in list_methods())
PACKAGE = FRESH.replace("-", "_")
HAS_XDIST = importlib.util.find_spec("xdist") is not None


@pytest.mark.parametrize("name, says", [
    ("Demo", "is not a method name"), ("my_method", "is not a method name"), ("9lives", "is not a method name"),
    ("fed--x", "is not a method name"), ("import", "Python keyword"), ("x" * 25, "at most 24 characters"),
    ("fedavg", "method 'fedavg' exists"), ("local-only", "method 'local-only' exists"),
], ids=str)
def test_an_invalid_or_taken_name_is_refused_in_one_line_and_nothing_is_written(name: str, says: str, capsys,
                                                                               monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(new_method, "ROOT", tmp_path)  # where it would write, were the name accepted

    code, out, err = run_cli(["new-method", name], capsys)

    assert code == 2 and out == "" and says in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_name_whose_folder_exists_is_refused_naming_the_folder(capsys, monkeypatch, tmp_path: Path) -> None:
    mutants.scratch_copy(tmp_path)  # a checkout where ssl_fl/ holds fed-mae and fed-beit, so no method is "ssl-fl"
    monkeypatch.setattr(new_method, "ROOT", tmp_path)

    code, _, err = run_cli(["new-method", "ssl-fl"], capsys)

    assert code == 2 and "custom/medflare/methods/ssl_fl exists" in err and len(err.strip().splitlines()) == 1


def test_outside_a_checkout_it_says_where_to_run_it(capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(new_method, "ROOT", tmp_path)

    code, _, err = run_cli(["new-method", "fed-xyz"], capsys)

    assert code == 2 and "writes into a source checkout" in err and "run it in a clone" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("summary", ['say "hi"', "a | b", "two\nlines", " "], ids=repr)
def test_a_summary_that_would_break_the_spec_or_the_table_is_refused(summary: str, capsys, monkeypatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.setattr(new_method, "ROOT", tmp_path)

    code, _, err = run_cli(["new-method", "fed-xyz", "--summary", summary], capsys)

    assert code == 2 and "--summary" in err and list(tmp_path.iterdir()) == []


def test_the_registry_line_joins_the_import_list_in_sorted_order() -> None:
    text = (ROOT / "custom" / "medflare" / "methods" / "__init__.py").read_text()

    added = registry_line_added(text, "fed_xyz")
    names = re.findall(r"^    (\w+),$", added, re.M)

    assert names == sorted(names) and "fed_xyz" in names and len(names) == len(re.findall(r"^    (\w+),$", text, re.M)) + 1
    assert added.replace("    fed_xyz,\n", "") == text


def test_the_readme_row_ends_the_method_table() -> None:
    readme = (ROOT / "README.md").read_text()

    added = readme_row_added(readme, NewMethod("fed-xyz", "what it is for", "Someone et al. 2026"))

    assert table_methods(added) == [*table_methods(readme), "fed-xyz"]
    assert "| `fed-xyz` | what it is for | Someone et al. 2026 |\n" in added


def test_the_readme_method_table_names_every_registered_method() -> None:
    listed = table_methods((ROOT / "README.md").read_text())

    assert sorted(listed) == list_methods() and len(set(listed)) == len(listed)


def test_the_regenerators_are_the_makefile_targets() -> None:
    """new-method reruns each generator as ``make TARGET`` does, and ``make regenerate`` runs the same ones, so a
    changed Makefile recipe cannot leave it behind."""
    makefile = (ROOT / "Makefile").read_text()
    for target, args in new_method.REGENERATORS:
        recipe = re.search(rf"^{re.escape(target)}: install\n\t(.+)$", makefile, re.M)
        assert recipe, f"Makefile has no '{target}: install' target"
        assert recipe.group(1) == "$(PY) " + " ".join(f'"{a}"' if " " in a else a for a in args)
    deploy = re.search(r"^deploy-artifacts: (.+)$", makefile, re.M).group(1).split()
    assert re.search(r"^regenerate: catalog deploy-artifacts$", makefile, re.M)
    assert ["catalog", *deploy] == [target for target, _ in new_method.REGENERATORS]


@pytest.mark.parametrize("name", ["a", "b-x", "base", "base2", "zeta", "fed-x1"])
def test_the_written_files_lint_clean_whatever_the_name_sorts_like(name: str, tmp_path: Path) -> None:
    """The spec's imports sort around ``medflare.methods.base`` as ruff's isort wants, for names either side of it."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())  # the rules, per folder
    for path, text in NewMethod(name, f"{name}: a summary", "Someone et al. 2026").files(tmp_path).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    done = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=tmp_path, capture_output=True, text=True)

    assert done.returncode == 0, done.stdout + done.stderr


def copy_env(copy: Path) -> dict[str, str]:
    """The environment a developer has in ``copy``: its own medflare first on the path."""
    return {**os.environ, "PYTHONPATH": str(copy / "custom"), "OMP_NUM_THREADS": "1"}


def medflare_in(copy: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "medflare.console.cli", *args], cwd=copy, env=copy_env(copy),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def copy_with_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """A copy of this checkout (tracked and not-ignored files, in a new git repository as a clone would be: the
    mutants tool lists files with git) after ``medflare new-method demo`` ran in it."""
    copy = mutants.scratch_copy(tmp_path_factory.mktemp("checkout"))
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    return copy, medflare_in(copy, "new-method", FRESH)


def test_after_new_method_the_registry_the_listing_and_the_catalog_have_it(copy_with_demo) -> None:
    copy, done = copy_with_demo
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"new method '{FRESH}'" in done.stdout and "client.py    the local training step" in done.stdout

    registered = subprocess.run([sys.executable, "-c", "from medflare.registry import get_method, list_methods; "
                                 f"print(list_methods(), get_method('{FRESH}').trainer_cls.__module__)"],
                                cwd=copy, env=copy_env(copy), capture_output=True, text=True, check=True)
    listed = medflare_in(copy, "methods")
    catalog = json.loads((copy / "custom" / "medflare" / "catalog.jsonc").read_text())

    assert f"'{FRESH}'" in registered.stdout and f"medflare.methods.{PACKAGE}.client" in registered.stdout
    assert re.search(rf"^{FRESH} +{FRESH}: starts as FedAvg", listed.stdout, re.M), listed.stdout
    assert FRESH in [entry["name"] for entry in catalog["methods"]]
    assert FRESH in table_methods((copy / "README.md").read_text())
    assert (copy / "apps" / FRESH).is_dir() and (copy / "job_templates" / FRESH).is_dir()
    assert f"`{FRESH}`" in (copy / "docs" / "privacy.md").read_text()


def test_a_second_new_method_of_the_same_name_is_refused_and_changes_nothing(copy_with_demo) -> None:
    copy, _ = copy_with_demo
    before = (copy / "README.md").read_text(), (copy / "custom" / "medflare" / "methods" / "__init__.py").read_text()

    again = medflare_in(copy, "new-method", FRESH)

    assert again.returncode == 2 and f"method '{FRESH}' exists" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    assert ((copy / "README.md").read_text(), (copy / "custom" / "medflare" / "methods" / "__init__.py").read_text()) \
        == before


def test_the_new_methods_files_lint_clean_in_the_copy(copy_with_demo) -> None:
    copy, _ = copy_with_demo

    done = subprocess.run([sys.executable, "-m", "ruff", "check", "custom", "tests"], cwd=copy, capture_output=True,
                          text=True)

    assert done.returncode == 0, done.stdout[-2000:]


# What reads the registry (grep tests for list_methods, get_method, catalog, apps, templates, policies, privacy,
# README, ledgers): each fails when new-method leaves one of them behind. Of the every-method in-process smoke job
# only the new method's case.
REGISTRY_READERS = [
    f"tests/methods/test_{PACKAGE}.py", "tests/test_catalog.py", "tests/deploy/test_apps.py",
    "tests/deploy/test_templates.py", "tests/deploy/test_template_cards.py", "tests/deploy/test_allow_list.py",
    "tests/deploy/test_provision_and_policies.py", "tests/test_privacy_doc.py", "tests/test_ledgers.py",
    "tests/test_layering.py", "tests/methods/test_registry_contract.py", "tests/methods/test_baselines_wiring.py",
    "tests/methods/test_multi_label_training.py", "tests/test_new_method.py", "tests/test_config.py",
    "tests/test_plan.py", "tests/test_presets.py", "tests/test_dp_sgd.py", "tests/test_recipes.py",
    "tests/test_report.py", "tests/test_run_config_paths.py", "tests/flare/test_trust_cases.py",
    "tests/flare/test_adversarial_site.py", "tests/data/test_data_sources.py", "tests/benchmarks/test_paper.py",
    "tests/integration/test_every_method_inprocess.py::"
    f"test_methods_smoke_job_plays_its_plan_in_process_and_sends_exactly_its_declaration[{FRESH}]",
]


@pytest.mark.slow
@pytest.mark.heavy  # make test-heavy: about 3 minutes on 2 cores
def test_the_tests_that_read_the_registry_pass_right_after_new_method_demo(copy_with_demo) -> None:
    """In a fresh copy of the checkout, after ``medflare new-method demo``, the make-test part of every file in
    :data:`REGISTRY_READERS` passes: the catalog, apps, job templates and their cards, the allow-list, the site
    policies, the privacy doc, the ledgers, the layering, the registry contract and wiring, the README's method and
    multi-label tables, the config/plan/preset/DP/recipe/report checks that loop over every method, this file (with
    the next free name), the new method's own tests and its every-method in-process job. Then the ledger's mutant
    is killed by the test it names (``tools/mutants.py --method demo``)."""
    copy, done = copy_with_demo
    assert done.returncode == 0, done.stderr[-2000:]
    workers = ["-n", "2"] if HAS_XDIST else []

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not heavy",
                            *workers, *REGISTRY_READERS], cwd=copy, env=copy_env(copy), capture_output=True,
                           text=True, timeout=1500)
    assert tests.returncode == 0, tests.stdout[-4000:]

    killed = subprocess.run([sys.executable, "tools/mutants.py", "--method", PACKAGE, "--out", str(copy / "runs")],
                            cwd=copy, env=copy_env(copy), capture_output=True, text=True, timeout=600)
    assert killed.returncode == 0 and "1 of 1 killed" in killed.stdout, killed.stdout[-2000:] + killed.stderr
