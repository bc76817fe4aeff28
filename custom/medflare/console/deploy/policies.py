"""Site-local FLARE policies for a medflare consortium: who may do what, what may leave, what may run.

The files a hospital uses (``local/authorization.json``, ``privacy.json``, ``resources.json``,
``medflare_site.json``) are derived from the kit's FLARE defaults (``local/*.default``), medflare's additions on
top. Site modes: ``byoc`` accepts jobs carrying code (for the ``byoc`` right) and pre-installed jobs;
``preinstalled`` allow-lists medflare's job components and gives **no role** the ``byoc`` right. The allow-list
names exact component paths, never a package prefix: FLARE's loader calls whatever a path names with the job's
arguments, so a ``medflare.`` prefix let a code-free job call any medflare function.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Iterable

from medflare.contracts import privacy_scope
from medflare.site_config import ALLOW_JOB_DATA, SITE_CONFIG_FILE

SITE_MODES = ("byoc", "preinstalled")
# The only medflare paths a job may name, by kit kind: the classes medflare.console.job_export writes (tests check both ways)
COMPONENT_NAMESPACE = "medflare.flare."
SERVER_COMPONENTS = (
    "medflare.flare.persistor.MedflareModelPersistor",
    "medflare.flare.aggregator.MedflareAggregator",
    "medflare.flare.controller.MedflareController",
    "medflare.flare.tb_receiver.TensorBoardReceiver",
    "medflare.flare.mlflow_receiver.MlflowReceiver",
    "medflare.flare.he.EncryptedAggregator",
)
CLIENT_COMPONENTS = (
    "medflare.flare.executor.MedflareExecutor",
    "medflare.flare.tracking.SiteMetricsToServer",
    "medflare.flare.audit.PayloadRecorder",
    "medflare.flare.privacy.UpdatePrivacy",
    "medflare.flare.he.EncryptResult",
    "medflare.flare.he.DecryptTask",
)
# Folders FLARE keeps a server's submitted jobs and run snapshots in, inside the server's own kit (FLARE's
# default is the world-readable /tmp/nvflare, shared by every server on the machine).
SERVER_STORAGE = {"job_store": "jobs-storage", "snapshots": "snapshot-storage"}
STORAGE_PLACEHOLDER = "<absolute path of the server kit>"  # committed template only; install writes the real one
# Seconds without a heartbeat (sites send one every 10 s) before the server counts a site as gone; FLARE's 600
# kept a job whose site died waiting that long for the site's end-of-job report.
SITE_HEARTBEAT_TIMEOUT = 60
# Every right FLARE 2.9's default policy names (master_template.yml::default_authz), besides byoc.
NON_BYOC_RIGHTS = (
    "submit_job", "clone_job", "manage_job", "download_job", "view", "operate", "shell_commands",
    "server-predeployed-flwr",
)
DEFAULT_SCOPE = "medflare"  # applies to jobs that name no scope; checks against the job's own method
PAYLOAD_GUARD = "medflare.deploy.filters.PayloadGuard"  # bound by the site itself, so not on the job allow-list
GPU_MANAGER = "nvflare.app_common.resource_managers.gpu_resource_manager.GPUResourceManager"


def scope_name(method: str) -> str:
    """The privacy scope a job of ``method`` names in its meta.json."""
    return privacy_scope(method)


def authorization_policy(default: dict[str, Any], mode: str) -> dict[str, Any]:
    """``local/authorization.json`` from the kit's default: as is for "byoc"; "preinstalled" sets ``byoc`` to
    "none" for every role (a role's blanket "any" is expanded right by right)."""
    if mode not in SITE_MODES:
        raise ValueError(f"site mode must be one of {SITE_MODES}, got '{mode}'")
    policy = copy.deepcopy(default)
    if mode == "byoc":
        return policy
    permissions = policy["permissions"]
    for role, rights in list(permissions.items()):
        if isinstance(rights, str):  # "any" / "none" for all rights: spell them out so byoc can differ
            rights = {right: rights for right in NON_BYOC_RIGHTS}
        permissions[role] = {**rights, "byoc": "none"}
    return policy


def client_resources_policy(default: dict[str, Any], num_gpus: int = 0, mem_per_gpu_gib: int = 0) -> dict[str, Any]:
    """A site's ``local/resources.json``: the kit's default, medflare's components allow-listed, the GPUs FLARE's
    GPUResourceManager may hand to jobs (with GiB each), and no upload of the site's logs to the server."""
    policy = allow_components(default, CLIENT_COMPONENTS)
    # FLARE otherwise streams each job's log and uploads its error log (ERRORLOG_<site>) to the server, and an
    # exception message there can hold a local path (e.g. the data folder). Site logs stay at the site.
    policy["allow_log_streaming"] = False
    for component in policy.get("components", []):
        if component.get("path") == GPU_MANAGER:
            component.setdefault("args", {}).update(num_of_gpus=num_gpus, mem_per_gpu_in_GiB=mem_per_gpu_gib)
    return policy


def server_resources_policy(default: dict[str, Any], storage_root: str) -> dict[str, Any]:
    """The server's ``local/resources.json``: the kit's default, medflare's server components allow-listed,
    ``SITE_HEARTBEAT_TIMEOUT``, and the job store and snapshots inside ``storage_root`` (the server kit's absolute
    path) instead of ``/tmp/nvflare``."""
    policy = allow_components(default, SERVER_COMPONENTS)
    for server in policy.get("servers", []):
        server["heart_beat_timeout"] = SITE_HEARTBEAT_TIMEOUT
    for component in policy.get("components", []):
        if component.get("id") == "job_manager":
            component.setdefault("args", {})["uri_root"] = f"{storage_root}/{SERVER_STORAGE['job_store']}"
    snapshot_storage = policy.get("snapshot_persistor", {}).get("args", {}).get("storage", {}).get("args")
    if snapshot_storage is not None:
        snapshot_storage["root_dir"] = f"{storage_root}/{SERVER_STORAGE['snapshots']}"
    return policy


def allow_components(default: dict[str, Any], components: Iterable[str]) -> dict[str, Any]:
    """A copy of ``default`` whose enforced class allow-list holds FLARE's entries plus exactly ``components`` (any
    other ``medflare`` entry and ``"*"`` dropped)."""
    policy = copy.deepcopy(default)
    kept = [entry for entry in policy.get("class_allow_list", [])
            if entry != "*" and not entry.startswith("medflare")]
    policy["class_allow_list"] = kept + list(components)
    policy["class_list_enforcement_mode"] = "enforce"
    return policy


def privacy_policy(methods: Iterable[str]) -> dict[str, Any]:
    """``local/privacy.json``: per method a scope binding PayloadGuard as task data filter (records what the server
    sent) and as last task result filter (after ExcludeVars strips private keys; refuses anything undeclared);
    the default scope guards whatever method the job's plan names."""
    from medflare.plan import method_of

    scopes = []
    for method in methods:
        result_filters: list[dict[str, Any]] = []
        private_keys = method_of(method).payload.private_keys
        if private_keys:
            result_filters.append({"path": "nvflare.app_common.filters.exclude_vars.ExcludeVars",
                                   "args": {"exclude_vars": private_keys}})
        scopes.append(_guarded_scope(scope_name(method), method, method, result_filters))
    scopes.append(_guarded_scope(DEFAULT_SCOPE, "read from the job's plan", "", []))
    return {"format_version": "1.0", "scopes": scopes, "default_scope": DEFAULT_SCOPE}


def _guarded_scope(name: str, described_method: str, method: str, result_filters: list[dict[str, Any]]) -> dict:
    """A privacy scope with PayloadGuard(``method``) as its task data filter and last task result filter."""
    guard = {"path": PAYLOAD_GUARD, "args": {"method": method}}
    return {"name": name, "properties": {"method": described_method}, "task_data_filters": [guard],
            "task_result_filters": [*result_filters, guard]}


def site_data_config(source: str | None = None, allow_job_data: bool = False, **options: Any) -> dict[str, Any]:
    """``local/medflare_site.json``: where this hospital's images are (read by the site, never sent). ``source``
    None writes no ``data`` block; ``allow_job_data`` opts in to jobs bringing their own data (off on a hospital
    site); ``options``: data options, or ``distributed={"processes": 2}`` (:mod:`medflare.distributed`)."""
    distributed = options.pop("distributed", None)
    config: dict[str, Any] = {"data": {"source": source, **options}} if source is not None else {}
    if allow_job_data:
        config[ALLOW_JOB_DATA] = True
    if distributed:
        config["distributed"] = dict(distributed)
    return config


KIT_VERSIONS_FILE = "medflare_kit.json"  # in a kit's local/: the versions it was set up with


def install_site_policies(kit_dir: str | Path, mode: str, methods: Iterable[str] | None = None, num_gpus: int = 0,
                          mem_per_gpu_gib: int = 0, site_config: dict[str, Any] | None = None) -> list[Path]:
    """Write the policy files into one participant's kit and return their paths: authorization and resources (the
    server's job store and snapshot folders created owner-only in the kit: rerun after moving it), and for a
    client privacy scopes for ``methods`` (default: all) and ``site_config`` (its ``medflare_site.json``)."""
    from medflare.registry import list_methods

    kit = Path(kit_dir).resolve()
    if not is_site_kit(kit):
        raise FileNotFoundError(f"{kit} is not a server or site kit: no startup/fed_server.json or fed_client.json")
    local = kit / "local"
    is_client = (kit / "startup" / "fed_client.json").is_file()
    resources_default = _read(local / "resources.json.default")
    written = [
        _write(local / "authorization.json", authorization_policy(_read(local / "authorization.json.default"), mode)),
        _write(local / KIT_VERSIONS_FILE, installed_versions()),  # what `medflare preflight` compares
    ]
    if is_client:
        written.append(_write(local / "resources.json",
                              client_resources_policy(resources_default, num_gpus, mem_per_gpu_gib)))
        written.append(_write(local / "privacy.json", privacy_policy(methods or list_methods())))
        if site_config is not None:
            written.append(_write(local / SITE_CONFIG_FILE, site_config))
    else:
        written.append(_write(local / "resources.json", server_resources_policy(resources_default, str(kit))))
        for folder in SERVER_STORAGE.values():  # private: only the account that runs the server may read jobs
            (kit / folder).mkdir(mode=0o700, exist_ok=True)
            (kit / folder).chmod(0o700)
    return written


def installed_versions() -> dict[str, str]:
    """The medflare and FLARE versions installed here (a kit records those it was set up with)."""
    import nvflare

    import medflare

    return {"medflare": medflare.__version__, "nvflare": nvflare.__version__}


def is_site_kit(kit_dir: Path) -> bool:
    """True for a server or client kit (admins' kits hold no site policy)."""
    startup = kit_dir / "startup"
    return (startup / "fed_client.json").is_file() or (startup / "fed_server.json").is_file()


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: is {path.parent.parent} a FLARE 2.9 startup kit?")
    return json.loads(path.read_text())


def _write(path: Path, content: dict[str, Any]) -> Path:
    path.write_text(json.dumps(content, indent=2) + "\n")
    return path


# ----- committed policy templates (provisioning/site_local/) ----------------------------------------
POLICY_TEMPLATES_DIR = Path(__file__).resolve().parents[4] / "provisioning" / "site_local"
_TEMPLATE_KEYS = {"client": "local_client_resources", "server": "local_server_resources"}


def flare_defaults(kind: str) -> dict[str, dict[str, Any]]:
    """FLARE 2.9's own ``authorization.json.default`` and ``resources.json.default`` for a "client" or "server"
    kit, rendered from the installed nvflare's master_template.yml as ``nvflare provision`` renders them."""
    import yaml
    from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST
    from nvflare.lighter import templates

    master = yaml.safe_load((Path(templates.__file__).parent / "master_template.yml").read_text())
    resources = master[_TEMPLATE_KEYS[kind]]
    for name, value in {"class_allow_list": json.dumps(list(DEFAULT_CLASS_ALLOW_LIST)),
                        "allow_log_streaming": "true", "num_gpus": "0", "gpu_mem": "0"}.items():
        resources = resources.replace("{~~" + name + "~~}", value)
    return {"authorization.json": json.loads(master["default_authz"]), "resources.json": json.loads(resources)}


def write_policy_templates(out_dir: str | Path = POLICY_TEMPLATES_DIR) -> list[Path]:
    """Write the reviewed policy files a hospital compares with its kit's ``local/``:
    ``client/<mode>/{authorization,privacy,resources,medflare_site}.json`` and ``server/{authorization,resources}.json``."""
    from medflare.registry import list_methods

    out = Path(out_dir)
    written = []
    client = flare_defaults("client")
    for mode in SITE_MODES:
        folder = out / "client" / mode
        folder.mkdir(parents=True, exist_ok=True)
        written += [
            _write(folder / "authorization.json", authorization_policy(client["authorization.json"], mode)),
            _write(folder / "resources.json", client_resources_policy(client["resources.json"], num_gpus=0)),
            _write(folder / "privacy.json", privacy_policy(list_methods())),
            _write(folder / SITE_CONFIG_FILE, site_data_config("folder:/data/medflare/images")),
        ]
    server = flare_defaults("server")
    folder = out / "server"
    folder.mkdir(parents=True, exist_ok=True)
    written += [
        _write(folder / "authorization.json", server["authorization.json"]),
        _write(folder / "resources.json", server_resources_policy(server["resources.json"], STORAGE_PLACEHOLDER)),
    ]
    return written


def stale_policy_templates(templates_dir: str | Path = POLICY_TEMPLATES_DIR) -> list[str]:
    """Files under ``provisioning/site_local`` that differ from a fresh regeneration (empty = up to date)."""
    import filecmp
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        expected = {p.relative_to(tmp) for p in [Path(x) for x in write_policy_templates(tmp)]}
        return [f"stale or missing: {rel}" for rel in sorted(expected)
                if not (Path(templates_dir) / rel).is_file()
                or not filecmp.cmp(Path(tmp) / rel, Path(templates_dir) / rel, shallow=False)]
