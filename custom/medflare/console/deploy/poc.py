"""Run medflare jobs in a real FLARE POC (provisioned mTLS kits, separate server/site processes) on one machine.

Everything a POC touches lives under one root folder: its own ``HOME`` (FLARE's startup-kit registry, and the
working folder of the ``nvflare`` commands: medflare/console/processes.py says why) and ``NVFLARE_POC_WORKSPACE``, so nothing
leaks into ``~/.nvflare`` and re-running is safe. One medflare process at a time works on a root (a lock file names
the owner's PID). A POC that ``run`` (or ``medflare run --env poc``) starts dies with it, even when it is SIGKILLed;
one started step by step lives until ``stop``. The POC is prepared from ``provisioning/project.yml`` (same server,
orgs and admin roles; clients renamed ``site-1..N``), and jobs are submitted as its ``lead``, as in production.

Command line (what the ``poc/*.sh`` scripts run)::

    python -m medflare.console.deploy.poc prepare --sites 2
    python -m medflare.console.deploy.poc start
    python -m medflare.console.deploy.poc submit fedavg --mode preinstalled [run options]
    python -m medflare.console.deploy.poc wait
    python -m medflare.console.deploy.poc download -o runs/poc-fedavg
    python -m medflare.console.deploy.poc stop
    python -m medflare.console.deploy.poc clean
    python -m medflare.console.deploy.poc run fedavg --mode byoc -o runs/poc-fedavg   # all of the above
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import psutil
import yaml

from medflare.console.deploy.policies import SITE_MODES, site_data_config
from medflare.console.deploy.provision import (
    STATE_DIR,
    admin_with_role,
    install_kit,
    load_project,
    participants,
    protect_secrets,
    with_he_builder,
)
from medflare.console.deploy.watch import KIT_ENV, WatchError, kit_username, watch
from medflare.console.files import OutputTarget
from medflare.console.job_export import write_job
from medflare.console.launch import (
    failure_note,
    first_site_said,
    job_plan_in,
    keep_site_logs,
    results_text,
    write_job_outputs,
)
from medflare.console.processes import (
    end_processes,
    flare_admin_command,
    flare_admin_popen_args,
    nvflare_command,
    nvflare_reply,
    quiet_on_closed_output,
    run_kept,
    signals_held,
)
from medflare.console.run_options import add_run_options, build_run_config
from medflare.errors import ConfigError, MedflareError
from medflare.flare.memory import with_allocator_settings
from medflare.flare.tracking import keep_server_records
from medflare.plan import RunPlan, describe_sites, resolve
from medflare.server_setup import DEPLOY_ROBUST

REPO_DIR = Path(__file__).resolve().parents[4]
DEFAULT_PROJECT = REPO_DIR / "provisioning" / "project.yml"
# Read when a POC is made, not at import: a test or a long-lived process may set them later
ROOT_ENV, DEFAULT_ROOT = "MEDFLARE_POC_ROOT", Path("runs/poc")
PORT_ENV, DEFAULT_PORT = "MEDFLARE_POC_PORT", 8002
SITE_PREFIX = "site-"  # simulated partitions are keyed by site-1..N (RunConfig.site_names)
STATE_FILE = "medflare_poc.json"
LOCK_FILE = "medflare_poc.lock"  # flock-ed by the medflare process working on the root; holds its PID
STOP_TIMEOUT = 120  # seconds 'nvflare poc stop' may take before medflare ends the POC's processes itself
Echo = Callable[[str], None]


class PocError(MedflareError, RuntimeError):
    """A POC step failed; the message says which and why."""


def env_root() -> Path | None:
    """The POC root ``$MEDFLARE_POC_ROOT`` names now, or None when it is unset or empty."""
    value = os.environ.get(ROOT_ENV, "").strip()
    return Path(value).expanduser() if value else None


def env_port() -> int:
    """The POC server port: ``$MEDFLARE_POC_PORT`` now, else 8002 (ConfigError when it is not a port number)."""
    value = os.environ.get(PORT_ENV, "").strip() or str(DEFAULT_PORT)
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ConfigError(f"{PORT_ENV}={value} is not a port number (1-65535)")
    return int(value)


def poc_project(project: Mapping[str, Any], sites: list[str], port: int) -> dict[str, Any]:
    """The consortium's project.yml as a one-machine POC project: the server (on ``port``), the admins and their
    roles kept; the hospitals replaced by ``sites`` (orgs reused in turn, so authorization rules such as ``o:site``
    still mean something). FLARE's ``poc prepare -i`` then points every participant at localhost."""
    hospitals = participants(project, "client")
    orgs = [h["org"] for h in hospitals] or ["poc"]
    server = {k: v for k, v in participants(project, "server")[0].items() if k != "host_names"}
    server.update(fed_learn_port=port, admin_port=port)
    clients = [{"name": name, "type": "client", "org": orgs[i % len(orgs)]} for i, name in enumerate(sites)]
    others = [p for p in project["participants"] if p.get("type") not in ("server", "client")]
    return {**project, "participants": [server, *clients, *others]}


def bind_to_loopback(server_kit: Path, signing_key: Any = None) -> None:
    """Make a POC server listen on 127.0.0.1 only.

    FLARE's server binds to loopback exactly when the host of ``startup/fed_server.json``'s
    ``servers[].service.target`` is a loopback address, else to 0.0.0.0; a POC kit names the consortium's FQDN there.
    POC kits are unsigned (mTLS is their trust anchor), so the file may be edited; a signed kit (with TenSEAL
    contexts, which FLARE signs) is signed again with ``signing_key``, the POC's own root CA key, or refused.
    """
    startup = server_kit / "startup"
    signed = (startup / "signature.json").exists()
    if signed and signing_key is None:
        raise PocError(f"{startup} is signed; cannot bind this POC server to loopback without breaking the kit")
    config_path = startup / "fed_server.json"
    config = json.loads(config_path.read_text())
    for server in config.get("servers", []):
        port = str(server["service"]["target"]).rsplit(":", 1)[-1]
        server["service"]["target"] = f"127.0.0.1:{port}"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    if signed:
        from nvflare.lighter.utils import sign_folders

        sign_folders(str(startup), signing_key, signature_file="signature.json")


def root_signing_key(project_dir: Path) -> Any:
    """The root CA's private key a POC's provisioning kept in ``<project>/state/cert.json`` (POC kits only: a
    production CA key lives offline)."""
    from nvflare.lighter.utils import load_private_key

    state = json.loads((project_dir / STATE_DIR / "cert.json").read_text())
    return load_private_key(state["root_pri_key"])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something already listens on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


PROCESS_TMP = "medflare-tmp"  # the POC processes' TMPDIR, under the workspace (PocSession._process_tmp)


@dataclass
class PocSession:
    """One isolated POC: its root folder (``home/``, ``poc/``: FLARE's POC workspace, ``medflare_poc.json``), the
    server's single FL/admin ``port`` on loopback, and the FLARE CLI calls that drive it.

    ``tied``: the server and sites die with this process (through keepers, :mod:`medflare.console.processes`), as in
    :func:`run_poc`; otherwise they outlive it, for the step-by-step command line's next step. ``stop_timeout``:
    seconds ``nvflare poc stop`` may take (it hangs while the network is down) before the processes are ended.
    """

    root: Path
    port: int = field(default_factory=env_port)
    project_file: Path = DEFAULT_PROJECT
    echo: Echo = print
    state: dict[str, Any] = field(default_factory=dict)
    tied: bool = False
    stop_timeout: float = STOP_TIMEOUT
    keepers: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        state_path = self.root / STATE_FILE
        if state_path.is_file():
            self.state = json.loads(state_path.read_text())
            self.port = int(self.state.get("port", self.port))

    # ----- paths and environment --------------------------------------------------------------------
    @property
    def workspace(self) -> Path:
        return self.root / "poc"

    @property
    def home(self) -> Path:
        return self.root / "home"

    def prod_dir(self) -> Path:
        return self.workspace / self.state["project"] / "prod_00"

    def kit(self, participant: str) -> Path:
        """A participant's startup kit inside the POC."""
        return self.prod_dir() / participant

    def env(self) -> dict[str, str]:
        # the POC's server and sites start from these commands' environment (allocator: flare/memory.py)
        env = with_allocator_settings(
            {**os.environ, "HOME": str(self.home), "NVFLARE_POC_WORKSPACE": str(self.workspace)})
        env.pop("NVFLARE_STARTUP_KIT_DIR", None)  # the kit is always chosen explicitly
        return env

    def nvflare(self, *args: str, timeout: float = 300, check: bool = True, starts: bool = False) -> dict[str, Any]:
        """Run one ``nvflare ... --format json`` command in this POC's environment; return its JSON reply.
        ``starts``: the command starts POC processes; in a ``tied`` session they run under a keeper."""
        command = nvflare_command() + list(args) + ["--format", "json"]
        try:
            if starts:  # what it starts keeps its temporary files in the workspace, which clean() removes
                popen_args = flare_admin_popen_args(self.home, {**self.env(), "TMPDIR": str(self._process_tmp())})
                if self.tied:
                    proc, keeper = run_kept(command, timeout, **popen_args)
                    self.keepers.append(keeper)
                else:
                    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **popen_args)
            else:
                with flare_admin_command(self.home, self.env()) as popen_args:
                    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **popen_args)
        except subprocess.TimeoutExpired as exc:
            raise PocError(f"'nvflare {' '.join(args)}' did not finish within {timeout:.0f} s") from exc
        reply = nvflare_reply(proc)
        if check and proc.returncode != 0:
            raise PocError(f"'nvflare {' '.join(args)}' failed (exit {proc.returncode}): {reply.get('message', reply)}")
        return reply

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold this POC root for this process: another medflare process on the same root is refused, in one line
        that names the PID holding it. The lock ends with this process, however it ends (flock)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / LOCK_FILE).open("a+") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                owner = lock.read().strip() or "unknown"
                raise PocError(f"the POC in {self.root} is in use by medflare process {owner}; wait for it to end, "
                               "or use another --root") from None
            lock.truncate(0)
            lock.write(f"{os.getpid()}\n")
            lock.flush()
            yield

    def _save_state(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / STATE_FILE).write_text(json.dumps(self.state, indent=2) + "\n")

    # ----- lifecycle --------------------------------------------------------------------------------
    def prepare(self, n_sites: int = 2, site_modes: Mapping[str, str] | None = None, default_mode: str = "byoc",
                allow_job_data: bool = False, he: bool = False) -> None:
        """Provision a fresh POC with sites site-1..``n_sites`` and install medflare's site policies in every kit.

        A POC left over in this root is removed first (safe to re-run); a port held by anything else is refused
        (FLARE POCs on one host must not share a port). ``site_modes``: per-site override of ``default_mode``
        ("byoc" sites accept both BYOC and pre-installed jobs), e.g. {"site-3": "preinstalled"}.
        ``allow_job_data``: each site's ``local/medflare_site.json`` opts in to jobs that bring their own (e.g.
        simulated) data; else they are refused, as at a hospital. ``he``: the kits also get FLARE's TenSEAL contexts.
        """
        site_modes = dict(site_modes or {})
        sites = [f"{SITE_PREFIX}{i + 1}" for i in range(n_sites)]
        if set(site_modes) - set(sites) or {default_mode, *site_modes.values()} - set(SITE_MODES):
            raise PocError(f"site modes {site_modes} must name sites among {sites} and modes among {SITE_MODES}")
        self.discard()
        if port_in_use(self.port):
            raise PocError(f"port {self.port} is in use by another process (another FLARE POC or server?). Stop it, "
                           f"or choose another port with --port / MEDFLARE_POC_PORT.")
        project = poc_project(load_project(self.project_file), sites, self.port)
        project = with_he_builder(project) if he else project
        self.root.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(exist_ok=True)
        project_file = self.root / "project.yml"
        project_file.write_text(yaml.safe_dump(project, sort_keys=False))
        self.nvflare("poc", "prepare", "-i", str(project_file), "--force")
        protect_secrets(self.workspace / project["name"])
        self.state = {
            "project": project["name"], "port": self.port, "sites": sites,
            "site_modes": {site: site_modes.get(site, default_mode) for site in sites},
            "server": participants(project, "server")[0]["name"], "lead": admin_with_role(project, "lead"),
            "project_admin": admin_with_role(project, "project_admin"),
            "admins": {a["name"]: a.get("role") for a in participants(project, "admin")}, "jobs": {},
        }
        opt_in = site_data_config(allow_job_data=True) if allow_job_data else None
        for site in [self.state["server"], *sites]:
            install_kit(self.kit(site), self.state["site_modes"].get(site, default_mode), site_config=opt_in)
        signing_key = root_signing_key(self.workspace / project["name"]) if he else None
        bind_to_loopback(self.kit(self.state["server"]), signing_key)
        self._save_state()
        self.echo(f"poc: prepared {n_sites} sites ({self.state['site_modes']}) in {self.workspace}")

    def start(self, exclude: list[str] | None = None, timeout: float = 120) -> None:
        """Start the server and the sites (except ``exclude``); returns when FLARE reports them ready."""
        self._require_prepared()
        args = ["poc", "start", "--timeout", str(int(timeout))]
        for name in exclude or []:
            args += ["-ex", name]
        self._start_processes(*args, timeout=timeout + 60)
        self.echo(f"poc: started on localhost:{self.port}")

    def start_site(self, site: str, timeout: float = 60) -> None:
        """Start one more site and wait until the server lists it as connected."""
        self._start_processes("poc", "start", "-p", site, "--timeout", str(int(timeout)), timeout=timeout + 60)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if site in self.connected_sites():
                return
            time.sleep(1)
        raise PocError(f"{site} did not connect to the server within {timeout:.0f} s; see {self.kit(site)}/log.txt")

    def connected_sites(self) -> list[str]:
        """Sites the server currently lists as connected."""
        reply = self.nvflare("system", "status", "--startup-kit", str(self.kit(self.state["project_admin"])),
                             check=False, timeout=60)
        text = json.dumps(reply.get("data", {}))
        return [site for site in self.state["sites"] if f'"{site}"' in text]

    def stop(self) -> None:
        """Stop every POC process: FLARE's shutdown first, then what is left of this POC is ended directly (SIGTERM,
        then SIGKILL), also when ``nvflare poc stop`` hangs (it talks to the server, which a network fault cuts
        off). Never raises for a POC that will not stop: the caller's own failure is the one to report."""
        if self.workspace.exists():
            try:
                self.nvflare("poc", "stop", check=False, timeout=self.stop_timeout)
            except PocError as exc:
                self.echo(f"poc: {exc}; ending the POC's processes directly")
        self._end_processes()

    def clean(self) -> None:
        """Delete the POC workspace (FLARE refuses right after stop while processes exit: retry, then force)."""
        try:
            for attempt in range(5):
                if not self.workspace.exists():
                    break
                if self.nvflare("poc", "clean", check=False, timeout=60)["exit_code"] == 0:
                    break
                time.sleep(2 + attempt)
            else:
                self.nvflare("poc", "clean", "--force", check=False, timeout=120)
        except PocError as exc:  # a hung 'nvflare poc clean': the folder goes all the same
            self.echo(f"poc: {exc}; removing {self.workspace} directly")
        shutil.rmtree(self.workspace, ignore_errors=True)
        (self.root / STATE_FILE).unlink(missing_ok=True)
        self.state = {}

    def discard(self) -> None:
        """Stop and remove whatever POC this root holds (before prepare, after a test and after failures). Its
        processes are ended directly: FLARE's orderly ``poc stop`` (8 s with 2 sites) keeps a workspace consistent,
        and this one is deleted right after."""
        if self.workspace.exists() or self._own_processes() or self.keepers:
            self.echo(f"poc: stopping and removing the previous POC in {self.root}")
            self._end_processes()
            self.clean()

    # ----- jobs -------------------------------------------------------------------------------------
    def submit(self, job_dir: str | Path, user: str | None = None) -> str:
        """Submit a job folder as ``user`` (default: the project's lead); return the job id."""
        self._require_prepared()
        user = user or self.state["lead"]
        reply = self.nvflare(*self._submit_args(job_dir, user))
        job_id = reply["data"]["job_id"]
        self.state["jobs"][job_id] = {"job_dir": str(job_dir), "user": user, "submitted_at": time.time()}
        self.state["last_job"] = job_id
        self._save_state()
        self.echo(f"poc: submitted {Path(job_dir).name} as {user}: job {job_id}")
        return job_id

    def _last_job(self) -> str:
        """The job this POC submitted last (what wait/download act on when no job id is given)."""
        if not self.state.get("last_job"):
            raise ConfigError("no job was submitted to this POC yet: run poc/submit.sh JOB_DIR first, or give a job id")
        return self.state["last_job"]

    def try_submit(self, job_dir: str | Path, user: str) -> dict[str, Any]:
        """Submit and return FLARE's reply without raising (to check that a submission is refused)."""
        return self.nvflare(*self._submit_args(job_dir, user), check=False)

    def _submit_args(self, job_dir: str | Path, user: str) -> list[str]:
        """``nvflare job submit`` of ``job_dir`` as ``user`` (absolute: the command runs in the POC's home)."""
        return ["job", "submit", "-j", str(Path(job_dir).resolve()), "--startup-kit", str(self.kit(user))]

    def wait(self, job_id: str | None = None, timeout: float = 600) -> str:
        """Wait for a job to end; return its final status (e.g. FINISHED:COMPLETED). Never raises on failure."""
        job_id = job_id or self._last_job()
        reply = self.nvflare("job", "wait", job_id, "--timeout", str(int(timeout)), "--interval", "0.5",
                             "--startup-kit", self._submitter_kit(job_id), check=False, timeout=timeout + 60)
        status = reply.get("data", {}).get("status") or reply.get("error_code") or "UNKNOWN"
        self.state["jobs"].setdefault(job_id, {})["status"] = status
        self._save_state()
        return status

    def download(self, job_id: str | None, out_dir: str | Path) -> Path:
        """Download a finished job's workspace; return the folder holding ``workspace/app_server``."""
        job_id = job_id or self._last_job()
        reply = self.nvflare("job", "download", job_id, "-o", str(Path(out_dir).resolve()), "--force",
                             "--startup-kit", self._submitter_kit(job_id))
        return Path(reply["data"]["download_path"])

    def server_log(self) -> str:
        """The POC server's log (deploy refusals and job failures are reported there)."""
        return self._log(self.state["server"])

    # ----- internals --------------------------------------------------------------------------------
    def _submitter_kit(self, job_id: str) -> str:
        """The kit of the admin who submitted ``job_id`` (the lead for a job this POC did not record)."""
        return str(self.kit(self.state["jobs"].get(job_id, {}).get("user", self.state["lead"])))

    def _process_tmp(self) -> Path:
        """The POC processes' temporary folder, in the workspace: FLARE's server writes every job it receives there
        (``nvflare/fuel/hci/binary_proto.py``) and never deletes it, which would leave a copy of each job in /tmp."""
        folder = self.workspace / PROCESS_TMP
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _log(self, participant: str) -> str:
        path = self.kit(participant) / "log.txt"
        return path.read_text(errors="replace") if path.is_file() else ""

    def _start_processes(self, *args: str, timeout: float) -> None:
        """An ``nvflare poc start`` command; its failure says what each participant last logged (often the only
        trace of why)."""
        try:
            self.nvflare(*args, timeout=timeout, starts=True)
        except PocError as exc:
            raise PocError(f"{exc}; {self._last_logged()}") from exc

    def _last_logged(self, width: int = 160) -> str:
        """One line: the last line of each participant's log.txt (or that it has none), and where the logs are."""
        said = []
        for name in [self.state["server"], *self.state.get("sites", [])]:
            lines = self._log(name).strip().splitlines()
            said.append(f"{name}: {lines[-1][-width:]!r}" if lines else f"{name}: no log")
        return f"last logged by {' | '.join(said)} (logs: {self.prod_dir()}/*/log.txt)"

    def _require_prepared(self) -> None:
        if not self.state:
            raise PocError(f"no POC is prepared in {self.root}; run 'prepare' first")

    def _end_processes(self) -> None:
        """The keepers end all the POC processes they adopted; the rest name this POC's workspace in their commands."""
        end_processes([*self.keepers, *self._own_processes()])
        self.keepers = []

    def _own_processes(self) -> list[psutil.Process]:
        """Processes whose command line names this POC's workspace (its server, sites, their jobs and loops)."""
        marker = str(self.workspace)
        found = []
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if process.pid != os.getpid() and marker in " ".join(process.info["cmdline"] or []):
                    found.append(process)
        return found


# ----- jobs for POC ---------------------------------------------------------------------------------
def retarget_job(job_dir: str | Path, sites: list[str], name: str) -> None:
    """Deploy a job to ``sites`` only (plus the server) and rename it."""
    meta_path = Path(job_dir) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.update(name=name, deploy_map={"app": ["server", *sites]}, min_clients=len(sites))
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")


def find_results(download_dir: str | Path) -> Path:
    """The controller's results file inside a downloaded job."""
    from medflare.flare.controller import RESULTS_FILE

    found = sorted(Path(download_dir).glob(f"**/app_server/{RESULTS_FILE}"))
    if not found:
        raise PocError(f"the downloaded job has no {RESULTS_FILE} under {download_dir}: it did not run")
    return found[0]


def write_run_outputs(download_dir: Path, out: Path, launched_at: float | None, extra: dict,
                      plan: RunPlan | None = None) -> dict:
    """summary.json / rounds.csv / report.md / plots (as ``medflare run`` writes them) from a downloaded job;
    ``plan``: the job's plan (``plan.resolve``; when not given, the one the downloaded job carries)."""
    results_path = find_results(download_dir)
    plan = plan or job_plan_in(results_path.parent)
    clients, _ = describe_sites(plan)
    summary = write_job_outputs(plan, results_path, out, clients, launched_at, deployment=extra)
    keep_server_records(results_path.parent.parent, out)  # TensorBoard / MLflow records of the job
    server_log = results_path.parent.parent / "log.txt"
    if server_log.exists():
        shutil.copy(server_log, out / "poc_server.log")
    return summary


def admin_kit(startup_kit: str | None = None, poc_root: str | None = None) -> tuple[Path, str]:
    """The admin startup kit to watch with, and its user name: ``startup_kit``, else ``$NVFLARE_STARTUP_KIT_DIR``,
    else the lead's kit of the medflare POC in ``poc_root`` (default ``$MEDFLARE_POC_ROOT``, read now, else runs/poc,
    as the POC scripts use). ConfigError when there is none, or the folder is not an admin startup kit."""
    if startup_kit or os.environ.get(KIT_ENV):
        kit = Path(startup_kit or os.environ[KIT_ENV]).expanduser()
    else:
        root = Path(poc_root) if poc_root else env_root() or DEFAULT_ROOT
        session = PocSession(root)
        if not session.state:
            raise ConfigError(f"--poc {root}: no medflare POC is prepared there; give --startup-kit ADMIN_KIT (an "
                              f"admin's startup kit) or set {KIT_ENV}")
        kit = session.kit(session.state["lead"])
    config = kit / "startup" / "fed_admin.json"
    if not config.is_file():
        raise ConfigError(f"{kit} is not an admin startup kit: {config} is missing")
    return kit, kit_username(kit / "startup", json.loads(config.read_text())["admin"])


def follow_job(session: PocSession, job_id: str, echo: Echo, timeout: float) -> None:
    """Print the job's per-round progress as the lead sees it (``medflare watch``) until the job ends. Progress is
    a convenience: when it cannot be followed, one line says so and the run waits as before."""
    try:
        kit, user = admin_kit(startup_kit=str(session.kit(session.state["lead"])))
        watch(job_id, kit, user, echo, timeout=timeout)
    except (WatchError, ConfigError) as exc:
        echo(f"poc: no round-by-round progress ({exc}); waiting for the job to end")


def run_poc(plan: RunPlan, out_dir: str | Path, echo: Echo = print, mode: str = "byoc", port: int | None = None,
            timeout: float = 1800, overwrite: bool = False, root: Path | None = None) -> dict[str, Any]:
    """The POC twin of ``run_simulation``: prepare and start a POC (one site per site of ``plan``), submit the job
    of ``plan`` (``plan.resolve(run, mode, deployed=True)``: a POC is a deployment, so its job gets the robust
    defences, simulated data or not) as the lead, wait, download, write the run's outputs, stop and clean.

    Everything is staged in ``<out>.partial`` (the POC too, unless ``root`` or ``$MEDFLARE_POC_ROOT`` says where it
    goes: then there, replacing a POC left in it) and moved to ``out`` only after success (``OutputTarget`` rules: a
    non-empty ``out`` needs ``overwrite``). On failure or SIGTERM/SIGINT the POC is stopped and removed and its server
    log, with the rounds that finished, kept as ``<out>.failed.log``. ``mode``: "byoc" (the job carries medflare) or
    "preinstalled". ``port``: default ``$MEDFLARE_POC_PORT`` or 8002, read now. ConfigError for a plan not resolved
    as deployed: its job would leave a defence off because a setting was left out.
    """
    if not set(DEPLOY_ROBUST) <= set(plan.robust):  # a deployed plan states each defence, on or off
        raise ConfigError("a POC is a deployment: resolve its plan with plan.resolve(run, mode, deployed=True), which "
                          "turns the robust defences on unless the run turns them off")
    target = OutputTarget(Path(out_dir), overwrite=overwrite)
    staging = target.begin()
    poc_root = root or env_root() or staging / "poc"
    session = PocSession(poc_root, port=port or env_port(), echo=echo, tied=True)  # the POC dies with this process
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(session.hold())  # another medflare process may be using a shared root
        except PocError:
            target.abandon()
            raise
        return _run_in_poc(plan, session, target, staging, mode, timeout)


def _run_in_poc(plan: RunPlan, session: PocSession, target: OutputTarget, staging: Path, mode: str,
                timeout: float) -> dict[str, Any]:
    """:func:`run_poc`'s steps in the session's POC, writing into ``staging``; on failure the cause is printed first,
    then the POC is ended and its server log kept as ``<out>.failed.log``."""
    echo = session.echo
    try:
        session.prepare(len(plan.sites), allow_job_data=plan.data.get("source", "site") != "site",
                        he=plan.secure_aggregation == "he")
        job_dir = write_job(plan, staging / "job", mode)
        launched_at = time.time()
        session.start()
        job_id = session.submit(job_dir)
        echo(f"poc: waiting for job {job_id} ({len(plan.rounds)} rounds)")
        follow_job(session, job_id, echo, timeout)
        status = session.wait(job_id, timeout=timeout)
        if status != "FINISHED:COMPLETED":
            raise PocError(f"job {job_id} ended as {status}{first_site_said(session.prod_dir())}; see the server log")
        download = session.download(job_id, staging / "download")
        extra = {"env": "poc", "mode": mode, "job_id": job_id, "status": status, "sites": session.state["sites"]}
        summary = write_run_outputs(download, staging, launched_at, extra, plan)
        keep_site_logs(session.prod_dir(), staging, job_id)  # a POC's sites are on this machine too
        if summary.get("error"):
            raise PocError(f"the job stopped early: {summary['error']}{first_site_said(session.prod_dir())}")
        session.discard()  # results and site logs are copied out: the POC goes, no orderly stop needed
        for leftover in ("poc", "download"):  # "poc": the POC's HOME and project, when it lived in the staging
            shutil.rmtree(staging / leftover, ignore_errors=True)
        target.publish()
        return summary
    except BaseException as exc:
        with signals_held():  # a stop request during the clean-up must not leave the POC running
            note = failure_note(len(plan.rounds), session.root, exc)
            session.echo = quiet_on_closed_output(echo)  # a gone terminal must not stop the clean-up
            session.echo(f"{note.strip()}; stopping the POC")  # the cause first
            log = (session.server_log() if session.state else "") + note
            session.discard()
            target.abandon(log)
        raise


# ----- command line ---------------------------------------------------------------------------------
def _plan_from_args(args: Any) -> RunPlan:
    """The plan of the job ``submit``/``run`` sends: the command line's options, deployed."""
    return resolve(build_run_config(args), args.mode, deployed=True)


def _cmd_prepare(session: PocSession, args: Any) -> int:
    modes = dict(item.split("=", 1) for item in args.site_mode)
    session.prepare(args.sites, modes, args.mode_default, allow_job_data=args.allow_job_data, he=args.he)
    return 0


def _cmd_start(session: PocSession, args: Any) -> int:
    session.start(exclude=args.exclude, timeout=args.timeout)
    return 0


def _cmd_submit(session: PocSession, args: Any) -> int:
    plan = _plan_from_args(args)
    job_dir = write_job(plan, session.root / "jobs" / args.mode, args.mode)
    job_id = session.submit(job_dir, args.user)
    session.state["jobs"][job_id].update(job_name=plan.job_name, mode=args.mode)
    session._save_state()
    print(job_id)
    return 0


def _cmd_wait(session: PocSession, args: Any) -> int:
    status = session.wait(args.job_id, args.timeout)
    print(status)
    return 0 if status == "FINISHED:COMPLETED" else 1


def _cmd_download(session: PocSession, args: Any) -> int:
    job_id = args.job_id or session.state.get("last_job")
    if not job_id:
        raise PocError("no job submitted in this POC")
    job = session.state["jobs"][job_id]
    out = Path(args.output or f"runs/poc-{job.get('job_name', 'job')}-{job_id[:8]}")
    target = OutputTarget(out, overwrite=args.overwrite, option="-o")
    target.check()
    download = session.download(job_id, session.root / "downloads")
    extra = {"env": "poc", "mode": job.get("mode"), "job_id": job_id, "status": job.get("status"),
             "sites": session.state["sites"]}
    staging = target.begin()
    try:
        summary = write_run_outputs(download, staging, None, extra)  # the plan the downloaded job carries
        target.publish()
    except BaseException:
        target.abandon()
        raise
    print(results_text([summary], out))
    return 0


def _cmd_stop(session: PocSession, args: Any) -> int:
    session.stop()
    if args.command == "clean":
        session.clean()
    return 0


def _cmd_run(session: PocSession, args: Any) -> int:
    plan = _plan_from_args(args)
    out = Path(args.output or f"runs/poc-{plan.job_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    # run_poc holds the POC root itself: --root or $MEDFLARE_POC_ROOT when given, else inside the run's staging
    root = Path(args.root) if args.root else None
    summary = run_poc(plan, out, mode=args.mode, port=args.port, overwrite=args.overwrite, root=root)
    print(results_text([summary], out))
    return 0


def make_parser() -> Any:
    """The command line of ``python -m medflare.console.deploy.poc`` (the steps ``poc/*.sh`` call)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m medflare.console.deploy.poc", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="folder for this POC (HOME, workspace, jobs); default $MEDFLARE_POC_ROOT or "
                                       "runs/poc ('run': or inside its result folder's staging)")
    parser.add_argument("--port", type=int, help="server port (default $MEDFLARE_POC_PORT or 8002)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="provision a fresh POC (removes any previous one in --root)")
    p.add_argument("--sites", type=int, default=2, help="number of sites site-1..N (default 2)")
    p.add_argument("--mode-default", choices=SITE_MODES, default="byoc", help="site mode (default byoc)")
    p.add_argument("--site-mode", action="append", default=[], metavar="SITE=MODE", help="e.g. site-2=preinstalled")
    p.add_argument("--allow-job-data", action="store_true",
                   help="sites accept jobs that bring their own (e.g. synthetic) data; otherwise each site reads "
                        "only its local/medflare_site.json")
    p.add_argument("--he", action="store_true", help="also provision FLARE's TenSEAL contexts (HEBuilder), for "
                                                     "jobs with secure_aggregation=he")
    p.set_defaults(func=_cmd_prepare)
    p = sub.add_parser("start", help="start server and sites; returns when they are ready")
    p.add_argument("--exclude", action="append", default=[], help="participant not to start")
    p.add_argument("--timeout", type=float, default=120)
    p.set_defaults(func=_cmd_start)
    for name, func, text in (("submit", _cmd_submit, "export a method's job and submit it as the lead"),
                             ("run", _cmd_run, "prepare, start, submit, wait, download, stop and clean")):
        p = sub.add_parser(name, help=text)
        p.add_argument("method")
        add_run_options(p)
        p.add_argument("--mode", choices=["byoc", "preinstalled"], default="byoc")
        if name == "submit":
            p.add_argument("--user", help="admin who submits (default: the project's lead)")
        else:
            p.add_argument("-o", "--output", help="result folder (default runs/poc-<method>-<time>); must be new")
            p.add_argument("--overwrite", action="store_true", help="replace medflare's earlier results there")
        p.set_defaults(func=func, holds_root=name == "run")
    p = sub.add_parser("wait", help="wait for a job (default: the last submitted); exit 0 if it completed")
    p.add_argument("job_id", nargs="?")
    p.add_argument("--timeout", type=float, default=1800)
    p.set_defaults(func=_cmd_wait)
    p = sub.add_parser("download", help="download a job and write summary.json, rounds.csv, report.md, plots")
    p.add_argument("job_id", nargs="?")
    p.add_argument("-o", "--output", help="result folder (default runs/poc-<method>-<job>); must be new")
    p.add_argument("--overwrite", action="store_true", help="replace medflare's earlier results there")
    p.set_defaults(func=_cmd_download)
    sub.add_parser("stop", help="stop every process of this POC").set_defaults(func=_cmd_stop)
    sub.add_parser("clean", help="stop (if needed) and delete this POC").set_defaults(func=_cmd_stop)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m medflare.console.deploy.poc``: one POC step (prepare, start, submit, wait, download, stop, clean)."""
    import sys

    from medflare.console.processes import Interrupted, stop_on_signals

    args = make_parser().parse_args(argv)
    try:
        session = PocSession(Path(args.root or env_root() or DEFAULT_ROOT), port=args.port or env_port())
        held = contextlib.nullcontext() if getattr(args, "holds_root", False) else session.hold()
        with stop_on_signals(), held:
            return args.func(session, args)
    except MedflareError as exc:
        print(f"poc: error: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"poc: interrupted by {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
