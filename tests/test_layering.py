"""The package's layers, read from its import graph: every import counts, at the top, in a function or under
TYPE_CHECKING.

Two packages (issue 64): the job package (everything a FLARE job's processes import: methods, models, data, flare/,
the run layer, ``medflare.deploy.filters``) and the console (``medflare.console``: the command line, the simulator
wrapper, the job writer, reports, the deployment tools). Nothing outside the console imports it; the console builds
on the job package. A BYOC job and the site wheel ship the job package alone.

Floors, bottom to top: the algorithm floors (methods, losses, metrics, ops, models, data) and the run layer (a run's
configuration, its validation and the site and server work without FLARE) know nothing of FLARE's glue (flare), and
nothing flare/ builds on imports it; the job writer (console.job_export) and flare know nothing of how runs are
launched or reported; deployment tools (console.deploy) never import the reporting internals (report, plotting): the
POC writes a run's outputs through the runner, as the simulator does; only ``medflare.console.cli`` is the command
line, and nothing imports it. No two modules import each other, however indirectly.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "custom" / "medflare"
CONSOLE = "medflare.console"
DEPLOYMENT = "medflare.console.deploy"
LOWER_FLOORS = ("methods", "losses", "metrics", "ops", "models", "data", "flare", "console.job_export")
LAUNCH_AND_REPORT = ("medflare.console.cli", "medflare.console.simulate", DEPLOYMENT, "medflare.console.launch",
                     "medflare.console.run_options", "medflare.console.report")
# issue 50: what the command line and the deployment tools both need, in a layer below both
BELOW_THE_LAUNCHERS = ("medflare.console.launch", "medflare.console.run_options", "medflare.console.processes",
                       "medflare.console.files")
LAUNCHERS = ("medflare.console.cli", "medflare.console.simulate", DEPLOYMENT)
RUN_LAYER = ("medflare.config", "medflare.run_config", "medflare.console.effective_config", "medflare.registry",
             "medflare.console.scenarios", "medflare.site_config", "medflare.server_setup", "medflare.resume",
             "medflare.plan")
SITE_RUNTIME = "medflare.site_runtime"  # the site's torch runtime: what a site runs is decided in site_config
REPORTING = ("medflare.console.report", "medflare.plotting")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, module: str) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every import in the file of ``module``, relative imports resolved; a
    package module taken by name (``from medflare.console import report``) is an import of that module."""
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
            names = [alias.name for alias in node.names]
            found += [(f"{base}.{name}", [], node.lineno) for name in names if f"{base}.{name}" in MODULES]
            others = [name for name in names if f"{base}.{name}" not in MODULES]
            found += [(base, others, node.lineno)] if others else []
    return found


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


MODULES = package_modules()


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports."""
    return {module: {target for target, _, _ in imports(path, module) if target in modules and target != module}
            for module, path in modules.items()}


def reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += graph[module]
    return seen


def import_cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Each set of modules that import each other, directly or not (a strongly connected component), sorted."""
    reach = {module: reached(graph, module) for module in graph}
    return sorted({tuple(sorted(other for other in reach[module] if module in reach[other]))
                   for module in graph if module in reach[module]})


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def imports_the_command_line(source: str, target: str, names: list[str]) -> bool:
    return under(target, "medflare.console.cli") and source != "medflare.console.cli"


def lower_floor_imports_launching_or_reporting(source: str, target: str, names: list[str]) -> bool:
    lower = any(under(source, f"medflare.{floor}") for floor in LOWER_FLOORS)
    return lower and any(under(target, upper) for upper in LAUNCH_AND_REPORT)


def shared_launching_imports_a_launcher(source: str, target: str, names: list[str]) -> bool:
    """The layer the command line and the deployment tools both launch through imports neither of them."""
    shared = any(under(source, module) for module in BELOW_THE_LAUNCHERS)
    return shared and any(under(target, module) for module in LAUNCHERS)


def deployment_borrows_the_simulator(source: str, target: str, names: list[str]) -> bool:
    return under(source, DEPLOYMENT) and under(target, "medflare.console.simulate")


def home(module: str) -> str:
    """The top-level package part a module belongs to (``medflare.methods.fed_mas.plots`` -> ``medflare.methods``;
    in the console one level down: ``medflare.console.deploy.poc`` -> ``medflare.console.deploy``)."""
    depth = 3 if under(module, CONSOLE) else 2
    return ".".join(module.split(".")[:depth])


def takes_private_names_of_another_package(source: str, target: str, names: list[str]) -> bool:
    outside = target.startswith("medflare") and home(source) != home(target)
    return outside and any(name.startswith("_") for name in names)


GRAPH = import_graph(MODULES)
FLARE = {module for module in GRAPH if under(module, "medflare.flare")}
BELOW_FLARE = set().union(*(reached(GRAPH, module) for module in FLARE)) - FLARE  # what flare/ builds on


def what_flare_builds_on_imports_flare(source: str, target: str, names: list[str]) -> bool:
    return source in BELOW_FLARE and under(target, "medflare.flare")


def run_layer_imports_flare(source: str, target: str, names: list[str]) -> bool:
    return any(under(source, module) for module in RUN_LAYER) and under(target, "medflare.flare")


def run_layer_imports_the_site_runtime(source: str, target: str, names: list[str]) -> bool:
    """Issue 50: configuration types and job checks live in ``site_config``; the run layer that resolves a job never
    reaches for the site's runtime (data, models, training) to do it."""
    return any(under(source, module) for module in RUN_LAYER) and under(target, SITE_RUNTIME)


def the_job_package_imports_the_console(source: str, target: str, names: list[str]) -> bool:
    """Issue 64: a job's processes never need the console, so a job and the site wheel can ship without it."""
    return not under(source, CONSOLE) and under(target, CONSOLE)


def deployment_imports_reporting(source: str, target: str, names: list[str]) -> bool:
    return under(source, DEPLOYMENT) and any(under(target, module) for module in REPORTING)


RULES = [imports_the_command_line, lower_floor_imports_launching_or_reporting, shared_launching_imports_a_launcher,
         deployment_borrows_the_simulator,
         takes_private_names_of_another_package, what_flare_builds_on_imports_flare, run_layer_imports_flare,
         run_layer_imports_the_site_runtime, deployment_imports_reporting, the_job_package_imports_the_console]


def violations(rule, modules: dict[str, Path]) -> list[str]:
    return [f"{module}:{line} imports {target} {names or ''}"
            for module, path in modules.items() for target, names, line in imports(path, module)
            if rule(module, target, names)]


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_the_package_keeps_its_layers(rule) -> None:
    assert len(MODULES) > 50 and {"medflare.site_runtime", "medflare.site_config", "medflare.methods.base"} <= BELOW_FLARE
    assert violations(rule, MODULES) == []


# Each rule meets the import it forbids (the shapes issue 9 found), so the checks above cannot pass by reading nothing.
FORBIDDEN = [
    (imports_the_command_line, "medflare.console.deploy.poc",
     "def f():\n    from medflare.console.cli import build_run_config\n"),
    (lower_floor_imports_launching_or_reporting, "medflare.methods.fed_mas.plots",
     "from medflare.console.report import integer_ticks, pyplot\n"),
    (lower_floor_imports_launching_or_reporting, "medflare.console.job_export", "import medflare.console.launch\n"),
    # issue 50: the layer both launch through borrows from neither
    (shared_launching_imports_a_launcher, "medflare.console.launch",
     "def f():\n    from medflare.console.deploy.poc import PocSession\n"),
    (shared_launching_imports_a_launcher, "medflare.console.run_options",
     "from medflare.console.cli import make_parser\n"),
    (deployment_borrows_the_simulator, "medflare.console.deploy.poc",
     "from medflare.console.simulate import describe_sites\n"),
    (takes_private_names_of_another_package, "medflare.console.deploy.poc",
     "from medflare.console.cli import _add_run_options\n"),
    (takes_private_names_of_another_package, "medflare.console.deploy.poc", "from ..report import _fmt\n"),
    # the shapes issue 33 found
    (what_flare_builds_on_imports_flare, "medflare.resume",
     "def f():\n    from medflare.flare.tasks import round_plan\n"),
    (what_flare_builds_on_imports_flare, "medflare.methods.base", "import medflare.flare.aggregator\n"),
    (run_layer_imports_flare, "medflare.run_config",
     "def f():\n    from medflare.flare.aggregator import RoundAggregation\n"),
    (run_layer_imports_flare, "medflare.plan",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .flare.privacy import UpdatePrivacy\n"),
    (deployment_imports_reporting, "medflare.console.deploy.poc",
     "from medflare.console.report import results_table\n"),
    # issue 64: the job package imports no console module, however it is reached
    (the_job_package_imports_the_console, "medflare.flare.executor",
     "def f():\n    from medflare.console.files import write_recorded\n"),
    (the_job_package_imports_the_console, "medflare.deploy.filters", "from medflare import console\n"),
    (the_job_package_imports_the_console, "medflare.methods.base", "from ..console import processes\n"),
    (deployment_imports_reporting, "medflare.console.deploy.rehearse", "def f():\n    from medflare import plotting\n"),
]


@pytest.mark.parametrize("rule, module, code", FORBIDDEN, ids=[f"{r.__name__}:{m}" for r, m, _ in FORBIDDEN])
def test_each_rule_catches_the_import_it_forbids(rule, module: str, code: str, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(code)
    assert len(violations(rule, {module: probe})) == 1


def test_no_modules_import_each_other() -> None:
    assert import_cycles(GRAPH) == []


# The circles issue 33 found (in functions, under TYPE_CHECKING, through a package's own import line), and a module
# that imports one of them but is not part of it.
CIRCLES = [
    ({"medflare.console.deploy.poc": "def f():\n    from medflare.console.deploy.watch import watch\n",
      "medflare.console.deploy.watch": "def f():\n    from medflare.console.deploy.poc import PocSession\n"},
     ("medflare.console.deploy.poc", "medflare.console.deploy.watch")),
    ({"medflare.methods.base": "from medflare.optim import build_optimizer\n",
      "medflare.optim": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .methods.base import TrainConfig\n",
      "medflare.run_config": "import medflare.optim\n"},
     ("medflare.methods.base", "medflare.optim")),
    ({"medflare.registry": "def f():\n    import medflare.methods\n",
      "medflare.methods": "from medflare.methods import fedavg\n",
      "medflare.methods.fedavg": "from medflare.registry import register_method\n"},
     ("medflare.methods", "medflare.methods.fedavg", "medflare.registry")),
]


@pytest.mark.parametrize("files, cycle", CIRCLES, ids=["+".join(cycle) for _, cycle in CIRCLES])
def test_the_cycle_check_catches_modules_that_import_each_other(files: dict[str, str], cycle: tuple,
                                                                tmp_path: Path) -> None:
    modules = {module: tmp_path / f"{module}.py" for module in files}
    for module, code in files.items():
        modules[module].write_text(code)
    assert import_cycles(import_graph(modules)) == [cycle]


def test_the_layered_run_input_imports_no_torch_and_looks_no_method_up() -> None:
    """Issue 50: the raw layered input (RunConfig, its layers and --set) is plain and torch-free; what needs the
    method (its defaults, its argument types) is resolved in medflare.plan only."""
    import os
    import subprocess
    import sys

    probe = ("import sys; from medflare.run_config import RunConfig, apply_overrides, merge_run_config; "
             "run = apply_overrides(merge_run_config({'method': 'fca'}), ['train.lr=0.1', 'rounds=4']); "
             "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torchvision', 'nvflare') "
             "or m in ('medflare.registry', 'medflare.plan', 'medflare.methods.base')); "
             "print(run.model, run.rounds, run.train, heavy)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert done.stdout.split() == ["efficientnet_lite0", "4", "{'lr':", "'0.1'}", "[]"]


# What FLARE starts in a job's processes, by class path (config_fed_*.json, the sites' privacy.json), and what the
# method, model and data registries import by name at a site.
JOB_ENTRIES = ("medflare.flare", "medflare.deploy.filters", "medflare.methods", "medflare.models", "medflare.data",
               "medflare.losses")


def test_the_console_builds_on_the_job_package_and_a_job_reaches_no_console_module() -> None:
    """Issue 64: the console imports the job package (the job writer resolves plans); everything a job's
    processes import, from the components FLARE starts, lies outside the console."""
    assert {"medflare.plan", "medflare.job_code"} <= GRAPH["medflare.console.job_export"]
    entries = {module for module in GRAPH if any(under(module, entry) for entry in JOB_ENTRIES)}
    job_side = entries.union(*(reached(GRAPH, module) for module in entries))
    assert len(job_side) > 50 and {"medflare.site_runtime", "medflare.plan", "medflare.deploy.filters"} <= job_side
    assert sorted(module for module in job_side if under(module, CONSOLE)) == []
