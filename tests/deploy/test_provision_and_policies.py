"""Provisioning the consortium project: startup kits hold the expected certificates and the site policies;
the policies mean what the docs say (pre-installed sites refuse BYOC; result filters enforce each Payload)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.fuel.sec.authz import AuthzContext, Person, parse_policy_config
from nvflare.fuel.utils.config_service import ConfigService

from medflare.contracts import Payload
from medflare.deploy.filters import PayloadGuard, check_result_keys
from medflare.deploy.policies import (
    ALLOW_LIST_PREFIX, authorization_policy, privacy_policy, resources_policy, scope_name,
)
from medflare.deploy.provision import load_project, participants, provision
from medflare.errors import PayloadError
from medflare.registry import get_method, list_methods

REPO = Path(__file__).resolve().parents[2]
PROJECT = REPO / "provisioning" / "project.yml"


@pytest.fixture(scope="module")
def kits(tmp_path_factory) -> Path:
    workspace = tmp_path_factory.mktemp("provision")
    return provision(PROJECT, workspace, site_modes={"hospital-c": "preinstalled"}, site_gpus={"hospital-a": 2})


def test_project_has_every_role_and_a_comment_on_every_key() -> None:
    project = load_project(PROJECT)
    assert len(participants(project, "server")) == 1 and len(participants(project, "client")) >= 2
    roles = {a["role"] for a in participants(project, "admin")}
    assert {"project_admin", "lead", "member"} <= roles
    lines = PROJECT.read_text().splitlines()
    keys = {line.split(":")[0].strip(" -") for line in lines if ":" in line and not line.strip().startswith("#")}
    for key in keys:
        assert any(line.strip().startswith("#") and key in line for line in lines), f"'{key}' has no comment"


def test_kits_hold_the_expected_certificates(kits: Path) -> None:
    project = load_project(PROJECT)
    server = participants(project, "server")[0]["name"]
    assert {"server.crt", "server.key", "rootCA.pem", "fed_server.json", "start.sh"} <= _names(kits / server / "startup")
    for client in participants(project, "client"):
        startup = kits / client["name"] / "startup"
        assert {"client.crt", "client.key", "rootCA.pem", "fed_client.json", "start.sh"} <= _names(startup)
        assert oct((startup / "client.key").stat().st_mode & 0o777) == "0o600"
        assert json.loads((startup / "fed_client.json").read_text())["client"]["connection_security"] == "mtls"
    for admin in participants(project, "admin"):
        assert {"client.crt", "client.key", "rootCA.pem", "fed_admin.json"} <= _names(kits / admin["name"] / "startup")


def test_kits_hold_the_site_policies(kits: Path) -> None:
    for site in ("hospital-a", "hospital-b", "hospital-c"):
        local = kits / site / "local"
        assert {"authorization.json", "privacy.json", "resources.json"} <= _names(local)
        resources = json.loads((local / "resources.json").read_text())
        assert ALLOW_LIST_PREFIX in resources["class_allow_list"]
        assert resources["class_list_enforcement_mode"] == "enforce"
        scopes = {s["name"] for s in json.loads((local / "privacy.json").read_text())["scopes"]}
        assert {scope_name(m) for m in list_methods()} <= scopes
    server_resources = json.loads((kits / "fl-server.medflare.example.org" / "local" / "resources.json").read_text())
    assert ALLOW_LIST_PREFIX in server_resources["class_allow_list"]  # server builds medflare components too
    gpus = _gpu_args(json.loads((kits / "hospital-a" / "local" / "resources.json").read_text()))
    assert gpus["num_of_gpus"] == 2
    assert _byoc_allowed(kits / "hospital-a", "lead") and not _byoc_allowed(kits / "hospital-c", "lead")
    assert not _byoc_allowed(kits / "hospital-c", "project_admin")


def test_preinstalled_authorization_keeps_every_other_right() -> None:
    default = json.loads((REPO / "provisioning" / "site_local" / "client" / "byoc" / "authorization.json").read_text())
    policy = authorization_policy(default, "preinstalled")
    parsed, err = parse_policy_config(policy, {})
    assert not err
    for role in ("project_admin", "lead"):
        assert policy["permissions"][role]["byoc"] == "none"
        assert policy["permissions"][role]["submit_job"] == "any"
    assert authorization_policy(default, "byoc") == default


def test_resources_policy_adds_the_prefix_once() -> None:
    policy = resources_policy(resources_policy({"class_allow_list": ["nvflare.x"], "components": []}))
    assert policy["class_allow_list"] == ["nvflare.x", ALLOW_LIST_PREFIX]


def test_committed_policy_templates_are_up_to_date() -> None:
    from medflare.deploy.policies import stale_policy_templates

    assert stale_policy_templates() == [], "provisioning/site_local is stale: run 'make policies'"


@pytest.mark.parametrize("method", list_methods())
def test_privacy_scope_filters_build_under_flare(method: str, tmp_path: Path) -> None:
    """FLARE's own privacy-config parser builds every scope's filters (so a site can start with it)."""
    from nvflare.apis.workspace import Workspace
    from nvflare.private.fed.app.fl_conf import create_privacy_manager

    (tmp_path / "local").mkdir()
    (tmp_path / "startup").mkdir()
    (tmp_path / "local" / "privacy.json").write_text(json.dumps(privacy_policy(list_methods())))
    ConfigService.initialize({}, [str(tmp_path / "local")])
    manager = create_privacy_manager(Workspace(str(tmp_path), "site-1"), names_only=False)
    scope = manager.get_scope(scope_name(method))
    assert scope is not None and any(isinstance(f, PayloadGuard) for f in _result_filters(scope))
    assert manager.get_scope(None).name == "medflare"


@pytest.mark.parametrize("method", list_methods())
def test_guard_passes_what_the_method_declares_and_refuses_anything_else(method: str) -> None:
    payload = get_method(method).payload
    guard = PayloadGuard(method)
    declared_meta = sorted(payload.allowed_meta())
    arrays = {"conv.weight": [1.0]} if payload.sends_weights else {name: [1.0] for name in payload.arrays}
    ok = DXO(DataKind.WEIGHTS, data=arrays, meta={k: 1 for k in declared_meta}).to_shareable()
    assert guard.process(ok, FLContext()) is ok
    smuggled = DXO(DataKind.WEIGHTS, data=arrays, meta={"n_samples": 1, "patient_ids": [7]}).to_shareable()
    with pytest.raises(PayloadError, match="patient_ids"):
        guard.process(smuggled, FLContext())


def test_guard_refuses_private_keys_and_reads_the_method_from_the_job(tmp_path: Path) -> None:
    with pytest.raises(PayloadError, match="private"):
        check_result_keys(Payload(private_keys=r"^head\."), ["body.w", "head.w"], [])
    with pytest.raises(PayloadError, match="no weights"):
        check_result_keys(Payload(sends_weights=False, arrays=("probs",)), ["body.w"], [])
    (tmp_path / "config").mkdir()
    config = {"executors": [{"executor": {"args": {"method": list_methods()[0]}}}]}
    (tmp_path / "config" / "config_fed_client.json").write_text(json.dumps(config))
    ctx = FLContext()
    ctx.set_prop(FLContextKey.APP_ROOT, str(tmp_path), private=True, sticky=False)
    smuggled = DXO(DataKind.WEIGHTS, data={"w": [1.0]}, meta={"secret": 1}).to_shareable()
    with pytest.raises(PayloadError, match="secret"):
        PayloadGuard("").process(smuggled, ctx)
    failed = DXO(DataKind.WEIGHTS, data={"w": [1.0]}, meta={"secret": 1}).to_shareable()
    failed.set_return_code(ReturnCode.EXECUTION_EXCEPTION)
    assert PayloadGuard("").process(failed, ctx) is failed


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _gpu_args(resources: dict) -> dict:
    return next(c["args"] for c in resources["components"] if c["id"] == "resource_manager")


def _byoc_allowed(kit: Path, role: str) -> bool:
    policy, err = parse_policy_config(json.loads((kit / "local" / "authorization.json").read_text()), {})
    assert not err
    ctx = AuthzContext(right="byoc", user=Person("u@x.org", "org", role), submitter=Person("u@x.org", "org", role))
    return policy.evaluate("org", ctx)[0]


def _result_filters(scope) -> list:
    return [f for filters in scope.task_result_filters.values() for f in filters]
