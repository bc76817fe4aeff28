"""``medflare new-method NAME``: a new method in a source checkout, ready to edit, with the suite green right after.

It writes the method folder (``__init__.py`` with the spec and what travels, ``client.py`` with the local step,
``server.py`` with the aggregation, ``ledger.toml`` with one invariant and its mutant, the ``README.md`` card), the
registry line in ``methods/__init__.py``, ``tests/methods/test_<name>.py`` (the test that kills the mutant) and a
row of README.md's method table, then reruns every generator that reads the registry, each as its Makefile target
runs it (:data:`REGENERATORS`). Until edited the method trains as FedAvg does. The walk, timed:
docs/architecture.md, "Adding a method".
"""

from __future__ import annotations

import argparse
import keyword
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Callable

from medflare.errors import ConfigError, MedflareError

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # custom/medflare of the checkout this medflare runs from
ROOT = PACKAGE_DIR.parents[1]
NAME_RULE = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")
NAME_HELP = "lowercase letters and digits, words joined by single hyphens, starting with a letter (e.g. fed-xyz)"
MAX_NAME = 24  # `medflare methods` aligns names; longer ones push every summary out of line
METHOD_TABLE_HEADER = "| name | for | paper |"  # README.md's table of methods
# Every file the registry feeds, rewritten as its Makefile target does (``$(PY) ARGS``; `make regenerate` runs them
# all, and a test compares them with the Makefile): the catalog first, as the others read default models from it.
REGENERATORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("catalog", ("-m", "medflare.catalog")),
    ("apps", ("-m", "medflare.console.deploy.apps")),
    ("templates", ("tools/job_templates.py",)),
    ("policies", ("-c", "from medflare.console.deploy.policies import write_policy_templates as w; w()")),
    ("privacy-doc", ("tools/privacy_doc.py",)),
)
DEFAULT_SUMMARY = "{name}: starts as FedAvg (cross-entropy locally, sample-count-weighted average)"
DEFAULT_REFERENCE = "none named yet (it starts as FedAvg: McMahan et al. 2017)"  # every spec names one (tests)


@dataclass(frozen=True)
class NewMethod:
    """The names one method is written under: registry name, Python package, class prefix, and its one-liners."""

    name: str  # registry key and command-line name, e.g. fed-xyz
    summary: str  # `medflare methods`, the catalog, README's table, the card
    reference: str  # the paper it follows

    @property
    def package(self) -> str:
        """The method folder and module name (fed-xyz -> fed_xyz)."""
        return self.name.replace("-", "_")

    @property
    def title(self) -> str:
        """The class-name prefix (fed-xyz -> FedXyz)."""
        return "".join(part.capitalize() for part in self.name.split("-"))

    def spec_imports(self) -> str:
        """The ``__init__.py`` imports of medflare's modules, in the order ruff's isort keeps (by module name)."""
        imports = {"medflare.contracts": "Payload", f"medflare.methods.{self.package}.client": f"{self.title}Trainer",
                   f"medflare.methods.{self.package}.server": f"{self.title}Rule",
                   "medflare.methods.base": "MethodSpec, builtin_method"}
        return "\n".join(f"from {module} import {names}" for module, names in sorted(imports.items()))

    def files(self, root: Path) -> dict[Path, str]:
        """Every new file of the method, by path under ``root``, filled in."""
        values = {"name": self.name, "package": self.package, "title": self.title, "summary": self.summary,
                  "reference": self.reference, "imports": self.spec_imports()}
        folder = root / "custom" / "medflare" / "methods" / self.package
        targets = {folder / "__init__.py": INIT, folder / "client.py": CLIENT, folder / "server.py": SERVER,
                   folder / "ledger.toml": LEDGER, folder / "README.md": CARD,
                   root / "tests" / "methods" / f"test_{self.package}.py": TEST}
        return {path: Template(text).substitute(values) for path, text in targets.items()}


def check_name(name: str) -> None:
    """ConfigError, one line, unless ``name`` is a valid method name that no registered method has."""
    from medflare.registry import list_methods

    if not NAME_RULE.fullmatch(name) or len(name) > MAX_NAME or keyword.iskeyword(name.replace("-", "_")):
        raise ConfigError(f"'{name}' is not a method name: use {NAME_HELP}, at most {MAX_NAME} characters, "
                          "not a Python keyword")
    if name in list_methods(plugins=True):
        raise ConfigError(f"method '{name}' exists ('medflare methods' lists it): choose another name, or edit "
                          "its folder under custom/medflare/methods/")


def check_free(method: NewMethod, root: Path) -> None:
    """ConfigError, one line, when a file or folder ``method`` would write exists under ``root`` already."""
    methods_dir = root / "custom" / "medflare" / "methods"
    own = [methods_dir / method.package, methods_dir / f"{method.package}.py", *method.files(root)]
    taken = next((path for path in own if path.exists()), None)
    if taken is not None:
        raise ConfigError(f"{taken.relative_to(root)} exists: a method '{method.name}' would overwrite it; choose "
                          "another name")


FORBIDDEN_IN_TEXT = '"\\|\n\r'  # would break __init__.py's string literal or README's table row


def check_text(option: str, text: str) -> None:
    """ConfigError unless ``text`` fits one line of __init__.py's string, README's table and the card."""
    if not text.strip() or set(text) & set(FORBIDDEN_IN_TEXT):
        raise ConfigError(f"--{option} {text!r} must be one non-empty line without \\, \" or |: it goes into "
                          "__init__.py's string and README.md's method table")


def check_checkout(root: Path = ROOT) -> None:
    """ConfigError unless this medflare runs from a source checkout (the generators and docs live beside it)."""
    needed = [root / "Makefile", root / "README.md", root / "tests" / "methods",
              root / "custom" / "medflare" / "methods" / "__init__.py",
              *(root / args[0] for _, args in REGENERATORS if args[0].endswith(".py"))]
    missing = next((path for path in needed if not path.exists()), None)
    if missing is not None:
        raise ConfigError(f"medflare new-method writes into a source checkout, but {missing} is missing (this "
                          f"medflare runs from {PACKAGE_DIR}): run it in a clone, with PYTHONPATH=custom or after "
                          "'make install'")


def registry_line_added(init_text: str, package: str) -> str:
    """``methods/__init__.py`` with ``package`` in its import list, the list kept sorted."""
    found = re.search(r"(from medflare\.methods import \(  # noqa: F401\n)((?:    \w+,\n)+)(\))", init_text)
    if found is None:
        raise ConfigError("custom/medflare/methods/__init__.py has no 'from medflare.methods import (' list: add "
                          f"'    {package},' to its imports by hand")
    names = sorted({*re.findall(r"    (\w+),\n", found.group(2)), package})
    lines = "".join(f"    {name},\n" for name in names)
    return init_text[:found.start(2)] + lines + init_text[found.end(2):]


def method_table_rows(lines: list[str]) -> range:
    """The indexes of README.md's method-table rows (below its header and rule); ConfigError without the table."""
    header = next((i for i, line in enumerate(lines) if line.startswith(METHOD_TABLE_HEADER)), None)
    if header is None:
        raise ConfigError(f"README.md has no method table (a line '{METHOD_TABLE_HEADER}'): add the new method's "
                          "row by hand")
    end = next((i for i in range(header, len(lines)) if not lines[i].startswith("|")), len(lines))
    return range(header + 2, end)


def readme_row_added(readme: str, method: NewMethod) -> str:
    """README.md with ``method``'s row appended to the method table."""
    lines = readme.splitlines(keepends=True)
    end = method_table_rows(lines).stop
    return "".join([*lines[:end], f"| `{method.name}` | {method.summary} | {method.reference} |\n", *lines[end:]])


def table_methods(readme: str) -> list[str]:
    """The method names README.md's method table lists, in its order."""
    lines = readme.splitlines()
    return [lines[i].split("`")[1] for i in method_table_rows(lines)]


def regenerate(root: Path = ROOT, log: Callable[[str], None] = print) -> None:
    """Rerun :data:`REGENERATORS` with this interpreter, importing the checkout's own medflare: the catalog, then
    the others side by side (they write disjoint files); MedflareError naming the targets to rerun when one fails
    (the method's files stay written)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root / "custom"),
                                                                      os.environ.get("PYTHONPATH")]))}
    first, *rest = REGENERATORS
    for batch in ([first], rest):
        start = time.perf_counter()
        running = [(target, subprocess.Popen([sys.executable, *args], cwd=root, env=env, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.PIPE, text=True)) for target, args in batch]
        outcomes = [(target, process.communicate()[1], process.returncode) for target, process in running]
        failed = [(target, err) for target, err, code in outcomes if code]
        if failed:
            last = (failed[0][1].strip().splitlines() or ["no output"])[-1]
            raise MedflareError(f"regenerating {', '.join(target for target, _ in failed)} failed ({last}); the "
                                f"method's files are written: fix the cause, then run 'make regenerate'")
        log(f"regenerated {', '.join(target for target, _ in batch)} ({time.perf_counter() - start:.1f} s)")


def create_method(method: NewMethod, root: Path = ROOT, log: Callable[[str], None] = print) -> list[Path]:
    """Write ``method``'s files, its registry line and README row, then regenerate what the registry feeds; the
    paths written (regenerated ones aside). Checks everything before writing anything."""
    check_name(method.name)
    check_text("summary", method.summary)
    check_text("reference", method.reference)
    check_checkout(root)
    check_free(method, root)
    init_file, readme_file = root / "custom" / "medflare" / "methods" / "__init__.py", root / "README.md"
    files = {**method.files(root), init_file: registry_line_added(init_file.read_text(), method.package),
             readme_file: readme_row_added(readme_file.read_text(), method)}  # all built before the first write
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        log(f"wrote {path.relative_to(root)}")
    regenerate(root, log)
    return list(files)


NEXT_STEPS = """
'{name}' trains as FedAvg until you edit it; `make test` passes now. Next, in custom/medflare/methods/{package}/:
  client.py    the local training step: {title}Trainer.compute_loss (and on_round_start for per-round state)
  __init__.py  what travels: Payload (private_keys, arrays, meta); {title}Config's options; summary, reference
  server.py    the aggregation: {title}Rule (site_weight, row_weights, phases: docs/architecture.md, "The hooks")
then change tests/methods/test_{package}.py and ledger.toml to the paper's equations; after a change to the
Payload, the summary or the options, 'make regenerate' (catalog, apps, templates, policies, privacy doc). Check:
python tools/mutants.py --method {package} and make test
"""


def add_new_method_options(parser: argparse.ArgumentParser) -> None:
    """``medflare new-method``'s arguments."""
    parser.add_argument("name", help=f"the method's name on the command line: {NAME_HELP}")
    parser.add_argument("--summary", help="one line for 'medflare methods' and README's table (default: a line "
                                          "saying it starts as FedAvg)")
    parser.add_argument("--reference", default=DEFAULT_REFERENCE, help="the paper it follows, e.g. 'Li et al. 2020' "
                                                                     "(default: none named yet)")


def cmd_new_method(args: argparse.Namespace) -> int:
    """``medflare new-method NAME``: write the method, regenerate, say what to edit next."""
    method = NewMethod(args.name, args.summary or DEFAULT_SUMMARY.format(name=args.name), args.reference)
    start = time.perf_counter()
    create_method(method, ROOT)
    print(f"new method '{method.name}' in {time.perf_counter() - start:.0f} s")
    print(NEXT_STEPS.format(name=method.name, package=method.package, title=method.title).rstrip())
    return 0


# ----- the files of a new method ($name, $package, $title, $summary, $reference, $imports) -------------------

INIT = '''"""$summary

Written by `medflare new-method $name`: it starts as FedAvg (cross-entropy locally, sample-count-weighted average).
"""

from dataclasses import dataclass

$imports


@dataclass
class ${title}Config:
    """$name's options (``--set method.<option>=...``); check each in ``__post_init__`` with ``base.require``."""


SPEC = builtin_method(
    MethodSpec(
        name="$name",
        summary="$summary",
        config_cls=${title}Config,
        trainer_cls=${title}Trainer,
        server_rule_cls=${title}Rule,
        # What travels: every weight and the common meta. Keys that never leave a site: private_keys=r"^head\\.";
        # extra meta or arrays: meta={...}, arrays={...} (docs/architecture.md, "What leaves a site")
        payload=Payload(),
        reference="$reference",
    )
)
'''

CLIENT = '''"""$name's site update: the shared training loop with this method's local step."""

import torch

from medflare.methods.base import LocalTrainer


class ${title}Trainer(LocalTrainer):
    """Cross-entropy over the site's labelled images (BCE over known entries for multi-label tasks)."""

    def compute_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.supervised_loss(self.model(images), labels)
'''

SERVER = '''"""$name's server rule: how the sites' updates become the next global model (pure numpy)."""

from medflare.methods.base import ServerRule


class ${title}Rule(ServerRule):
    """Sample-count-weighted average of every shared weight (ServerRule's FedAvg). Override ``site_weight`` for
    another scalar weight per site, ``row_weights`` for per-class rows, ``phases`` for several tasks a round."""
'''

LEDGER = '''# $name's key invariants, each with the mutants a named test kills (`python tools/mutants.py --method $package`).
# Written by `medflare new-method`: replace this invariant with the paper's when the local step changes.

[[invariant]]
name = "the local step is cross-entropy over the site's labelled images (an unlabelled one, -1, counts for nothing)"
source = "medflare new-method's start: FedAvg's local step (McMahan et al. 2017; spec §0, unlabelled entries are -1)"
tests = ["tests/methods/test_$package.py::test_the_local_step_is_cross_entropy_over_the_labelled_images"]

[[invariant.mutant]]
file = "custom/medflare/methods/$package/client.py"
find = "        return self.supervised_loss(self.model(images), labels)"
replace = "        return self.supervised_loss(self.model(images), labels.clamp(min=0))"
'''

CARD = '''# $name

$summary

Reference: $reference.

Written by `medflare new-method $name`; until edited it trains as FedAvg.

- **Site** (`client.py`, `${title}Trainer.compute_loss`): cross-entropy over the site's labelled training images.
- **Server** (`server.py`, `${title}Rule`): sample-count-weighted average of every weight, n_c being the site's
  labelled training images (as FedAvg's card says).
- **What leaves a site** (`Payload` in `__init__.py`): all weights and the common meta (`n_samples`, `train_loss`,
  `train_seconds`, the evaluation counts of the received model); `docs/privacy.md` has its row.
- **Invariants** (`ledger.toml`): the local step's loss; `tests/methods/test_$package.py` kills its mutant.

```bash
medflare run $name --clients 2 --rounds 3
```
'''

TEST = '''"""$name: the local step, what a site sends and the aggregation, by hand (written by `medflare new-method`; change
them with the method, and keep ledger.toml's tests in step)."""

import numpy as np
import torch
import torch.nn.functional as F

from medflare import contracts
from medflare.methods.base import RoundContext, SiteUpdate
from medflare.registry import get_method

from ._trainers import make_trainer
from .conftest import make_site

METHOD = "$name"
LABELS = [0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2, -1]  # -1: an unlabelled image


def test_the_local_step_is_cross_entropy_over_the_labelled_images(linear) -> None:
    site = make_site(labels=LABELS)
    trainer = make_trainer(METHOD, linear, site)
    x, y = site.train.tensors
    labelled = y >= 0

    torch.testing.assert_close(trainer.compute_loss(x, y), F.cross_entropy(linear(x[labelled]), y[labelled]))


def test_a_round_sends_every_trained_weight_and_its_labelled_count(linear) -> None:
    trainer = make_trainer(METHOD, linear, make_site(labels=LABELS))
    before = {key: value.clone() for key, value in linear.state_dict().items()}

    meta = trainer.train_round(RoundContext(0, 1))
    sent = trainer.outgoing_arrays()

    assert meta[contracts.N_SAMPLES] == 9
    assert set(sent) == set(before)
    assert all(not torch.equal(torch.as_tensor(sent[key]), before[key]) for key in before)


def test_the_server_averages_the_sites_weighted_by_their_labelled_counts() -> None:
    spec = get_method(METHOD)
    rule = spec.server_rule_cls(spec.config_cls(), 1, spec.payload)
    updates = [SiteUpdate("site-1", {"w": np.array([1.0, 2.0], np.float32)}, {contracts.N_SAMPLES: 1}),
               SiteUpdate("site-2", {"w": np.array([5.0, 6.0], np.float32)}, {contracts.N_SAMPLES: 3})]

    result = rule.aggregate({"w": np.zeros(2, np.float32)}, updates, RoundContext(0, 1))

    np.testing.assert_allclose(result.params["w"], [4.0, 5.0])
    assert result.shares == {"site-1": 0.25, "site-2": 0.75}
'''

