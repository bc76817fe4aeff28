"""Site-local FLARE policies for a medflare consortium: who may do what, what may leave, what may run.

A provisioned startup kit ships FLARE's defaults as ``local/*.default``. These helpers derive the files a
hospital actually uses (``local/authorization.json``, ``local/privacy.json``, ``local/resources.json`` and
medflare's own ``local/medflare_site.json``) from those defaults, so FLARE's own entries are kept and only
medflare's additions are layered on top.

Two site modes:
- ``byoc``: the site accepts jobs that carry code (the submitter needs the ``byoc`` right) *and* pre-installed
  jobs (``medflare.`` is allow-listed).
- ``preinstalled``: the site runs only the reviewed medflare wheel it installed itself: ``medflare.`` is
  allow-listed and **no role** has the ``byoc`` right, so a job carrying ``custom/`` code is refused at deploy.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Iterable

from medflare.contracts import privacy_scope
from medflare.site_runtime import SITE_CONFIG_FILE

SITE_MODES = ("byoc", "preinstalled")
ALLOW_LIST_PREFIX = "medflare."  # every server/client component and the model builder live under it
# Every right FLARE 2.9's default policy names (master_template.yml::default_authz), besides byoc.
NON_BYOC_RIGHTS = (
    "submit_job", "clone_job", "manage_job", "download_job", "view", "operate", "shell_commands",
    "server-predeployed-flwr",
)
DEFAULT_SCOPE = "medflare"  # applies to jobs that name no scope; checks against the job's own method
GPU_MANAGER = "nvflare.app_common.resource_managers.gpu_resource_manager.GPUResourceManager"


def scope_name(method: str) -> str:
    """The privacy scope a job of ``method`` names in its meta.json."""
    return privacy_scope(method)


def authorization_policy(default: dict[str, Any], mode: str) -> dict[str, Any]:
    """``local/authorization.json``: FLARE's default roles, with BYOC switched off on pre-installed sites.

    Args:
        default: the kit's ``authorization.json.default``.
        mode: "byoc" keeps FLARE's default (project_admin and lead may bring code); "preinstalled" sets
            ``byoc`` to "none" for every role, including project_admin (whose "any" is expanded right by right).
    """
    _check_mode(mode)
    policy = copy.deepcopy(default)
    if mode == "byoc":
        return policy
    permissions = policy["permissions"]
    for role, rights in list(permissions.items()):
        if isinstance(rights, str):  # "any" / "none" for all rights: spell them out so byoc can differ
            rights = {right: rights for right in NON_BYOC_RIGHTS}
        permissions[role] = {**rights, "byoc": "none"}
    return policy


def resources_policy(default: dict[str, Any], num_gpus: int = 0, mem_per_gpu_gib: int = 0) -> dict[str, Any]:
    """``local/resources.json``: FLARE's defaults plus ``medflare.`` on the class allow-list and the site's GPUs.

    Args:
        default: the kit's ``resources.json.default`` (keeps FLARE's own allow-list entries and components).
        num_gpus: GPUs FLARE may hand to jobs on this site (its GPUResourceManager); jobs reserve them with
            ``resource_spec`` in meta.json and FLARE sets CUDA_VISIBLE_DEVICES for the job process.
        mem_per_gpu_gib: memory per GPU in GiB that jobs may request.
    """
    policy = copy.deepcopy(default)
    allow_list = list(policy.get("class_allow_list", []))
    if ALLOW_LIST_PREFIX not in allow_list and "*" not in allow_list:
        allow_list.append(ALLOW_LIST_PREFIX)
    policy["class_allow_list"] = allow_list
    policy.setdefault("class_list_enforcement_mode", "enforce")  # never "warn" on a hospital site
    for component in policy.get("components", []):
        if component.get("path") == GPU_MANAGER:
            component.setdefault("args", {}).update(num_of_gpus=num_gpus, mem_per_gpu_in_GiB=mem_per_gpu_gib)
    return policy


def privacy_policy(methods: Iterable[str]) -> dict[str, Any]:
    """``local/privacy.json``: one scope per method whose result filters enforce that method's Payload.

    Each ``medflare-<method>`` scope first strips the method's private keys (FLARE's ExcludeVars, when the
    method declares any) and then refuses any result with undeclared arrays or meta (PayloadGuard). The
    default scope applies the guard for whatever method the job's config names.
    """
    from medflare.registry import get_method

    scopes = []
    for method in methods:
        filters: list[dict[str, Any]] = []
        private_keys = get_method(method).payload.private_keys
        if private_keys:
            filters.append({"path": "nvflare.app_common.filters.exclude_vars.ExcludeVars",
                            "args": {"exclude_vars": private_keys}})
        filters.append({"path": "medflare.deploy.filters.PayloadGuard", "args": {"method": method}})
        scopes.append({"name": scope_name(method), "properties": {"method": method}, "task_result_filters": filters})
    scopes.append({
        "name": DEFAULT_SCOPE,
        "properties": {"method": "read from the job's client config"},
        "task_result_filters": [{"path": "medflare.deploy.filters.PayloadGuard", "args": {"method": ""}}],
    })
    return {"format_version": "1.0", "scopes": scopes, "default_scope": DEFAULT_SCOPE}


def site_data_config(source: str, **options: Any) -> dict[str, Any]:
    """``local/medflare_site.json``: where this hospital's images are (read by the site, never sent).

    Args:
        source: "folder:/path", "csv:/path/manifest.csv" or "medmnist:/path/file.npz" (or a synthetic spec
            for a demo site).
        options: extra data options (e.g. ``val_fraction``), or ``distributed={"processes": 2}`` for a
            multi-GPU site (see :mod:`medflare.distributed`).
    """
    distributed = options.pop("distributed", None)
    config: dict[str, Any] = {"data": {"source": source, **options}}
    if distributed:
        config["distributed"] = dict(distributed)
    return config


def install_site_policies(
    kit_dir: str | Path,
    mode: str,
    methods: Iterable[str] | None = None,
    num_gpus: int = 0,
    mem_per_gpu_gib: int = 0,
    site_config: dict[str, Any] | None = None,
) -> list[Path]:
    """Write the site-local policy files into one participant's startup kit and return their paths.

    The server gets authorization and resources (it builds the medflare controller, aggregator and
    persistor, so pre-installed jobs need ``medflare.`` allow-listed there too); a client also gets privacy
    and, when given, its ``medflare_site.json``.

    Args:
        kit_dir: the participant's kit folder (holding ``startup/`` and ``local/``).
        mode: "byoc" or "preinstalled" (see the module docstring).
        methods: methods to write privacy scopes for (default: every registered method).
        num_gpus: GPUs this site offers to jobs.
        mem_per_gpu_gib: memory per GPU in GiB.
        site_config: the site's ``medflare_site.json`` content (clients only), e.g. from site_data_config().
    """
    from medflare.registry import list_methods

    local = Path(kit_dir) / "local"
    is_client = (Path(kit_dir) / "startup" / "fed_client.json").is_file()
    written = [
        _write(local / "authorization.json", authorization_policy(_read(local / "authorization.json.default"), mode)),
        _write(local / "resources.json",
               resources_policy(_read(local / "resources.json.default"), num_gpus, mem_per_gpu_gib)),
    ]
    if is_client:
        written.append(_write(local / "privacy.json", privacy_policy(methods or list_methods())))
        if site_config is not None:
            written.append(_write(local / SITE_CONFIG_FILE, site_config))
    return written


def is_site_kit(kit_dir: Path) -> bool:
    """True for a server or client kit (admins' kits hold no site policy)."""
    startup = kit_dir / "startup"
    return (startup / "fed_client.json").is_file() or (startup / "fed_server.json").is_file()


def _check_mode(mode: str) -> None:
    if mode not in SITE_MODES:
        raise ValueError(f"site mode must be one of {SITE_MODES}, got '{mode}'")


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: is {path.parent.parent} a FLARE 2.9 startup kit?")
    return json.loads(path.read_text())


def _write(path: Path, content: dict[str, Any]) -> Path:
    path.write_text(json.dumps(content, indent=2) + "\n")
    return path


# ----- committed policy templates (provisioning/site_local/) ----------------------------------------
POLICY_TEMPLATES_DIR = Path(__file__).resolve().parents[3] / "provisioning" / "site_local"
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
    """Write the reviewed policy files a hospital compares with (or copies into) its kit's ``local/``.

    Layout: ``client/<mode>/{authorization,privacy,resources,medflare_site}.json`` and
    ``server/{authorization,resources}.json``.
    """
    from medflare.registry import list_methods

    out = Path(out_dir)
    written = []
    client = flare_defaults("client")
    for mode in SITE_MODES:
        folder = out / "client" / mode
        folder.mkdir(parents=True, exist_ok=True)
        written += [
            _write(folder / "authorization.json", authorization_policy(client["authorization.json"], mode)),
            _write(folder / "resources.json", resources_policy(client["resources.json"], num_gpus=0)),
            _write(folder / "privacy.json", privacy_policy(list_methods())),
            _write(folder / SITE_CONFIG_FILE, site_data_config("folder:/data/medflare/images")),
        ]
    server = flare_defaults("server")
    folder = out / "server"
    folder.mkdir(parents=True, exist_ok=True)
    written += [
        _write(folder / "authorization.json", server["authorization.json"]),
        _write(folder / "resources.json", resources_policy(server["resources.json"])),
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
