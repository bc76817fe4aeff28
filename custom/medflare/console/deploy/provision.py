r"""Provision a consortium: ``nvflare provision`` writes the startup kits, then medflare's site policies go in.

Command line (what ``provisioning/provision.sh`` runs)::

    python -m medflare.console.deploy.provision -p provisioning/project.yml -w /secure/workspace \
        [--mode byoc|preinstalled] [--site-mode hospital-b=preinstalled] [--gpus hospital-a=2]
    python -m medflare.console.deploy.provision --reinstall /path/to/kit --mode preinstalled   # one existing kit

Every hospital kit also gets ``local/medflare_site.json.example``: the one file hospital IT writes, commented
(:func:`site_config_example`).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

import yaml

from medflare.console.deploy.policies import SITE_MODES, install_site_policies, is_site_kit
from medflare.console.processes import nvflare_command
from medflare.site_config import COMMENT_PREFIX, SITE_CONFIG_FILE

STATE_DIR = "state"  # <workspace>/<project>/state/cert.json: the root CA and every participant's private key
# FLARE writes <workspace>/<project name>/prod_NN/<participant name>/: each name must stay one plain folder name.
# '@' and '+' are for admins, whose names are e-mail addresses; no leading '.' rules out '.', '..' and hidden folders.
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._@+-]{0,127}")
PLAIN_NAME_RULE = ("one plain folder name (a string of letters, digits, '.', '_', '-', and '@', '+' in e-mail "
                   "addresses; no '/', not starting with '.' or '-')")


# Beside the real file in a hospital kit's local/: medflare reads only medflare_site.json, so the example never acts.
SITE_CONFIG_EXAMPLE = f"{SITE_CONFIG_FILE}.example"
# JSON has no comments: the example explains each top-level setting in a "_comment_<setting>" key before it. The
# site's loader reads site_config.SITE_FILE_KEYS (each checked field by field) and allows the comment keys
# (COMMENT_PREFIX), so they may stay in a copied file; inside a section every key is an option, so none go there.


# FLARE's HEBuilder (TenSEAL CKKS contexts for secure_aggregation=he: client_context.tenseal with the secret key in
# every site kit, server_context.tenseal without it in the server's), with its defaults: poly_modulus_degree 8192,
# coefficient moduli [60, 40, 40], scale 2**40. It must run before SignatureBuilder, which then signs the kits.
HE_BUILDER = {"path": "nvflare.lighter.impl.he.HEBuilder", "args": {}}
SIGNATURE_BUILDER = "nvflare.lighter.impl.signature.SignatureBuilder"


class ProvisionError(RuntimeError):
    """``nvflare provision`` failed or wrote no kits."""


def load_project(path: str | Path) -> dict[str, Any]:
    """A project.yml as a dict (raises a clear error when it is not one)."""
    project = yaml.safe_load(Path(path).read_text())
    if not isinstance(project, dict) or not isinstance(project.get("participants"), list):
        raise ProvisionError(f"{path} is not a FLARE project.yml (no 'participants' list)")
    check_folder_names(project, path)
    return project


def check_folder_names(project: Mapping[str, Any], path: str | Path) -> None:
    """Refuse a project or participant name that is not one plain folder name (FLARE makes folders of them, so
    ``name: ../../x`` would write kits and the CA's keys outside the workspace)."""
    named = [("name", project.get("name"))]
    named += [(f"participants[{i}].name", p.get("name") if isinstance(p, dict) else None)
              for i, p in enumerate(project["participants"])]
    for field, value in named:
        if not isinstance(value, str) or PLAIN_NAME.fullmatch(value) is None:
            raise ProvisionError(f"{path}: {field} must be {PLAIN_NAME_RULE}, got {value!r}")


def check_inside(workspace: str | Path, paths: list[Path]) -> None:
    """Refuse before writing when any path, symbolic links followed, lies outside the workspace."""
    root = Path(workspace).resolve()
    for path in paths:
        if not path.resolve().is_relative_to(root):
            raise ProvisionError(f"{path} resolves to {path.resolve()}, outside the workspace {root}; refused "
                                 "before writing there: remove that link or choose another -w")


def with_he_builder(project: Mapping[str, Any]) -> dict[str, Any]:
    """``project`` whose kits also get the TenSEAL contexts of encrypted aggregation: :data:`HE_BUILDER` inserted
    before FLARE's SignatureBuilder (which signs the contexts; FLARE's loader refuses unsigned ones), unless the
    project already has an HEBuilder."""
    builders = list(project.get("builders") or [])
    if any(b.get("path") == HE_BUILDER["path"] for b in builders):
        return dict(project)
    at = next((i for i, b in enumerate(builders) if b.get("path") == SIGNATURE_BUILDER), len(builders))
    return {**project, "builders": [*builders[:at], dict(HE_BUILDER), *builders[at:]]}


def participants(project: Mapping[str, Any], kind: str) -> list[dict[str, Any]]:
    """Participants of one type ("server", "client" or "admin"), in file order."""
    return [p for p in project["participants"] if p.get("type") == kind]


def admin_with_role(project: Mapping[str, Any], role: str) -> str:
    """The name of the first admin with ``role`` (e.g. the lead who submits jobs)."""
    for admin in participants(project, "admin"):
        if admin.get("role") == role:
            return str(admin["name"])
    raise ProvisionError(f"the project has no admin with role '{role}'")


def latest_prod_dir(workspace: str | Path, project_name: str) -> Path:
    """The newest ``<workspace>/<project>/prod_NN`` (each provisioning run writes the next NN)."""
    prods = sorted((Path(workspace) / project_name).glob("prod_[0-9][0-9]"))
    if not prods:
        raise ProvisionError(f"no startup kits under {Path(workspace) / project_name}")
    return prods[-1]


def site_config_example() -> dict[str, Any]:
    """The commented ``local/medflare_site.json.example`` of a hospital kit; valid as ``medflare_site.json`` once
    ``data.source`` names the site's images (a test loads it with the site's own loader)."""
    return {
        COMMENT_PREFIX: (
            "Example of this hospital's medflare settings, written by provisioning. Copy it to medflare_site.json "
            "in this folder (local/), the only file medflare reads, and set data.source. Each setting is explained "
            f"by the '{COMMENT_PREFIX}_<setting>' key before it; medflare reads only data, model, dp_sgd, distributed, "
            "policy and allow_job_data, so the comment keys may stay. Nothing in this file leaves the site. More: "
            "docs/deploy-hospital-admin.md and docs/deploy.md section 7."
        ),
        f"{COMMENT_PREFIX}_data": (
            "Where this hospital's images are; a job can neither name nor override these keys. source: "
            "folder:/DIR (DIR/<class>/<images>, or DIR/{train,val,test}/<class>/...), csv:/FILE.csv (columns "
            "path,label[,split][,class_name]; paths relative to the CSV), medmnist:/FILE.npz, or KIND:ARGUMENT of "
            "a data-source package installed here (docs/own-model-and-data.md); use absolute paths. identified: "
            "the class ids this site annotates, e.g. [0, 3] (the other classes become unknown in its training "
            "labels); null = every class. public_source: this site's copy of the unlabelled public set of mdhfl "
            "and fedmd, images:/DIR; empty = none. DICOM/NIfTI may add \"window\": \"40,80\" (center,width) "
            "or a preset such as \"brain\"; set here, it wins over the job's. class_map: this site's own "
            "class names -> the job's, for folders spelled differently, e.g. {\"Normal\": \"normal\"}, or null to "
            "leave a class the job does not train out, e.g. {\"cardiomegaly\": null}. This site may lack some of "
            "the job's classes: it trains on the others, numbered in the job's order."
        ),
        "data": {"source": "folder:/data/medflare/images", "identified": None, "public_source": ""},
        f"{COMMENT_PREFIX}_model": (
            "Optional, left out here: \"model\": \"NAME\" (see `medflare models`) trains that architecture at "
            "this site, for methods that send no weights (mdhfl, fedmd, local-only); a weight-averaging job "
            "refuses any model but its own."
        ),
        f"{COMMENT_PREFIX}_dp_sgd": (
            "Optional, left out here: this hospital's demands on DP-SGD (docs/privacy.md), e.g. \"dp_sgd\": "
            "{\"required\": true, \"max_epsilon\": 8, \"min_noise_multiplier\": 1.0, \"max_grad_norm\": 10, "
            "\"max_delta\": 1e-5}. A job that asks for less (no DP-SGD, less noise, a larger clipping bound or "
            "delta, a higher budget) is declined before training; once this site's epsilon would pass max_epsilon "
            "it stops contributing to the job. Needs medflare[dp] (opacus) here."
        ),
        f"{COMMENT_PREFIX}_policy": (
            "The jobs this site runs: methods = the methods it accepts (null = any); require = what every job must "
            "have, among dp_sgd, robust (the server's update-norm bound and share cap) and secure_aggregation. A "
            "job the policy refuses is declined before any image is read, with the reason. audit_log: a file in "
            "this folder (no path out of it) that gets a hash-chained JSON line at each decision, task (what left "
            "the site, its bytes, the DP epsilon spent) and job end; medflare preflight verifies it. min_class_samples: a class this site has fewer images of (in the "
            "split or group a statistic describes) is left out of every statistic it sends (0 = no floor)."
        ),
        "policy": {"methods": None, "require": ["robust"], "audit_log": "medflare_audit.jsonl", "min_class_samples": 0},
        f"{COMMENT_PREFIX}_distributed": (
            "Multi-GPU sites: processes = GPUs to train on, one process each (local/resources.json must offer "
            "them, e.g. provision --gpus SITE=2, and the job reserves them with resource_spec); backend: auto, "
            "nccl or gloo. processes 1 = ordinary training."
        ),
        "distributed": {"processes": 1, "backend": "auto"},
        f"{COMMENT_PREFIX}_allow_job_data": (
            "Leave false at a hospital. Only true lets a job bring its own data (test and POC sites); anything "
            "else refuses such jobs."
        ),
        "allow_job_data": False,
    }


def install_kit(kit: str | Path, mode: str, num_gpus: int = 0, site_config: dict | None = None) -> list[Path]:
    """medflare's policies in one server or site kit, and the commented site-file example in a hospital's kit."""
    written = install_site_policies(kit, mode, num_gpus=num_gpus, site_config=site_config)
    if (Path(kit) / "startup" / "fed_client.json").is_file():  # hospitals write a site file; the server none
        example = Path(kit) / "local" / SITE_CONFIG_EXAMPLE
        example.write_text(json.dumps(site_config_example(), indent=2) + "\n")
        written.append(example)
    return written


def install_policies(prod_dir: str | Path, default_mode: str = "byoc", site_modes: Mapping[str, str] | None = None,
                     site_gpus: Mapping[str, int] | None = None,
                     site_configs: Mapping[str, dict] | None = None) -> dict[str, list[Path]]:
    """Write site-local policies (and each hospital's site-file example) into every server and client kit of
    ``prod_dir``; returns files per kit."""
    site_modes, site_gpus, site_configs = site_modes or {}, site_gpus or {}, site_configs or {}
    return {kit.name: install_kit(kit, site_modes.get(kit.name, default_mode), num_gpus=site_gpus.get(kit.name, 0),
                                  site_config=site_configs.get(kit.name))
            for kit in sorted(p for p in Path(prod_dir).iterdir() if p.is_dir() and is_site_kit(p))}


def provision(project_yml: str | Path, workspace: str | Path, default_mode: str = "byoc",
              site_modes: Mapping[str, str] | None = None, site_gpus: Mapping[str, int] | None = None,
              he: bool = False) -> Path:
    """Run ``nvflare provision`` and install medflare's site policies; return the new ``prod_NN`` folder.

    ``he``: the kits also get the TenSEAL contexts of encrypted aggregation (:func:`with_he_builder`; the project
    file given is provisioned from a copy in the workspace that adds FLARE's HEBuilder)."""
    project = load_project(project_yml)
    unknown = set(site_modes or {}) | set(site_gpus or {})
    unknown -= {p["name"] for p in project["participants"]}
    if unknown:
        raise ProvisionError(f"--site-mode/--gpus name participants not in {project_yml}: {sorted(unknown)}")
    Path(workspace).mkdir(parents=True, exist_ok=True)
    project_dir = Path(workspace) / project["name"]
    check_inside(workspace, [project_dir])  # e.g. a link left in the workspace: FLARE would write through it
    if he:
        project_yml = Path(workspace) / f"{project['name']}.he.yml"
        project_yml.write_text(yaml.safe_dump(with_he_builder(project), sort_keys=False))
    proc = subprocess.run(nvflare_command() + ["provision", "-p", str(project_yml), "-w", str(workspace)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ProvisionError(f"nvflare provision failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    check_inside(workspace, [project_dir, *project_dir.rglob("*")])  # before chmod and the policies write
    protect_secrets(project_dir)
    prod_dir = latest_prod_dir(workspace, project["name"])
    install_policies(prod_dir, default_mode, site_modes, site_gpus)
    return prod_dir


def protect_secrets(project_dir: str | Path) -> list[Path]:
    """Make what ``nvflare provision`` wrote readable by its owner only (the project folder and ``state/`` 0700, its
    files 0600: FLARE writes ``state/cert.json``, the root CA's and every participant's key, 0644); return those."""
    project = Path(project_dir)
    project.chmod(0o700)
    state = project / STATE_DIR
    if not state.is_dir():
        return []
    state.chmod(0o700)
    files = sorted(p for p in state.iterdir() if p.is_file())
    for path in files:
        path.chmod(0o600)
    return files


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{flag} expects NAME=VALUE, got '{item}'")
        pairs[name] = value
    return pairs


def main(argv: list[str] | None = None) -> int:
    """``python -m medflare.console.deploy.provision``: startup kits for a project, with each site's policies."""
    parser = argparse.ArgumentParser(description="Provision a medflare consortium (startup kits + site policies).")
    parser.add_argument("-p", "--project", help="project.yml")
    parser.add_argument("-w", "--workspace", help="folder for the kits (keep it private)")
    parser.add_argument("--mode", choices=SITE_MODES, default="byoc", help="site mode for every site (default byoc)")
    parser.add_argument("--site-mode", action="append", default=[], metavar="SITE=MODE",
                        help="per-site override, e.g. hospital-b=preinstalled")
    parser.add_argument("--gpus", action="append", default=[], metavar="SITE=N",
                        help="GPUs a site offers to jobs (resources.json), e.g. hospital-a=2")
    parser.add_argument("--he", action="store_true",
                        help="also write the TenSEAL contexts of encrypted aggregation (FLARE's HEBuilder) into the "
                             "kits, for jobs with secure_aggregation=he")
    parser.add_argument("--reinstall", metavar="KIT",
                        help="only rewrite medflare's policies in one existing kit with --mode (e.g. after moving "
                             "the server kit, whose job store path is absolute)")
    args = parser.parse_args(argv)
    if args.reinstall:
        try:
            written = install_kit(args.reinstall, args.mode)
        except FileNotFoundError as exc:
            print(f"provision: error: {exc}", file=sys.stderr)
            return 2
        for path in written:
            print(f"wrote {path}")
        return 0
    if not (args.project and args.workspace):
        parser.error("-p/--project and -w/--workspace are required (or --reinstall KIT)")
    site_modes = _pairs(args.site_mode, "--site-mode")
    bad = {m for m in site_modes.values() if m not in SITE_MODES}
    if bad:
        parser.error(f"--site-mode values must be one of {SITE_MODES}, got {sorted(bad)}")
    site_gpus = {name: int(n) for name, n in _pairs(args.gpus, "--gpus").items()}
    try:
        prod_dir = provision(args.project, args.workspace, args.mode, site_modes, site_gpus, he=args.he)
    except ProvisionError as exc:
        print(f"provision: error: {exc}", file=sys.stderr)
        return 2
    print(f"startup kits with medflare site policies: {prod_dir}")
    for kit in sorted(prod_dir.iterdir()):
        if kit.is_dir():
            print(f"  {kit.name}")
    print("send each kit to its owner only (it holds that participant's private key).")
    ca_state = prod_dir.parent / STATE_DIR / "cert.json"
    print(f"{ca_state} (mode 0600) holds the root CA key and every participant's key: move it to offline storage "
          "and bring it back only to provision again (new sites or people) with the same CA.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
