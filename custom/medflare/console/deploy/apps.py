"""The ready-to-submit job folder of every registered method (``apps/<method>/``), from the same builders as
``medflare export``, so the committed copies never drift from the code: pre-installed mode (configs only: a site
runs the wheel it reviewed), site-local data and the method's privacy scope. :func:`add_code` makes one a BYOC job.

Command line::

    python -m medflare.console.deploy.apps            # rewrite apps/ (``make apps``)
    python -m medflare.console.deploy.apps --check    # exit 1 and list what is stale
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from medflare.console.files import OutputError
from medflare.plan import RunPlan, resolve
from medflare.run_config import RunConfig
from medflare.server_setup import DEPLOY_ROBUST, deployment_robust

REPO_DIR = Path(__file__).resolve().parents[4]
APPS_DIR = REPO_DIR / "apps"
# The task every exported app declares: one-channel 28x28 images, two classes (e.g. PneumoniaMNIST-style
# chest X-rays). Another task: `medflare export METHOD --mode preinstalled --set task.num_classes=...`.
DEPLOY_TASK = {"num_classes": 2, "in_channels": 1, "image_size": 28}
DEPLOY_ROUNDS = 20
# The consortium of provisioning/project.yml has 3 hospitals; a round needs valid updates from 2 of them, so
# one site that is down or too slow costs that round its update (after the straggler wait or the task
# timeout), not the job. 2, not 1: a global model is never one hospital's update alone.
DEPLOY_SITES = 3
DEPLOY_MIN_SITES = 2
README = "README.md"


def deployment_run(method: str, **overrides: Any) -> RunConfig:
    """The layered run behind a method's app and job template: site-local data, declared task, and the
    deployment's robust defences under any ``robust`` of ``overrides``."""
    fields: dict[str, Any] = {
        "method": method, "rounds": DEPLOY_ROUNDS, "clients": DEPLOY_SITES, "min_clients": DEPLOY_MIN_SITES,
        "data": {"source": "site"}, "task": dict(DEPLOY_TASK), "straggler_seconds": 600, **overrides}
    fields["robust"] = deployment_robust(fields.get("robust", {}), fields.get("secure_aggregation") == "he")
    return RunConfig(**fields)


def deployment_plan(method: str, **overrides: Any) -> RunPlan:
    """The plan of a method's app and job template (:func:`deployment_run`, deployed, pre-installed)."""
    return resolve(deployment_run(method, **overrides), "preinstalled", deployed=True, check_files=False)


def write_app(method: str, out_dir: str | Path) -> Path:
    """Write ``out_dir/<method>/`` (pre-installed job with the method's privacy scope); return it."""
    from medflare.console.job_export import write_job

    return write_job(deployment_plan(method), out_dir, "preinstalled")


def write_apps(out_dir: str | Path = APPS_DIR, methods: list[str] | None = None) -> list[Path]:
    """Rewrite the apps of every registered method (and the folder's README); drop apps of removed methods."""
    from medflare.registry import list_methods

    methods = methods or list_methods()
    written = write_per_method(out_dir, methods, write_app)
    (Path(out_dir) / README).write_text(apps_readme(methods))
    return written


def write_per_method(out_dir: str | Path, methods: list[str], write_one: Callable[[str, Path], Path]) -> list[Path]:
    """One generated folder per method under ``out_dir``; the folder of a method no longer registered is removed
    when it holds only what medflare recorded writing there (else it is kept and named)."""
    from medflare.console.files import remove_recorded

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in sorted(out.iterdir()):
        if stale.is_dir() and not stale.name.startswith(".") and stale.name not in methods:
            left = remove_recorded(out, stale.name)
            if left:
                print(f"kept {stale}: it holds {left[0]}, which medflare did not write", file=sys.stderr)
    return [write_one(method, out) for method in methods]


def stale_files(write_all: Callable[[Path], Any], committed_dir: str | Path) -> list[str]:
    """Paths (relative to ``committed_dir``) that differ from a fresh regeneration; empty when up to date."""
    with tempfile.TemporaryDirectory() as tmp:
        write_all(Path(tmp))
        return _tree_differences(Path(tmp), Path(committed_dir))


def stale_apps(apps_dir: str | Path = APPS_DIR) -> list[str]:
    """Paths (relative to ``apps_dir``) that differ from a fresh regeneration; empty when up to date."""
    return stale_files(write_apps, apps_dir)


def add_code(job_dir: str | Path) -> Path:
    """Turn a pre-installed job into a BYOC job: copy this medflare's job package into ``app/custom/medflare``."""
    from medflare.console.job_export import APP_NAME, copy_job_package

    target = Path(job_dir) / APP_NAME / "custom" / "medflare"
    if target.exists() or target.is_symlink():
        raise OutputError(f"{target} exists: the job already carries code; medflare replaces nothing it did not "
                          "write, so start from a pre-installed job")
    copy_job_package(target)
    return Path(job_dir)


def apps_readme(methods: list[str]) -> str:
    """The apps/ folder's README (regenerated with the apps)."""
    from medflare.catalog import method_entries
    from medflare.plan import DEFAULT_TASK_TIMEOUT

    summaries = {entry["name"]: entry["summary"] for entry in method_entries()}
    rows = "\n".join(f"| `{m}` | {summaries[m]} |" for m in methods)
    task = ", ".join(f"{k}={v}" for k, v in DEPLOY_TASK.items())
    return f"""# apps: ready-to-submit FLARE jobs, one per registered method

Generated by `make apps` (`python -m medflare.console.deploy.apps`); do not edit by hand. A test fails when these
copies are stale.

Every job here is in **pre-installed** mode (no code inside: each site runs the reviewed medflare wheel it
installed and allow-listed), reads each hospital's images from that site's `local/medflare_site.json`
(`"data": {{"source": "site"}}`), runs {DEPLOY_ROUNDS} rounds, declares the task ({task}), and names the
method's privacy scope (`medflare-<method>`) that sites define in `local/privacy.json`.

Their class names (`task.class_names` in `app/config/medflare_plan.json`) are the placeholder `<class 1>`,
`<class 2>`: the hospitals' data is not known here, and every site refuses the placeholder until the lead writes
the consortium's names there in label order, or exports the job with them: `medflare export METHOD -o jobs/ --mode
preinstalled --set task.num_classes=2 --set task.in_channels=1 --set task.image_size=28 --set
'task.class_names=["normal","pneumonia"]'`.

Each round needs valid updates from {DEPLOY_MIN_SITES} sites (`min_clients`, also the sites the job needs to
start) of the {DEPLOY_SITES} hospitals of `provisioning/project.yml`, and a site may take at most
{DEFAULT_TASK_TIMEOUT} s per task (`train_timeout`): a site that is down or stuck costs that round its update,
not the job. Fewer than {DEPLOY_MIN_SITES} valid updates stop the job with an error naming the sites.
The robust aggregation options are on (`robust`, as in every job medflare writes for a deployment; `meta.json`
records them): an update whose norm exceeds {DEPLOY_ROBUST["max_norm_ratio"]:g}x the other sites' median is
rejected, and no site's share exceeds {DEPLOY_ROBUST["max_share"]:g} (`docs/architecture.md`, "What the server
checks"; turning them off: `docs/deploy-lead.md`).

```bash
nvflare job submit -j apps/fedavg                       # as the project's lead
```

Another task, round count or sites: `medflare export METHOD -o jobs/ --mode preinstalled --set task.num_classes=3
--rounds 50`. Sites that accept code (BYOC): `medflare export METHOD -o jobs/ --mode byoc ...`.

| method | what |
|---|---|
{rows}
"""


def _tree_differences(expected: Path, actual: Path) -> list[str]:
    expected_files = {p.relative_to(expected) for p in expected.rglob("*") if p.is_file()}
    actual_files = {p.relative_to(actual) for p in actual.rglob("*") if p.is_file()} if actual.is_dir() else set()
    differences = [f"missing: {p}" for p in sorted(expected_files - actual_files)]
    differences += [f"not generated: {p}" for p in sorted(actual_files - expected_files)]
    differences += [
        f"differs: {p}" for p in sorted(expected_files & actual_files)
        if not filecmp.cmp(expected / p, actual / p, shallow=False)
    ]
    return differences


def main(argv: list[str] | None = None) -> int:
    """``python -m medflare.console.deploy.apps``: write (or ``--check``) ``apps/<method>/`` for every method."""
    parser = argparse.ArgumentParser(description="Write (or --check) apps/<method>/ for every registered method.")
    parser.add_argument("-o", "--output", default=str(APPS_DIR), help="apps folder (default: the repository's apps/)")
    parser.add_argument("--check", action="store_true", help="only report stale files; exit 1 if any")
    args = parser.parse_args(argv)
    if args.check:
        differences = stale_apps(args.output)
        for line in differences:
            print(line)
        if differences:
            print("apps/ is stale: run 'make apps'", file=sys.stderr)
        return 1 if differences else 0
    for job in write_apps(args.output):
        print(f"wrote {job}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
