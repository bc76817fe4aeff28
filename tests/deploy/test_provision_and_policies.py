"""Provisioning the consortium project: startup kits hold the expected certificates and the site policies;
the policies mean what the docs say (pre-installed sites refuse BYOC; only medflare's job components are
allow-listed; result filters enforce each Payload; site logs stay at the site; the server's job store is
private and inside its kit; the CA's keys are readable by their owner only)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import FilterKey, FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.fuel.sec.authz import AuthzContext, Person, parse_policy_config
from nvflare.fuel.utils.config_service import ConfigService
from nvflare.private.privacy_manager import PrivacyManager

from medflare import contracts
from medflare.console.deploy.policies import (
    CLIENT_COMPONENTS,
    SERVER_COMPONENTS,
    SERVER_STORAGE,
    allow_components,
    authorization_policy,
    privacy_policy,
    scope_name,
)
from medflare.console.deploy.provision import ProvisionError, load_project, main, participants, provision
from medflare.contracts import ArraySpec, ContractContext, Payload
from medflare.deploy.filters import PayloadGuard, check_result_keys
from medflare.errors import PayloadError
from medflare.registry import get_method, list_methods

from .._plans import app_context, deploy_plan, site_data_plan

REPO = Path(__file__).resolve().parents[2]
PROJECT = REPO / "provisioning" / "project.yml"
SERVER = "fl-server.medflare.example.org"


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
        assert _medflare_entries(resources) == list(CLIENT_COMPONENTS)
        assert resources["class_list_enforcement_mode"] == "enforce"
        scopes = {s["name"] for s in json.loads((local / "privacy.json").read_text())["scopes"]}
        assert {scope_name(m) for m in list_methods()} <= scopes
    server_resources = json.loads((kits / SERVER / "local" / "resources.json").read_text())
    assert _medflare_entries(server_resources) == list(SERVER_COMPONENTS)  # server builds medflare components
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


def test_allow_list_names_exact_components_and_drops_broader_entries() -> None:
    default = {"class_allow_list": ["nvflare.x", "medflare.", "*"], "class_list_enforcement_mode": "warn"}
    policy = allow_components(allow_components(default, CLIENT_COMPONENTS), CLIENT_COMPONENTS)
    assert policy["class_allow_list"] == ["nvflare.x", *CLIENT_COMPONENTS]
    assert policy["class_list_enforcement_mode"] == "enforce"


def test_server_job_store_and_snapshots_are_private_and_inside_the_kit(kits: Path) -> None:
    """FLARE's default /tmp/nvflare job store is world-readable and shared by every server on the machine."""
    server = kits / SERVER
    resources = json.loads((server / "local" / "resources.json").read_text())
    job_manager = next(c for c in resources["components"] if c["id"] == "job_manager")
    snapshots = resources["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"]
    assert job_manager["args"]["uri_root"] == str(server.resolve() / SERVER_STORAGE["job_store"])
    assert snapshots == str(server.resolve() / SERVER_STORAGE["snapshots"])
    for folder in SERVER_STORAGE.values():
        assert _mode(server / folder) == 0o700


def test_sites_do_not_upload_their_logs(kits: Path, tmp_path: Path) -> None:
    """FLARE's error-log upload (ERRORLOG_<site>) carried a site's data path to the server: switched off."""
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.app_common.logging.constants import is_log_streaming_allowed

    site = tmp_path / "hospital-a"
    shutil.copytree(kits / "hospital-a", site)
    ctx = FLContext()  # what FLARE's SiteLogStreamer and JobLogStreamer ask before sending any log
    ctx.set_prop(FLContextKey.WORKSPACE_ROOT, str(site), private=True, sticky=False)
    ctx.put(key=ReservedKey.IDENTITY_NAME, value="hospital-a", private=False, sticky=False)
    assert json.loads((site / "local" / "resources.json").read_text())["allow_log_streaming"] is False
    assert not is_log_streaming_allowed(ctx)


def test_ca_keys_are_readable_by_their_owner_only(kits: Path) -> None:
    """state/cert.json holds the root CA's and every participant's private key (FLARE writes it 0644)."""
    project_dir = kits.parent
    assert _mode(project_dir / "state" / "cert.json") == 0o600
    assert _mode(project_dir / "state") == 0o700 and _mode(project_dir) == 0o700


# ----- every output stays inside -w (issue 27) -------------------------------------------------------------------
def project_with(tmp_path: Path, field: str, value: object) -> Path:
    """provisioning/project.yml with ``name`` or ``participants[i].name`` replaced by ``value``."""
    project = load_project(PROJECT)
    if field == "name":
        project["name"] = value
    else:
        project["participants"][int(field.split("[")[1].split("]")[0])]["name"] = value
    path = tmp_path / "project.yml"
    path.write_text(yaml.safe_dump(project))
    return path


@pytest.fixture
def nothing_may_start(monkeypatch) -> None:
    """FLARE's provisioner must not run: these projects are refused before it."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)


@pytest.mark.parametrize("field, value", [
    ("name", "../../../escaped-by-name"), ("name", "/tmp/escaped-absolute"), ("name", ".."), ("name", "a/b"),
    ("name", 2024), ("name", "medflare\n"), ("participants[1].name", "../escaped-site"),
    ("participants[1].name", "."), ("participants[4].name", "../admin@medflare.example.org"),
    ("participants[2].name", "-rf"), ("participants[3].name", None),
])
def test_a_name_that_is_not_one_plain_folder_is_refused_in_one_line(
    field: str, value: object, tmp_path: Path, capsys, nothing_may_start
) -> None:
    """A project.yml with name: ../../../tmp/x wrote the kits and state/cert.json outside -w."""
    workspace = tmp_path / "deep" / "er" / "workspace"
    code = main(["-p", str(project_with(tmp_path, field, value)), "-w", str(workspace)])
    err = capsys.readouterr().err
    assert code == 2 and f"{field} must be one plain folder name" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not workspace.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["project.yml"]


def test_a_link_in_the_workspace_is_refused_before_flare_writes_through_it(
    tmp_path: Path, nothing_may_start
) -> None:
    workspace, outside = tmp_path / "workspace", tmp_path / "outside"
    workspace.mkdir(), outside.mkdir()
    (workspace / load_project(PROJECT)["name"]).symlink_to(outside)
    with pytest.raises(ProvisionError, match="outside the workspace"):
        provision(PROJECT, workspace)
    assert list(outside.iterdir()) == []


def test_a_link_in_what_flare_wrote_is_refused_before_anything_is_written_through_it(
    tmp_path: Path, monkeypatch
) -> None:
    """After FLARE ran, nothing outside -w is chmod-ed or gets a policy file (a kit folder linked out)."""
    workspace, outside = tmp_path / "workspace", tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o755)

    def fake_flare(*args, **kwargs) -> subprocess.CompletedProcess:
        prod = workspace / "medflare" / "prod_00"
        (workspace / "medflare" / "state").mkdir(parents=True)
        (workspace / "medflare" / "state" / "cert.json").write_text("{}")
        (prod / SERVER / "startup").mkdir(parents=True)
        (prod / "hospital-a").symlink_to(outside)
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_flare)
    with pytest.raises(ProvisionError, match="hospital-a resolves to .*outside the workspace"):
        provision(PROJECT, workspace)
    assert list(outside.iterdir()) == [] and _mode(outside) == 0o755


def test_reinstall_rewrites_one_moved_kit(kits: Path, tmp_path: Path, capsys) -> None:
    moved = tmp_path / "moved-server"
    shutil.copytree(kits / SERVER, moved)
    assert main(["--reinstall", str(moved), "--mode", "preinstalled"]) == 0
    resources = json.loads((moved / "local" / "resources.json").read_text())
    job_manager = next(c for c in resources["components"] if c["id"] == "job_manager")
    assert job_manager["args"]["uri_root"] == str(moved.resolve() / SERVER_STORAGE["job_store"])
    assert "wrote" in capsys.readouterr().out
    assert main(["--reinstall", str(kits / "lead@hospital-a.example.org")]) == 2  # an admin kit has no policies
    assert "is not a server or site kit" in capsys.readouterr().err


def test_committed_policy_templates_are_up_to_date() -> None:
    from medflare.console.deploy.policies import stale_policy_templates

    assert stale_policy_templates() == [], "provisioning/site_local is stale: run 'make policies'"


def flare_privacy_manager(kit: Path) -> PrivacyManager:
    """The privacy manager FLARE's own config parser builds from this repo's ``local/privacy.json`` in ``kit``."""
    from nvflare.apis.workspace import Workspace
    from nvflare.private.fed.app.fl_conf import create_privacy_manager

    (kit / "local").mkdir(parents=True)
    (kit / "startup").mkdir()
    (kit / "local" / "privacy.json").write_text(json.dumps(privacy_policy(list_methods())))
    ConfigService.initialize({}, [str(kit / "local")])
    return create_privacy_manager(Workspace(str(kit), "site-1"), names_only=False)


@pytest.mark.parametrize("method", list_methods())
def test_privacy_scope_filters_build_under_flare(method: str, tmp_path: Path) -> None:
    """FLARE's own privacy-config parser builds every scope's filters (so a site can start with it), with the
    guard on both sides: it records each incoming task and checks each outgoing result."""
    manager = flare_privacy_manager(tmp_path)
    for scope in (manager.get_scope(scope_name(method)), manager.get_scope(None)):
        assert scope is not None and any(isinstance(f, PayloadGuard) for f in _result_filters(scope))
        assert any(isinstance(f, PayloadGuard) for f in scope.task_data_filters[FilterKey.IN])
    assert manager.get_scope(None).name == "medflare"


K = 3  # the task of the guard tests' job


def valid_array(spec: ArraySpec, ctx: ContractContext) -> np.ndarray:
    """The plainest array a declared spec accepts (uniform probability rows, zero counts)."""
    shape = tuple(ctx.resolve(d) or 2 for d in spec.shape)
    value = spec.row_sum / shape[-1] if spec.row_sum is not None else max(spec.low or 0.0, 0.0)
    return np.full(shape, value, dtype=spec.dtypes[0])


def guard_context(
    app: Path, method: str, task_arrays: dict | None = None, task_name: str = "train", task_meta: dict | None = None
) -> FLContext:
    """What FLARE gives a site's result filter: the job's folder, the task's name and the task's data (whose meta
    is ``task_meta``, by default array dimensions only)."""
    ctx = app_context(deploy_plan(app, site_data_plan(method, K)))
    ctx.set_prop(FLContextKey.TASK_NAME, task_name, private=True, sticky=False)
    meta = {contracts.ARRAY_DIMS: {"rows": 4}} if task_meta is None else task_meta
    task = DXO(DataKind.WEIGHTS, data=task_arrays or {}, meta=meta)
    ctx.set_prop(FLContextKey.TASK_DATA, task.to_shareable(), private=True, sticky=False)
    return ctx


@pytest.mark.parametrize("method", list_methods())
def test_guard_passes_what_the_method_declares_and_refuses_anything_else(method: str, tmp_path: Path) -> None:
    payload = get_method(method).payload
    received = {"conv.weight": np.ones(2, np.float32)} if payload.sends_weights else {}
    ctx = guard_context(tmp_path, method, received)
    contract = ContractContext(K, dims={"rows": 4})
    arrays = dict(received) or {name: valid_array(spec, contract) for name, spec in payload.arrays_for("train").items()}
    ok = DXO(DataKind.WEIGHTS, data=arrays, meta={"n_samples": 12}).to_shareable()
    assert PayloadGuard(method).process(ok, ctx) is ok
    smuggled = DXO(DataKind.WEIGHTS, data=arrays, meta={"n_samples": 1, "patient_ids": [7]}).to_shareable()
    with pytest.raises(PayloadError, match="patient_ids"):
        PayloadGuard(method).process(smuggled, ctx)


@pytest.mark.parametrize("bad", ["stolen_images", "n_samples_string", "nested_eval_extra", "nan_weight"])
def test_guard_checks_values_not_only_names(bad: str, tmp_path: Path) -> None:
    """Issue 7.4: each of these passed a names-only guard and reached the server."""
    received = {"conv.weight": np.ones(2, np.float32)}
    ctx = guard_context(tmp_path, "fedavg", received)
    arrays, meta = dict(received), {"n_samples": 12}
    if bad == "stolen_images":
        arrays["stolen_images"] = np.zeros((4, 28, 28), np.uint8)
    elif bad == "n_samples_string":
        meta["n_samples"] = "x" * 20_000
    elif bad == "nested_eval_extra":
        meta["eval_test"] = {"confusion": np.eye(K, dtype=np.int64).tolist(), "extra": {"ids": [1, 2]}}
    else:
        arrays["conv.weight"] = np.array([1.0, np.nan], np.float32)
    with pytest.raises(PayloadError):
        PayloadGuard("fedavg").process(DXO(DataKind.WEIGHTS, data=arrays, meta=meta).to_shareable(), ctx)
    PayloadGuard("fedavg").process(DXO(DataKind.WEIGHTS, data=received, meta={"n_samples": 12}).to_shareable(), ctx)


def test_guard_checks_declared_probabilities(tmp_path: Path) -> None:
    """An fp16 'probability' matrix of 5.0 (issue 8) is refused at the site, not only at the server."""
    from medflare.methods.mdhfl.protocol import PROBS, PROBS_PHASE

    spec = get_method("mdhfl").payload.arrays_for(PROBS_PHASE)[PROBS]
    ctx = guard_context(tmp_path, "mdhfl", task_name=PROBS_PHASE)
    good = valid_array(spec, ContractContext(K, dims={"rows": 4}))
    ok = DXO(DataKind.WEIGHTS, data={PROBS: good}, meta={}).to_shareable()
    assert PayloadGuard("mdhfl").process(ok, ctx) is ok
    for bad in (np.full_like(good, 5.0), good[:, :2], good.astype(np.float64)):
        with pytest.raises(PayloadError):
            PayloadGuard("mdhfl").process(DXO(DataKind.WEIGHTS, data={PROBS: bad}, meta={}).to_shareable(), ctx)


def test_guard_refuses_private_keys_and_reads_the_method_from_the_job(tmp_path: Path) -> None:
    with pytest.raises(PayloadError, match="private"):
        check_result_keys(Payload(private_keys=r"^head\."), ["body.w", "head.w"], [])
    with pytest.raises(PayloadError, match="no weights"):
        check_result_keys(Payload(sends_weights=False, arrays=("probs",)), ["body.w"], [])
    ctx = guard_context(tmp_path, list_methods()[0], {"w": np.ones(1, np.float32)})
    smuggled = DXO(DataKind.WEIGHTS, data={"w": np.ones(1, np.float32)}, meta={"secret": 1}).to_shareable()
    with pytest.raises(PayloadError, match="secret"):
        PayloadGuard("").process(smuggled, ctx)
    failed = DXO(DataKind.WEIGHTS, data={"w": [1.0]}, meta={"secret": 1}).to_shareable()
    failed.set_return_code(ReturnCode.EXECUTION_EXCEPTION)
    assert PayloadGuard("").process(failed, ctx) is failed
    with pytest.raises(PayloadError, match="cannot tell"):
        PayloadGuard("fedavg").process(DXO(DataKind.WEIGHTS, data={}, meta={}).to_shareable(), FLContext())
    other = "fedprox" if list_methods()[0] != "fedprox" else "fedavg"  # a scope's guard for another method
    with pytest.raises(PayloadError, match=f"guard is for '{other}' results and the job's plan runs"):
        PayloadGuard(other).process(DXO(DataKind.WEIGHTS, data={"w": np.ones(1, np.float32)}, meta={}).to_shareable(),
                                    ctx)


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _medflare_entries(resources: dict) -> list[str]:
    return [entry for entry in resources["class_allow_list"] if entry.startswith("medflare")]


def _gpu_args(resources: dict) -> dict:
    return next(c["args"] for c in resources["components"] if c["id"] == "resource_manager")


def _byoc_allowed(kit: Path, role: str) -> bool:
    policy, err = parse_policy_config(json.loads((kit / "local" / "authorization.json").read_text()), {})
    assert not err
    ctx = AuthzContext(right="byoc", user=Person("u@x.org", "org", role), submitter=Person("u@x.org", "org", role))
    return policy.evaluate("org", ctx)[0]


def _result_filters(scope) -> list:
    return [f for filters in scope.task_result_filters.values() for f in filters]
