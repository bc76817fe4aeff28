"""The package's layers, read from its import graph: lower floors never import the command-line face.

Floors, bottom to top: the algorithm floors (methods, losses, metrics, ops, models, data) and the FLARE glue
(flare) know nothing of how runs are launched or reported; the environments (simulate, deploy) share the
neutral runner/outputs/report/plotting modules; only ``medflare.cli`` is the command line, and nothing imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "custom" / "medflare"
LOWER_FLOORS = ("methods", "losses", "metrics", "ops", "models", "data", "flare")
LAUNCH_AND_REPORT = ("medflare.cli", "medflare.simulate", "medflare.deploy", "medflare.runner", "medflare.outputs",
                     "medflare.report")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module: str) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every import in the file of ``module``, relative imports resolved."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names], node.lineno))
    return found


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def imports_the_command_line(source: str, target: str, names: list[str]) -> bool:
    return under(target, "medflare.cli") and source != "medflare.cli"


def lower_floor_imports_launching_or_reporting(source: str, target: str, names: list[str]) -> bool:
    lower = any(under(source, f"medflare.{floor}") for floor in LOWER_FLOORS)
    return lower and any(under(target, upper) for upper in LAUNCH_AND_REPORT)


def deployment_borrows_the_simulator(source: str, target: str, names: list[str]) -> bool:
    return under(source, "medflare.deploy") and under(target, "medflare.simulate")


def home(module: str) -> str:
    """The top-level package part a module belongs to (``medflare.methods.fed_mas.plots`` -> ``medflare.methods``)."""
    return ".".join(module.split(".")[:2])


def takes_private_names_of_another_package(source: str, target: str, names: list[str]) -> bool:
    outside = target.startswith("medflare") and home(source) != home(target)
    return outside and any(name.startswith("_") for name in names)


RULES = [imports_the_command_line, lower_floor_imports_launching_or_reporting, deployment_borrows_the_simulator,
         takes_private_names_of_another_package]


def violations(rule, modules: dict[str, Path]) -> list[str]:
    return [f"{module}:{line} imports {target} {names or ''}"
            for module, path in modules.items() for target, names, line in imports(path, module)
            if rule(module, target, names)]


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_the_package_keeps_its_layers(rule) -> None:
    modules = package_modules()
    assert len(modules) > 50
    assert violations(rule, modules) == []


# Each rule meets the import it forbids (the shapes issue 9 found), so the checks above cannot pass by reading nothing.
FORBIDDEN = [
    (imports_the_command_line, "medflare.deploy.poc", "def f():\n    from medflare.cli import build_run_config\n"),
    (lower_floor_imports_launching_or_reporting, "medflare.methods.fed_mas.plots",
     "from medflare.report import integer_ticks, pyplot\n"),
    (lower_floor_imports_launching_or_reporting, "medflare.flare.job", "import medflare.outputs\n"),
    (deployment_borrows_the_simulator, "medflare.deploy.poc", "from medflare.simulate import describe_sites\n"),
    (takes_private_names_of_another_package, "medflare.deploy.poc", "from medflare.cli import _add_run_options\n"),
    (takes_private_names_of_another_package, "medflare.deploy.poc", "from ..report import _fmt\n"),
]


@pytest.mark.parametrize("rule, module, code", FORBIDDEN, ids=[f"{r.__name__}:{m}" for r, m, _ in FORBIDDEN])
def test_each_rule_catches_the_import_it_forbids(rule, module: str, code: str, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(code)
    assert len(violations(rule, {module: probe})) == 1
