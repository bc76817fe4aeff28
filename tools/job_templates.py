"""``job_templates/<method>/``: one FLARE job template per registered method, written from the same builders
as ``medflare export`` (``server_config``/``client_config``/``meta_config``), as commented HOCON.

Every key carries a comment. Variables are plain keys: ``nvflare job create -f config_fed_server.conf
num_rounds=5`` sets *every* ``num_rounds`` in that file, so the aggregator and the controller stay in step.
FLARE parses each value as HOCON, so a value holding ``:`` or ``=`` (a data spec) must be quoted twice, once
for the shell and once for HOCON. Every template documents :func:`example_command` (its header and info.md),
and a test runs that command verbatim and the job it makes:

    nvflare job create -j jobs/fedprox -w job_templates/fedprox -sd custom \\
        -f config_fed_client.conf 'source="synthetic:n=400,classes=2,channels=1"' partition=iid max_steps=5 \\
        -f config_fed_server.conf num_rounds=3 -force

Command line: ``python tools/job_templates.py`` rewrites ``job_templates/``; ``--check`` reports drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping

from medflare.deploy.apps import DEPLOY_TASK, deployment_run, stale_files, write_per_method

REPO_DIR = Path(__file__).resolve().parents[1]
TEMPLATES_DIR = REPO_DIR / "job_templates"
# Simulated data for trying a template: the declared task's classes and channels (DEPLOY_TASK: 2 classes,
# 1 channel, 28 px; the generator's default is 5 classes, 3 channels), so the default task and the data agree.
EXAMPLE_SOURCE = "synthetic:n=400,classes={num_classes},channels={in_channels}".format(**DEPLOY_TASK)
# The variables of the documented `nvflare job create` example, per config file
EXAMPLE_VARIABLES = {
    "config_fed_client.conf": {"source": f'"{EXAMPLE_SOURCE}"', "partition": "iid", "max_steps": "5"},
    "config_fed_server.conf": {"num_rounds": "3"},
}

# One comment per key name (or dotted path when a name means different things in different places).
COMMENTS: dict[str, str] = {
    # shared
    "format_version": "FLARE job-config format version (2 for FLARE 2.x)",
    "np_download_chunk_size": "bytes per request when the other side pulls this side's arrays (FLARE default 2 MiB;"
                              " 16 MiB keeps a slow link busy)",
    "id": "component id other components refer to",
    "path": "class (or function) FLARE builds; pre-installed sites allow-list exactly this path",
    "args": "constructor arguments of the class above",
    "method": "registered medflare method; must be the same in the client and server config",
    "model": "model factory name (`medflare models`); same on client and server",
    "method_args": "the method's hyperparameters; same values in the client and server config",
    "seed": "seed for the initial model and for simulated data partitions",
    "num_classes": "VARIABLE: number of classes of the task (same on client and server)",
    "in_channels": "VARIABLE: image channels (1 = grey, 3 = RGB)",
    "image_size": "VARIABLE: image side in pixels after resizing",
    "task_data_filters": "job-level filters on data sent to sites (site privacy.json filters apply on top)",
    "task_result_filters": "job-level filters on results (site privacy.json filters apply on top)",
    "components": "helper components the workflow uses",
    # server
    "server": "server runtime settings",
    "heart_beat_timeout": "seconds without a site heartbeat before the site counts as gone",
    "task_request_interval": "seconds sites wait between task polls (FLARE default 2.0; 0.1 keeps rounds short)",
    "pretrained": "null, 'imagenet' (efficientnet_lite0) or a weights file on the server",
    "num_rounds": "VARIABLE: federated rounds (set for the aggregator and the controller at once)",
    "workflows": "server workflows, run in order",
    "min_clients": "VARIABLE: valid site updates each round needs; fewer stops the job with an error",
    "persistor_id": "id of the model persistor component",
    "aggregator_id": "id of the aggregator component",
    "shot_groups": "null, or {head, medium, tail} class ids for long-tail metrics",
    "wait_time_after_min_received": "seconds stragglers may take once min_clients sites answered",
    "robust": "defences against one site taking over or breaking the aggregate (docs/architecture.md)",
    "max_norm_ratio": "reject an update whose norm exceeds this multiple of the other sites' median (0 = off)",
    "max_share": "cap on one site's share of the aggregate; relaxes to equal shares when infeasible (0 = off)",
    "stream_aggregation": "sum results in site order as they arrive instead of holding every site's copy; linear "
                          "rules without robust's checks only, else one batch (docs/architecture.md)",
    "facts": "what every saved global model file records about this job (medflare predict reads it); derived "
             "from the settings here: change those, not these",
    "train_timeout": "seconds a site may take for one task; later, it counts as failed for that round",
    "patience": "VARIABLE: stop early after this many rounds without a better validation score (0 = never)",
    "stream_metrics": "the site streams its training loss per local epoch to the server's tracking receivers",
    # client
    "executors": "site-side executors; one medflare executor handles every task",
    "tasks": "task names this executor handles (* = all)",
    "executor": "the medflare executor (runs the method's local training at the site)",
    "task": "the task's facts shared with the server (no data, no paths)",
    "train": "local training settings (optimizer, lr, batch size, epochs, max_steps, ...)",
    "data": "where site images come from",
    "source": "VARIABLE: 'site' = each site reads its own local/medflare_site.json; or a path/spec used by "
              f"every site (folder:DIR, csv:FILE, medmnist:FILE.npz, {EXAMPLE_SOURCE}) for POC and tests; "
              "on the nvflare command line quote it twice: 'source=\"synthetic:classes=2,channels=1\"'",
    "partition": "VARIABLE: how a shared source is split across sites (iid, dirichlet:0.5, ...); ignored for 'site'",
    "num_sites": "VARIABLE: number of sites a shared source is split across (= length of sites)",
    "sites": "VARIABLE: site names in order (decides each site's slice of a shared source)",
    "site_train": "per-site training overrides, e.g. {site-2 {batch_size = 16}} for a smaller GPU",
    # meta
    "name": "job name shown by `nvflare job list`",
    "resource_spec": "resources each site must reserve, e.g. {site-1 {num_of_gpus = 2}} for a multi-GPU site",
    "deploy_map": "which app goes to which participant",
    "app": "the one app, deployed to the server and every site",
    "scope": "privacy scope sites apply (medflare-<method>: the method's result filters in local/privacy.json)",
    "robust_aggregation": "for reviewers: the robust defences this job was written with; config_fed_server.conf's "
                          "robust decides, so change both together (docs/deploy-lead.md)",
    "on": "whether any robust defence is on (off: one site can take over the aggregate)",
    # info
    "description": "what this template is for",
    "execution_api_type": "how client code runs: a classic FLARE Executor",
    "controller_type": "where the workflow runs",
}
TRAIN_COMMENT = "VARIABLE: local training setting (TrainConfig in methods/base.py)"


def template_run(method: str) -> Any:
    """The run a template is written for: site-local data and the method's full training defaults spelled out."""
    run = deployment_run(method)
    run.train = dataclasses.asdict(run.train_config())
    run.method_args = dataclasses.asdict(_method_config(method))
    return run


def template_data(run: Any) -> dict[str, Any]:
    """The client's data block in a template: site-local by default, every shared-source key present."""
    return {"source": "site", "partition": "iid", "num_sites": run.clients, "seed": run.seed}


def write_template(method: str, out_dir: str | Path) -> Path:
    """Write ``out_dir/<method>/`` (info.conf, info.md, meta.conf, client and server configs)."""

    from medflare.files import write_recorded

    return write_recorded(Path(out_dir), method, lambda folder: _fill_template(method, folder))


def _fill_template(method: str, folder: Path) -> None:
    """The template's files into the empty ``folder``."""
    from medflare.job_export import client_config, job_plan, meta_config, server_config
    from medflare.site_config import TaskSpec

    run = template_run(method)
    task = TaskSpec(**DEPLOY_TASK)
    plan = job_plan(run, task)
    meta = meta_config(plan)
    client = client_config(plan)
    # Spell out the shared-source keys so `source=... partition=...` are plain variables; a site reading its
    # own local/medflare_site.json ignores them.
    client["executors"][0]["executor"]["args"]["data"] = template_data(run)
    method_keys = set(run.method_args)
    info = {
        "description": f"medflare {method}: {_summary(method)}",
        "execution_api_type": "executor",
        "controller_type": "server",
    }
    files = {
        "info.conf": (info, "how `nvflare job list-templates` describes this template"),
        "meta.conf": (meta, "job meta: name, participants, resources, privacy scope"),
        "config_fed_server.conf": (server_config(plan), "server: persistor, aggregator, round controller"),
        "config_fed_client.conf": (client, "site: the medflare executor"),
    }
    example = "\n".join(f"#   {line}" for line in example_command(method).splitlines())
    for name, (content, title) in files.items():
        header = (f"# medflare {method} job template - {title}.\n# Generated by `make templates`; do not edit.\n"
                  f"# Make a job from it (the task's own simulated data; site data: source=site):\n{example}\n")
        (folder / name).write_text(header + to_hocon(content, method_keys) + "\n")
    paths = component_paths([files["config_fed_server.conf"][0], files["config_fed_client.conf"][0]])
    (folder / "info.md").write_text(info_markdown(method, run, paths))


def example_command(method: str) -> str:
    """The documented ``nvflare job create`` call for a method's template, as a user types it (from the repo root)."""
    lines = [f"nvflare job create -j jobs/{method} -w job_templates/{method} -sd custom \\"]
    for file_name, variables in EXAMPLE_VARIABLES.items():
        settings = " ".join(shlex.quote(f"{key}={value}") for key, value in variables.items())
        lines.append(f"    -f {file_name} {settings} \\")
    lines[-1] = lines[-1].removesuffix(" \\") + " -force"
    return "\n".join(lines)


def write_templates(out_dir: str | Path = TEMPLATES_DIR, methods: list[str] | None = None) -> list[Path]:
    """Rewrite the template of every registered method; drop templates of removed methods."""
    from medflare.registry import list_methods

    return write_per_method(out_dir, methods or list_methods(), write_template)


def stale_templates(templates_dir: str | Path = TEMPLATES_DIR) -> list[str]:
    """Files that differ from a fresh regeneration; empty when up to date."""
    return stale_files(write_templates, templates_dir)


def to_hocon(value: Any, method_keys: set[str], indent: int = 0, parent: str = "", owner: str = "") -> str:
    """Render a JSON-like value as HOCON with a comment above every key.

    Args:
        value: dict/list/scalar to render.
        method_keys: the method's hyperparameter names (commented as variables).
        indent: current indentation level.
        parent: the enclosing key (decides how children of ``train``/``method_args`` are commented).
        owner: class path of the component whose ``args`` are being rendered (for keys COMMENTS lacks).
    """
    pad = "  " * indent
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        lines = ["{"]
        child_owner = str(value.get("path", owner))
        for key, item in value.items():
            for comment_line in _comment(str(key), parent, method_keys, item, owner).splitlines():
                lines.append(f"{pad}  # {comment_line}")
            child_parent = "train" if parent == "stages" else str(key)  # a stage's options are train options
            if key == "facts":  # recorded values, not settings: one JSON line under one comment
                rendered = json.dumps(item)
            else:
                rendered = to_hocon(item, method_keys, indent + 1, child_parent, child_owner if key == "args" else owner)
            lines.append(f"{pad}  {_key(str(key))} = {rendered}")
        lines.append(f"{pad}}}")
        return "\n".join(lines)
    if isinstance(value, (list, tuple)):
        if not value or all(not isinstance(v, (Mapping, list, tuple)) for v in value):
            return json.dumps(list(value))
        items = [f"{pad}  {to_hocon(v, method_keys, indent + 1, parent, owner)}" for v in value]
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


def info_markdown(method: str, run: Any, paths: list[str]) -> str:
    """info.md: a card for the template; ``paths`` are its component paths (:func:`component_paths`)."""
    listed = "\n".join(f"- `{path}`" for path in paths)
    hyper = ", ".join(f"`{k}={v}`" for k, v in run.method_args.items()) or "none"
    return f"""# medflare `{method}` job template

{_summary(method)}

Server: `MedflareModelPersistor` (FLARE's PT persistor), `MedflareAggregator`, `MedflareController`.
Site: `MedflareExecutor` (all tasks). A pre-installed site allow-lists each component path exactly, never a
package prefix: FLARE calls whatever a `path` names with the job's `args`, so a prefix such as `medflare.` lets a
code-free job call any medflare function (one rewrote a site's `authorization.json`). `python -m
medflare.deploy.provision --mode preinstalled` writes the exact list into every kit's `local/resources.json`
(`docs/deploy.md` §3). The paths this template names:

{listed}

The server's robust defences are on (`robust` in `config_fed_server.conf`: {_robust_text(run.robust)}),
as in every job medflare writes for a deployment, and `meta.conf` records them; turning them off:
`docs/deploy-lead.md`.

## Make a job

```bash
{example_command(method)}
```

This tries the template on simulated data shaped like its task ({EXAMPLE_SOURCE}; run it with
`nvflare simulator jobs/{method} -w /tmp/ws -n 2 -t 2`). For hospitals leave `source` at `site`. Values holding
`:` or `=` are quoted twice (shell and HOCON), as above.

`-sd custom` copies the medflare package into the job (BYOC). For a pre-installed consortium submit the same job
without `app/custom/` (or use `apps/{method}/`).

## Variables (set with `-f <file> key=value`; a key set in one file is set everywhere in that file)

| variable | file(s) | meaning |
|---|---|---|
| `num_rounds` | server | federated rounds |
| `min_clients` | server (and `meta.conf`) | valid site updates a round needs |
| `source`, `partition` | client | `site` = each hospital reads `local/medflare_site.json`; or one shared source split by `partition` (POC/tests) |
| `sites` | client | site names in order (shared-source partitions only) |
| `num_classes`, `in_channels`, `image_size` | client **and** server | the task |
| {", ".join(f"`{k}`" for k in run.method_args) or "-"} | client **and** server | method hyperparameters (defaults: {hyper}) |
| `lr`, `batch_size`, `local_epochs`, `max_steps`, ... | client | local training (`train` block) |

Site data paths never go into the job in production: each hospital writes
`{{"data": {{"source": "folder:/data/..."}}}}` into its own `local/medflare_site.json`.
"""


def _comment(key: str, parent: str, method_keys: set[str], value: Any = None, owner: str = "") -> str:
    if key == "model" and isinstance(value, Mapping):
        return "the initial global network: FLARE calls the function below with these arguments"
    if parent == "train":
        return f"{TRAIN_COMMENT}: {key}"
    if parent == "stages":
        return f"VARIABLE: local training settings of the '{key}' stage, overriding the ones above (TrainConfig.stages)"
    if parent == "method_args" or (key in method_keys and parent != "args"):
        return f"VARIABLE: method hyperparameter '{key}' (see the method's README card)"
    if key.startswith("site-"):
        return f"overrides for {key}"
    if key in COMMENTS:
        return COMMENTS[key]
    if parent == "args" and owner:  # a constructor argument added after this table: its class documents it
        return f"argument '{key}' of {owner} (see its docstring)"
    raise KeyError(f"no comment for template key '{key}' (under '{parent}'): add one to COMMENTS")


def _robust_text(robust: Mapping[str, float]) -> str:
    return ", ".join(f"`{key}={value:g}`" for key, value in robust.items())


def _key(key: str) -> str:
    return key if key.replace("_", "").isalnum() else json.dumps(key)


def _summary(method: str) -> str:
    from medflare.registry import get_method

    return get_method(method).summary


def _method_config(method: str) -> Any:
    from medflare.registry import get_method

    return get_method(method).config_cls()


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
