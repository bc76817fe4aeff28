"""FLARE 2.9 Job Recipes for every medflare method: build with :func:`recipe`, run with ``SimEnv``, ``PocEnv`` or
``ProdEnv``.

Example (a ``job.py`` in FLARE 2.9's style)::

    from nvflare.recipe import SimEnv
    from medflare.console.recipes import recipe

    job = recipe("fedmas", rounds=5, clients=3, data="synthetic:imbalance=20", partition="dirichlet:0.5")
    job.execute(SimEnv(num_clients=3))   # `python job.py --export --export-dir jobs/` writes the job instead

A recipe writes its job with the builder ``medflare export`` and ``medflare run`` use (:func:`medflare.plan.resolve`,
then :func:`medflare.console.job_export.write_job`), so the two cannot drift apart; options are ``medflare run``'s, checked
the same way. With ``PocEnv`` or ``ProdEnv`` the job gets the server's robust defences (``server_setup.DEPLOY_ROBUST`` under
the recipe's own ``robust``); with ``SimEnv`` it keeps the recipe's settings; exported without an environment it
decides as ``medflare export`` does. In ``SimEnv`` the console shows medflare's lines and every warning and error
(FLARE's INFO log goes to the simulator's log files) unless you choose FLARE's ``log_config`` or ``FL_LOG_LEVEL``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from nvflare.apis.job_def import ALL_SITES
from nvflare.fuel.utils.log_utils import FL_LOG_LEVEL, concise_log_dict
from nvflare.job_config.api import FedJob
from nvflare.job_config.fed_job_config import FedJobConfig
from nvflare.recipe.sim_env import SimEnv
from nvflare.recipe.spec import ExecEnv, Recipe

from medflare.errors import ConfigError
from medflare.plan import RunPlan, resolve
from medflare.run_config import RunConfig, merge_run_config

__all__ = ["MedflareRecipe", "recipe"]

MODES = ("byoc", "preinstalled")
# The simulator's log configuration a recipe writes into the SimEnv workspace root (quiet_simulator_console)
CONSOLE_LOG_FILE = "medflare_log_config.json"
CONSOLE_FILTER = "MedflareConsole"


class _MedflareJobConfig(FedJobConfig):
    """FLARE's job configuration whose job folder is written by medflare's own builder."""

    def __init__(self, run: RunConfig, mode: str, plan: RunPlan) -> None:
        super().__init__(job_name=plan.job_name, min_clients=plan.min_clients)
        self.run = run  # the layered options, for the plan of a deployed job (resolved when one is written)
        self.mode = mode
        self.plan = plan  # the simulator's or an export's (its task read from the data once)
        self.deployed = False  # set by the recipe when it knows the job goes to a POC or production

    def generate_job_config(self, job_root: str) -> None:
        """Write ``job_root/<job name>/`` from the job's plan (FLARE calls this for export, the simulator, POC and
        production); a deployed job's plan has the defences on, whatever its mode and data."""
        from medflare.console.job_export import write_job

        plan = resolve(self.run, self.mode, deployed=True, task=self.plan.task) if self.deployed else self.plan
        write_job(plan, Path(job_root), self.mode)


class _MedflareJob(FedJob):
    """A FedJob whose apps come from medflare's builder; FLARE's environments deploy it like any FedJob."""

    def __init__(self, run: RunConfig, mode: str, plan: RunPlan) -> None:
        super().__init__(name=plan.job_name, min_clients=plan.min_clients)
        self.job = _MedflareJobConfig(run, mode, plan)
        self.clients = [ALL_SITES]  # the app goes to every site; the simulator names them site-1..N


class MedflareRecipe(Recipe):
    """A medflare method's job as a FLARE 2.9 Recipe (ConfigError for an invalid option or mode). ``mode``:
    ``byoc`` (the job carries medflare; needed by the simulator) or ``preinstalled`` (sites run their installed
    medflare and allow-list its job components by exact path, never a package prefix: docs/deploy.md §3)."""

    def __init__(self, run: RunConfig, mode: str = "byoc") -> None:
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got '{mode}'")
        self.plan = resolve(run, mode)  # every check, the data read once: a missing file fails here
        self.mode = mode
        super().__init__(_MedflareJob(run, mode, self.plan))

    def run(self, env: ExecEnv, server_exec_params: dict | None = None,
            client_exec_params: dict | None = None) -> Any:
        """FLARE's ``Recipe.run``, with the simulator's console kept to medflare's lines (module docstring)."""
        if isinstance(env, SimEnv):
            quiet_simulator_console(env)
        return super().run(env, server_exec_params=server_exec_params, client_exec_params=client_exec_params)

    def process_env(self, env: ExecEnv) -> None:
        """Refuse an environment whose sites differ from the recipe's (simulated data is split by site name); any
        environment but the simulator is a deployment, whose job gets the robust defences."""
        self._job.job.deployed = not isinstance(env, SimEnv)
        if isinstance(env, SimEnv) and self.mode != "byoc":
            raise ConfigError("the simulator enforces FLARE's class allow-list, which has no medflare classes: "
                              "build the recipe with mode='byoc'")
        count = getattr(env, "num_clients", None)
        names = getattr(env, "clients", None)
        expected = [site.name for site in self.plan.sites]
        if (names and list(names) != expected) or (count and count != len(expected)):
            raise ConfigError(f"the environment has sites {names or count} but the recipe was built for "
                              f"{len(expected)} sites {expected}; pass clients={len(expected)} to recipe() or "
                              f"num_clients={len(expected)} to the environment")

    def _validate_before_use(self) -> None:
        # FLARE calls this first in every export and run, and process_env only when it has an environment: an
        # export without one must not inherit the environment of an earlier call
        self._job.job.deployed = False
        # medflare's builder writes the whole job; FLARE's add_* helpers would be silently left out of it
        if self._job._deploy_map:
            raise ConfigError("a medflare recipe's job is written by medflare's own builder, so FLARE's add_* "
                              "helpers cannot change it; use recipe() options instead (e.g. tracking='mlflow')")


def console_log_config() -> dict[str, Any]:
    """FLARE's default log configuration with a console that passes only medflare's records and any warning or
    error; FLARE's INFO records (several a round per site) still reach each participant's ``log.txt``."""
    config = copy.deepcopy(concise_log_dict)
    # FLARE's own filter: records of loggers named medflare..., plus every record above INFO from any logger
    config["filters"][CONSOLE_FILTER] = {"()": "nvflare.fuel.utils.log_utils.LoggerNameFilter",
                                         "logger_names": ["medflare"], "allow_all_error_logs": True}
    config["handlers"]["consoleHandler"]["filters"] = [CONSOLE_FILTER]
    return config


def quiet_simulator_console(env: SimEnv) -> None:
    """Point ``env`` at :func:`console_log_config` (written into its workspace root), unless the user chose FLARE's
    log setting (``SimEnv(log_config=...)`` or ``$FL_LOG_LEVEL``), which then applies as FLARE documents it."""
    if env.log_config or os.environ.get(FL_LOG_LEVEL):
        return
    path = Path(env.workspace_root).resolve() / CONSOLE_LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(console_log_config(), indent=2) + "\n")
    env.log_config = str(path)  # the simulator and each site's worker read it by this absolute path


def recipe(method: str, *, data: str | dict[str, Any] | None = None, partition: str | None = None,
           mode: str = "byoc", **options: Any) -> MedflareRecipe:
    """The FLARE 2.9 Recipe of a registered method. ``data``: as ``medflare run --data`` takes it (``site``: each
    site's own data) or the whole data section as a dict; ``**options``: any ``medflare run`` option by its
    RunConfig name (``rounds``, ``clients``, ``train``, ``robust`` with ``{"off": True}`` ...). ConfigError for an
    unknown option or a value out of range."""
    section = dict(data) if isinstance(data, dict) else {"source": data}
    section.setdefault("partition", partition)
    layer = {"method": method, **options, "data": {k: v for k, v in section.items() if v is not None}}
    return MedflareRecipe(merge_run_config(layer), mode)
