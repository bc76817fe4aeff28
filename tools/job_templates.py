"""``job_templates/<method>/``: one FLARE job template per registered method, written from the same builders
as ``medflare export`` (``server_config``/``client_config``/``meta_config`` and the plan file), the configs as
commented HOCON.

A template is the job a consortium deploys (site-local data, the method's paper defaults, the deployment's robust
defences): ``nvflare job create`` copies it, with the medflare package for BYOC, into a job ready to submit.
Every medflare component of it reads the job's plan, ``app/config/medflare_plan.json``, so the FLARE configs hold
no settings to vary; a value is changed in the plan (every site types and checks it again) or, for anything the
plan derives (rounds, method, sites), by writing the job with ``medflare export``. Every template documents
:func:`example_command` (its header and info.md), and a test runs that command verbatim:

    nvflare job create -j jobs/fedprox -w job_templates/fedprox -sd custom -force

Command line: ``python tools/job_templates.py`` rewrites ``job_templates/``; ``--check`` reports drift.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Mapping

from medflare.console.deploy.apps import deployment_plan, stale_files, write_per_method

REPO_DIR = Path(__file__).resolve().parents[1]
TEMPLATES_DIR = REPO_DIR / "job_templates"
# One comment per key name (or dotted path when a name means different things in different places).
COMMENTS: dict[str, str] = {
    # shared
    "format_version": "FLARE job-config format version (2 for FLARE 2.x)",
    "np_download_chunk_size": "bytes per request when the other side pulls this side's arrays (FLARE default 2 MiB;"
                              " 16 MiB keeps a slow link busy)",
    "id": "component id other components refer to",
    "path": "class FLARE builds; pre-installed sites allow-list exactly this path",
    "args": "constructor arguments of the class above",
    "plan_file": "the job's plan in app/config (medflare_plan.json): everything this component runs; edit "
                 "values there, not here",
    "task_data_filters": "job-level filters on data sent to sites (site privacy.json filters apply on top)",
    "task_result_filters": "job-level filters on results (site privacy.json filters apply on top)",
    "components": "helper components the workflow uses",
    # server
    "server": "server runtime settings",
    "heart_beat_timeout": "seconds without a site heartbeat before the site counts as gone",
    "task_request_interval": "seconds sites wait between task polls (FLARE default 2.0; 0.1 keeps rounds short)",
    "workflows": "server workflows, run in order",
    "persistor_id": "id of the model persistor component",
    "aggregator_id": "id of the aggregator component",
    # client
    "executors": "site-side executors; one medflare executor handles every task",
    "tasks": "task names this executor handles (* = all)",
    "executor": "the medflare executor (runs the method's local training at the site)",
    # meta
    "name": "job name shown by `nvflare job list`",
    "resource_spec": "resources each site must reserve, e.g. {site-1 {num_of_gpus = 2}} for a multi-GPU site",
    "deploy_map": "which app goes to which participant",
    "app": "the one app, deployed to the server and every site",
    "scope": "privacy scope sites apply (medflare-<method>: the method's result filters in local/privacy.json)",
    "min_clients": "valid site updates each round needs (the plan's min_clients)",
    "robust_aggregation": "for reviewers: the robust defences this job was written with; the plan's robust decides",
    "on": "whether any robust defence is on (off: one site can take over the aggregate)",
    "max_norm_ratio": "reject an update whose norm exceeds this multiple of the other sites' median (0 = off)",
    "max_share": "cap on one site's share of the aggregate; relaxes to equal shares when infeasible (0 = off)",
    "rule": "how the server combines the kept updates (mean, median, trimmed_mean, krum, multi_krum, bulyan)",
    "secure_aggregation": "homomorphic encryption of the updates (he) or off",
    # info
    "description": "what this template is for",
    "execution_api_type": "how client code runs: a classic FLARE Executor",
    "controller_type": "where the workflow runs",
}


def template_plan(method: str) -> Any:
    """The plan a template is written for: :func:`medflare.console.deploy.apps.deployment_plan`'s (site-local data, the
    declared task, the deployment's defences), as a pre-installed deployment's job carries it."""
    return deployment_plan(method)


def write_template(method: str, out_dir: str | Path) -> Path:
    """Write ``out_dir/<method>/`` (info.conf, info.md, meta.conf, client and server configs)."""

    from medflare.console.files import write_recorded

    return write_recorded(Path(out_dir), method, lambda folder: _fill_template(method, folder))


def _fill_template(method: str, folder: Path) -> None:
    """The template's files into the empty ``folder``."""
    from medflare.console.job_export import client_config, meta_config, server_config
    from medflare.plan import write_plan

    plan = template_plan(method)
    info = {
        "description": f"medflare {method}: {_summary(method)}",
        "execution_api_type": "executor",
        "controller_type": "server",
    }
    files = {
        "info.conf": (info, "how `nvflare job list-templates` describes this template"),
        "meta.conf": (meta_config(plan), "job meta: name, participants, resources, privacy scope"),
        "config_fed_server.conf": (server_config(plan), "server: persistor, aggregator, round controller"),
        "config_fed_client.conf": (client_config(plan), "site: the medflare executor"),
    }
    example = "\n".join(f"#   {line}" for line in example_command(method).splitlines())
    for name, (content, title) in files.items():
        header = (f"# medflare {method} job template - {title}.\n# Generated by `make templates`; do not edit.\n"
                  f"# Make a job from it (every setting is in medflare_plan.json beside this file):\n{example}\n")
        (folder / name).write_text(header + to_hocon(content) + "\n")
    write_plan(plan, folder)
    paths = component_paths([files["config_fed_server.conf"][0], files["config_fed_client.conf"][0]])
    (folder / "info.md").write_text(info_markdown(method, plan, paths))


def example_command(method: str) -> str:
    """The documented ``nvflare job create`` call for a method's template, as a user types it (from the repo root)."""
    return f"nvflare job create -j jobs/{method} -w job_templates/{method} -sd custom -force"


def write_templates(out_dir: str | Path = TEMPLATES_DIR, methods: list[str] | None = None) -> list[Path]:
    """Rewrite the template of every registered method; drop templates of removed methods."""
    from medflare.registry import list_methods

    return write_per_method(out_dir, methods or list_methods(), write_template)


def stale_templates(templates_dir: str | Path = TEMPLATES_DIR) -> list[str]:
    """Files that differ from a fresh regeneration; empty when up to date."""
    return stale_files(write_templates, templates_dir)


def to_hocon(value: Any, indent: int = 0, parent: str = "") -> str:
    """Render a JSON-like value as HOCON with a comment above every key (:data:`COMMENTS`; ``parent``: the
    enclosing key)."""
    pad = "  " * indent
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        lines = ["{"]
        for key, item in value.items():
            for comment_line in _comment(str(key), parent).splitlines():
                lines.append(f"{pad}  # {comment_line}")
            lines.append(f"{pad}  {_key(str(key))} = {to_hocon(item, indent + 1, str(key))}")
        lines.append(f"{pad}}}")
        return "\n".join(lines)
    if isinstance(value, (list, tuple)):
        if not value or all(not isinstance(v, (Mapping, list, tuple)) for v in value):
            return json.dumps(list(value))
        items = [f"{pad}  {to_hocon(v, indent + 1, parent)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(value)


def component_paths(configs: list[Any]) -> list[str]:
    """Every component ``path`` the configs name, in order of first appearance: what a site must allow-list."""
    found: list[str] = []
    pending = list(configs)
    while pending:
        value = pending.pop(0)
        if isinstance(value, Mapping):
            if isinstance(value.get("path"), str) and value["path"] not in found:
                found.append(value["path"])
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return found


def info_markdown(method: str, plan: Any, paths: list[str]) -> str:
    """info.md: a card for the template; ``paths`` are its component paths (:func:`component_paths`)."""
    listed = "\n".join(f"- `{path}`" for path in paths)
    hyper = ", ".join(f"`{k}={v}`" for k, v in plan.method_args.items()) or "none"
    return f"""# medflare `{method}` job template

{_summary(method)}

Server: `MedflareModelPersistor` (FLARE's PT persistor), `MedflareAggregator`, `MedflareController`.
Site: `MedflareExecutor` (all tasks). Each takes one argument, `plan_file`: the job's plan,
`app/config/medflare_plan.json`, which holds everything the job does (`medflare config --plan` prints one). A
pre-installed site allow-lists each component path exactly, never a package prefix: FLARE calls whatever a
`path` names with the job's `args`, so a prefix such as `medflare.` lets a code-free job call any medflare function
(one rewrote a site's `authorization.json`). `python -m medflare.console.deploy.provision --mode preinstalled` writes the
exact list into every kit's `local/resources.json` (`docs/deploy.md` §3). The paths this template names:

{listed}

The job is the one a consortium deploys: {len(plan.sites)} sites, each reading its own images
(`"data": {{"source": "site"}}`), {len(plan.rounds)} rounds, at least {plan.min_clients} valid updates a round, the
task {plan.task.num_classes} classes of {plan.task.in_channels} channel(s) at {plan.task.image_size} px, the
method's defaults ({hyper}), and the server's robust defences on ({_robust_text(plan.robust)}; turning them off:
`docs/deploy-lead.md`).

## Make a job

```bash
{example_command(method)}
```

`-sd custom` copies the medflare package into the job (BYOC). For a pre-installed consortium submit the same job
without `app/custom/` (or use `apps/{method}/`).

## Change it

Values are changed in `jobs/{method}/app/config/medflare_plan.json`, not in the FLARE configs: e.g. a site's
`train.lr` or `train.batch_size`, `patience`, `task`, `robust`. The server and every site type and check each
value again when they load the plan, and log its fingerprint, marked as edited. What the plan derives from other
settings (the rounds and their stages, the method, the sites) is written by the one resolver instead:
`medflare export {method} -o jobs/ --mode preinstalled --data site --rounds 5 --clients 3 --set task.num_classes=2
--set task.in_channels=1 --set task.image_size=28` (every command in `docs/deploy-lead.md`).

Site data paths never go into the job in production: each hospital writes
`{{"data": {{"source": "folder:/data/..."}}}}` into its own `local/medflare_site.json`.
"""


def _comment(key: str, parent: str) -> str:
    if key.startswith("site-"):
        return f"for {key}"
    if key in COMMENTS:
        return COMMENTS[key]
    raise KeyError(f"no comment for template key '{key}' (under '{parent}'): add one to COMMENTS")


def _robust_text(robust: Mapping[str, Any]) -> str:
    return ", ".join(f"`{key}={value:g}`" if isinstance(value, (int, float)) else f"`{key}={value}`"
                     for key, value in robust.items())


def _key(key: str) -> str:
    return key if key.replace("_", "").isalnum() else json.dumps(key)


def _summary(method: str) -> str:
    from medflare.registry import get_method

    return get_method(method).summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write (or --check) job_templates/<method>/ for every method.")
    parser.add_argument("-o", "--output", default=str(TEMPLATES_DIR))
    parser.add_argument("--check", action="store_true", help="only report stale files; exit 1 if any")
    args = parser.parse_args(argv)
    if args.check:
        differences = stale_templates(args.output)
        print("\n".join(differences))
        return 1 if differences else 0
    for folder in write_templates(args.output):
        print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
