"""What a code-free (pre-installed) job can make a site or the server build: medflare's job components only.

FLARE's loader imports the module part of a component ``path`` and calls the attribute it names with the job's
``args``. Whatever the class allow-list lets through is therefore callable by any job; with the old ``medflare.``
prefix that included ``medflare.console.deploy.policies.install_site_policies`` (issue 7, item 1).
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import types
from pathlib import Path
from typing import Any

import pytest
from nvflare.apis.fl_exception import UnsafeComponentError
from nvflare.app_common.widgets.component_path_authorizer import ComponentPathAuthorizer
from nvflare.fuel.utils.class_loader import load_class

import medflare
from medflare.console.deploy.apps import deployment_run
from medflare.console.deploy.policies import (
    CLIENT_COMPONENTS,
    COMPONENT_NAMESPACE,
    SERVER_COMPONENTS,
    client_resources_policy,
    flare_defaults,
    server_resources_policy,
)
from medflare.console.job_export import client_config, server_config
from medflare.plan import resolve
from medflare.registry import list_methods
from medflare.site_config import TaskSpec

TASK = TaskSpec(num_classes=2, in_channels=1, image_size=28)
# Every argument a job can pass to an allow-listed component, reviewed for what a job could do with it. A new
# argument fails the test until someone has. medflare's components take the job's plan file (`plan_file`: a plain
# file name in the job's own app/config, refused otherwise) and FLARE's component ids; what the plan may name is
# checked where it is used: `pretrained` (a weights file on the server, read with weights_only=True), `data`
# (refused at a real site unless it opted in), `resume_from` (a job id outside the simulator) and `plugins`
# (module names, imported only from the `medflare_plugins` package). The persistor deliberately takes none of
# FLARE's PT persistor's file arguments, and the tracking receivers neither a folder nor a tracking URI.
REVIEWED_ARGS = {
    "medflare.flare.persistor.MedflareModelPersistor": ["plan_file"],
    "medflare.flare.aggregator.MedflareAggregator": ["plan_file"],
    "medflare.flare.controller.MedflareController": ["plan_file", "persistor_id", "aggregator_id"],
    "medflare.flare.tb_receiver.TensorBoardReceiver": ["events"],
    # kw_args: FLARE's experiment/run names and tags; params: text values; deployed_env: a tag (no URI, no path)
    "medflare.flare.mlflow_receiver.MlflowReceiver": ["events", "kw_args", "params", "deployed_env"],
    "medflare.flare.executor.MedflareExecutor": ["plan_file"],
    "medflare.flare.tracking.SiteMetricsToServer": ["events_to_convert", "fed_event_prefix"],
    "medflare.flare.audit.PayloadRecorder": ["direction"],
    # filter/args: a site's own privacy.json names FLARE's DP filter; a job names its plan (whose dp section says)
    "medflare.flare.privacy.UpdatePrivacy": ["filter", "args", "plan_file"],
    "medflare.flare.he.EncryptedAggregator": ["plan_file"],  # the TenSEAL context is the kit's own
    "medflare.flare.he.EncryptResult": ["plan_file"],  # the plan's method declares what stays in plaintext
    "medflare.flare.he.DecryptTask": [],
}
KITS = {
    "client": (lambda: client_resources_policy(flare_defaults("client")["resources.json"]), CLIENT_COMPONENTS),
    "server": (lambda: server_resources_policy(flare_defaults("server")["resources.json"], "/kit"), SERVER_COMPONENTS),
}


class _Kit:
    """The one workspace method FLARE's authorizer calls: where the site's resources.json is."""

    def __init__(self, resources_file: Path) -> None:
        self.resources_file = resources_file

    def get_resources_file_path(self) -> str:
        return str(self.resources_file)


def medflare_modules() -> list[types.ModuleType]:
    """Every importable module of the medflare package (what FLARE's loader can import by name)."""
    modules = [medflare]
    for info in pkgutil.walk_packages(medflare.__path__, "medflare."):
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError:  # FLARE could not import it either
            continue
    return modules


def reachable_callables(resources: dict[str, Any], folder: Path) -> set[str]:
    """``module.attribute`` paths under medflare that FLARE's own authorizer lets a job build and that are callable."""
    resources_file = folder / "resources.json"
    resources_file.write_text(json.dumps(resources))
    kit, authorizer = _Kit(resources_file), ComponentPathAuthorizer()
    found = set()
    for module in medflare_modules():
        for name in set(dir(module)) | set(dir(types.ModuleType)):  # module attributes, imports, dunders
            path = f"{module.__name__}.{name}"
            try:
                authorizer.authorize_component_config({"path": path}, workspace=kit)
            except UnsafeComponentError:
                continue
            if callable(getattr(module, name, None)):
                found.add(path)
    return found


@pytest.mark.parametrize("kind", sorted(KITS))
def test_a_job_can_reach_only_the_job_components(kind: str, tmp_path: Path) -> None:
    resources, components = KITS[kind]
    assert reachable_callables(resources(), tmp_path) == set(components)


def test_job_builders_name_exactly_the_allow_listed_components() -> None:
    """With every option that adds a component on (tracking, audit, differential privacy; encrypted aggregation,
    which excludes the DP filter), the builders name exactly the allow-list: nothing a job legitimately needs is
    refused, nothing else is allowed."""
    for method in list_methods():
        run = deployment_run(method, tracking="both", audit=True, transfer_kind="diff",
                             dp={"filter": "percentile", "args": {"percentile": 10, "gamma": 0.01}})
        sealed = deployment_run("fedavg", tracking="both", audit=True, secure_aggregation="he")
        servers = _medflare_paths(server_config(resolve(run, task=TASK))) | _medflare_paths(server_config(resolve(sealed, task=TASK)))
        clients = _medflare_paths(client_config(resolve(run, task=TASK))) | _medflare_paths(client_config(resolve(sealed, task=TASK)))
        assert servers == set(SERVER_COMPONENTS), method
        assert clients == set(CLIENT_COMPONENTS), method


@pytest.mark.parametrize("method", list_methods())
def test_components_live_in_one_namespace_and_building_them_writes_nothing(
    method: str, tmp_path: Path, monkeypatch
) -> None:
    for path in (*SERVER_COMPONENTS, *CLIENT_COMPONENTS):
        assert path.startswith(COMPONENT_NAMESPACE) and load_class(path).__module__.startswith(COMPONENT_NAMESPACE)
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir(), home.mkdir()
    monkeypatch.chdir(cwd)  # a job process runs in the kit: nothing may appear in it, nor in HOME
    monkeypatch.setenv("HOME", str(home))
    run = deployment_run(method)
    config = server_config(resolve(run, task=TASK))
    built = [_build(c) for c in config["components"] + config["workflows"]]
    built.append(_build(client_config(resolve(run, task=TASK))["executors"][0]["executor"]))
    assert len(built) >= 4  # persistor, aggregator, controller, executor: each reads the plan once the job runs
    assert list(cwd.iterdir()) == [] and list(home.iterdir()) == []


def test_every_argument_a_job_can_pass_was_reviewed() -> None:
    arguments = {path: list(inspect.signature(load_class(path)).parameters) for path in REVIEWED_ARGS}
    assert set(REVIEWED_ARGS) == {*SERVER_COMPONENTS, *CLIENT_COMPONENTS}
    assert arguments == REVIEWED_ARGS


@pytest.mark.parametrize("argument", [
    {"global_model_file_name": "/srv/kit/local/authorization.json"},  # FLARE's PT persistor writes the model there
    {"source_ckpt_file_full_name": "/tmp/evil.pt", "load_weights_only": False},  # and would unpickle this
])
def test_the_persistor_takes_no_file_argument(argument: dict) -> None:
    with pytest.raises(TypeError):
        load_class("medflare.flare.persistor.MedflareModelPersistor")(**argument)


def _build(config: dict[str, Any]) -> Any:
    """Build a component config as FLARE does: nested component configs in ``args`` first."""
    args = {k: _build(v) if isinstance(v, dict) and "path" in v else v for k, v in config.get("args", {}).items()}
    return load_class(config["path"])(**args)


def _medflare_paths(config: Any) -> set[str]:
    if isinstance(config, dict):
        own = {config["path"]} if str(config.get("path", "")).startswith("medflare") else set()
        return own.union(*(_medflare_paths(v) for v in config.values()))
    if isinstance(config, list):
        return set().union(*(_medflare_paths(v) for v in config))
    return set()
