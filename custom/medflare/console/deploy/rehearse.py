r"""Rehearse a cross-hospital deployment on one machine: ``medflare rehearse`` (needs root).

The consortium is provisioned with the normal flow (:func:`medflare.console.deploy.provision.provision`) from
``provisioning/project.yml``, cut to the server, N hospitals and the people. Every participant runs from its own
startup kit (``startup/start.sh``) in its own network namespace and address, joined by a bridge
(:mod:`medflare.console.deploy.netns`); the server's names resolve through ``/etc/netns/<ns>/hosts``. Each hospital reads
its own synthetic images from its kit's ``local/medflare_site.json``. The lead, in its namespace, submits a
pre-installed job (``nvflare job submit``, as ``docs/deploy-lead.md`` says), follows it with ``medflare watch``,
downloads it and builds the report (``medflare report``). Meanwhile links are shaped (``tc tbf``), taken down and
back, and hospitals or the server killed and restarted, as scripted; after a server crash the lead resubmits the job
with ``resume_from`` (``docs/deploy.md``). At the end the deployment's promises are checked and ``rehearsal.json``
(timings, rounds, faults, checks) written beside the report.

Everything it made is removed at the end, also on failure, SIGTERM or Ctrl-C; the server and sites run under
medflare's process keeper (:mod:`medflare.console.processes`), so they die with it even when it is SIGKILLed, and its reaper
(:mod:`medflare.console.deploy.reaper`, started first) then removes its namespaces, every process in them (a preflight, the
lead's watch) and the kits; a rehearsal whose reaper died too is swept by the next one.

Command line::

    medflare rehearse --hospitals 2 --rounds 2 -o runs/rehearse
    medflare rehearse --hospitals 3 --min-clients 2 --straggler 10 --rate hospital-c=10 \
        --outage hospital-b@round2:25 --kill hospital-c@round3:5 -o runs/rehearse-faults
    medflare rehearse --hospitals 3 --min-clients 2 --rounds 4 --kill-server round3:5 -o runs/rehearse-server
    python -m medflare.console.deploy.rehearse faults -o runs/rehearse-faults     # the fault matrix (make rehearse-faults)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from medflare.console.deploy.netns import Wan, sweep_stale, unavailable_reason
from medflare.console.deploy.reaper import start_reaper, stop_reaper
from medflare.console.processes import end_processes, run_kept
from medflare.errors import ConfigError, MedflareError

if TYPE_CHECKING:
    from medflare.plan import RunPlan

# provisioning, policies and FLARE are imported where used: `medflare --help` builds this command's options

REPO_DIR = Path(__file__).resolve().parents[4]
DEFAULT_PROJECT = REPO_DIR / "provisioning" / "project.yml"
TASK = {"num_classes": 2, "in_channels": 1, "image_size": 28,  # what each hospital's synthetic data yields
        "class_names": ["class_0", "class_1"]}
MID_ROUND_DELAY = 1.0  # seconds after a round starts that a round-triggered fault strikes (sites are training)
STRAGGLER_SLACK = 3.0  # seconds the server may take past the straggler wait to cancel the task and aggregate
WORK_ALLOWANCE = 60.0  # seconds a round may take for the sites' local work and transfers, on top of the waits
# a hospital whose link or processes come back reconnects (FLARE's retry back-off) and redoes its task in this long
RECONNECT_ALLOWANCE = 30.0
SERVER = "server"  # the ``site`` of a server fault: the consortium's server, whatever its name
ERROR_LINE = re.compile(r"\bERROR\b")  # a line FLARE logged at error level
PRIVATE_FOLDERS = ("kits", "home")  # below the work folder: every participant's private key, the admins' home
Echo = Callable[[str], None]


class RehearseError(MedflareError, RuntimeError):
    """The rehearsal could not run, or its deployment broke a promise; the message says which."""


# ----- what to rehearse ------------------------------------------------------------------------------------------
@dataclass
class Fault:
    """One scripted fault at one hospital or at the server (``site`` :data:`SERVER`), ``duration`` seconds long."""

    kind: str  # "outage" (link down, then back), "kill" (every process SIGKILLed, then the kit started again) or
    # "server" (the same for the server; once the hospitals are back, the lead resubmits with resume_from)
    site: str
    round: int | None  # strike when this round (1-based) has started, plus MID_ROUND_DELAY (None: at seconds)
    seconds: float  # after submission
    duration: float  # seconds until the link comes back / the kit is started again

    @classmethod
    def parse(cls, kind: str, text: str) -> Fault:
        """``SITE@roundK:DURATION`` or ``SITE@SECONDS:DURATION``."""
        match = re.fullmatch(r"([^@]+)@(round(\d+)|(\d+(?:\.\d+)?))(?::(\d+(?:\.\d+)?))", text.strip())
        if not match:
            raise ConfigError(f"--{kind} '{text}' must be SITE@roundK:SECONDS or SITE@SECONDS:SECONDS "
                              f"(e.g. hospital-b@round2:25)")
        site, _, round_, seconds, duration = match.groups()
        return cls(kind, site, int(round_) if round_ else None, float(seconds or 0), float(duration))

    @classmethod
    def server_crash(cls, text: str) -> Fault:
        """``--kill-server``'s ``roundK:DURATION`` or ``SECONDS:DURATION``."""
        try:
            return cls.parse("server", f"{SERVER}@{text}")
        except ConfigError:
            raise ConfigError(f"--kill-server '{text}' must be roundK:SECONDS or SECONDS:SECONDS (e.g. "
                              "round3:5)") from None

    def describe(self) -> str:
        when = f"round {self.round}" if self.round is not None else f"{self.seconds:g} s after submission"
        what = "link down" if self.kind == "outage" else "processes killed"
        text = f"{self.site}: {what} at {when} for {self.duration:g} s"
        return text + ("; the job resubmitted with resume_from" if self.kind == "server" else "")


@dataclass
class Rehearsal:
    """A rehearsal's settings (``medflare rehearse``'s options)."""

    hospitals: int = 2  # named as in project.yml, then hospital-d, -e, ...
    method: str = "fedavg"
    model: str = "cnn"
    rounds: int = 2
    min_clients: int = 0  # sites each round needs (0 = every hospital)
    straggler_seconds: int = 10  # how long a round waits for the others once min_clients answered
    task_timeout: int = 0  # seconds a site may take per task (0 = medflare's default, 3600)
    max_steps: int = 5
    batch_size: int = 32
    images: int = 200  # synthetic training images per hospital
    rates: dict[str, float] = field(default_factory=dict)  # Mbit/s per hospital (tc tbf both ways); others unshaped
    faults: list[Fault] = field(default_factory=list)  # at most one of the server
    job_timeout: float = 900
    project_file: Path = DEFAULT_PROJECT
    transfer_dtype: str = "float32"
    download_dtype: str = "float32"

    def all_required(self) -> bool:
        """Every hospital must answer each round (``min_clients`` 0 or the number of hospitals)."""
        return self.min_clients == 0 or self.min_clients >= self.hospitals

    def awaited_fault(self) -> float | None:
        """The longest hospital fault's duration when every round waits for the faulted hospital, else None."""
        durations = [f.duration for f in self.faults if f.kind != "server"]
        return max(durations) if durations and self.all_required() else None

    def round_bound(self) -> float:
        """The longest a round may take, never more than the task timeout: the healthy sites' work and transfers
        (:data:`WORK_ALLOWANCE`) and the straggler wait, which is all a dead or cut-off site costs once
        ``min_clients`` answered; when every hospital is required, the round also waits out the longest hospital
        fault and :data:`RECONNECT_ALLOWANCE`."""
        awaited = self.awaited_fault()
        wait = self.straggler_seconds + (awaited + RECONNECT_ALLOWANCE if awaited is not None else 0.0)
        return min(self.task_timeout or 3600, WORK_ALLOWANCE + wait) + 5.0

    def bound_text(self) -> str:
        """How :meth:`round_bound` is made up, for the check's expected column."""
        parts = f"straggler {self.straggler_seconds} s + {WORK_ALLOWANCE:.0f} s work"
        if (awaited := self.awaited_fault()) is not None:
            parts += f" + the longest fault {awaited:g} s + {RECONNECT_ALLOWANCE:.0f} s to reconnect (every hospital " \
                     "required)"
        return f"<= {self.round_bound():.0f} s ({parts}, capped by the task timeout)"


def consortium(project: dict[str, Any], hospitals: int) -> dict[str, Any]:
    """project.yml cut to the server, ``hospitals`` hospitals (the project's first, then hospital-d, -e, ...; orgs
    likewise) and the project's people."""
    from medflare.console.deploy.provision import participants

    chosen = [dict(c) for c in participants(project, "client")[:hospitals]]
    for index in range(len(chosen), hospitals):
        letter = chr(ord("a") + index) if index < 26 else str(index)
        chosen.append({"name": f"hospital-{letter}", "type": "client", "org": f"hospital_{letter}"})
    people = [p for p in project["participants"] if p.get("type") not in ("server", "client")]
    return {**project, "participants": [*participants(project, "server"), *chosen, *people]}


# ----- the rehearsal ---------------------------------------------------------------------------------------------
class Stage:
    """Runs one rehearsal; :meth:`close` removes everything it made (called on every way out)."""

    def __init__(self, plan: Rehearsal, work: Path, echo: Echo) -> None:
        self.plan, self.work, self.echo = plan, work.resolve(), echo  # absolute: commands run in work/home
        self.wan: Wan | None = None
        self.keepers: dict[str, list[subprocess.Popen]] = {}
        self.timings: dict[str, float] = {}
        self.events: list[dict[str, Any]] = []
        self.pending = [self._schedule(f) for f in plan.faults]  # played across the crashed and the resumed job
        self.job_ids: list[str] = []  # the jobs submitted, in order (a second one after a server crash)
        self.resume_from = ""  # a crashed job whose server is back: the lead submits it again with resume_from
        self.t0 = time.time()
        self.job_plan: RunPlan | None = None  # the lead job's, once exported

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Record the block's wall time as ``timings[name]`` (``rehearsal.json``: where the rehearsal's time went)."""
        started = time.time()
        try:
            yield
        finally:
            self.timings[name] = time.time() - started

    # ----- set-up ------------------------------------------------------------------------------------------
    def provision(self) -> None:
        import yaml

        from medflare.console.deploy.policies import site_data_config
        from medflare.console.deploy.provision import admin_with_role, load_project, participants, provision

        project = consortium(load_project(self.plan.project_file), self.plan.hospitals)
        self.server = participants(project, "server")[0]
        self.hospitals = [c["name"] for c in participants(project, "client")]
        self.lead = admin_with_role(project, "lead")
        self.project_admin = admin_with_role(project, "project_admin")
        for name in self.plan.rates:
            if name not in self.hospitals:
                raise ConfigError(f"--rate names '{name}', not one of the hospitals {self.hospitals}")
        for fault in self.plan.faults:
            if fault.kind != "server" and fault.site not in self.hospitals:
                raise ConfigError(f"--{fault.kind} names '{fault.site}', not one of the hospitals {self.hospitals}")
        if sum(f.kind == "server" for f in self.plan.faults) > 1:
            raise ConfigError("--kill-server can be given once: a rehearsal resumes one crashed job")
        project_file = self.work / "project.yml"
        project_file.write_text(yaml.safe_dump(project, sort_keys=False))
        with self.timed("provision"):
            self.prod = provision(project_file, self.work / "kits", "preinstalled")
            for index, site in enumerate(self.hospitals):  # each hospital's own images, named by the hospital
                source = f"synthetic:n={self.plan.images},classes={TASK['num_classes']},channels=1,size=28"
                config = site_data_config(source, seed=index + 1)
                (self.kit(site) / "local" / "medflare_site.json").write_text(json.dumps(config, indent=2) + "\n")
        self.echo(f"rehearse: provisioned {self.server['name']}, {', '.join(self.hospitals)} and {self.lead} "
                  f"({self.prod})")

    def kit(self, participant: str) -> Path:
        return self.prod / participant

    def server_log(self) -> str:
        log = self.kit(self.server["name"]) / "log.txt"
        return log.read_text(errors="replace") if log.is_file() else ""

    def network(self) -> None:
        names = [self.server["name"], *self.hospitals, self.lead]
        server_names = [self.server["name"], *self.server.get("host_names", [])]
        with self.timed("network"):
            self.wan = Wan(names, {name: self.server["name"] for name in server_names})
            self.wan.up()
            for site, mbit in self.plan.rates.items():
                self.wan.set_rate(site, mbit)
        shaped = ", ".join(f"{s} {m:g} Mbit/s" for s, m in self.plan.rates.items()) or "no shaping"
        self.echo(f"rehearse: {len(names)} namespaces on a bridge ({shaped}); {self.server['name']} is "
                  f"{self.wan.hosts[self.server['name']].address} in every namespace's /etc/netns/<ns>/hosts")

    def env(self) -> dict[str, str]:
        """The environment every participant starts from: this interpreter's environment first on PATH (the kits'
        ``sub_start.sh`` runs ``python3``), a HOME of the rehearsal's own (no ~/.nvflare of the user's), and a
        TMPDIR of its own, removed with the rehearsal's folder."""
        from medflare.flare.memory import with_allocator_settings

        home, tmp = self.work / "home", self.work / "tmp"  # FLARE leaves each job it sends or receives in TMPDIR
        home.mkdir(exist_ok=True)
        tmp.mkdir(exist_ok=True)
        env = with_allocator_settings({**os.environ, "HOME": str(home), "TMPDIR": str(tmp)})
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.pop("NVFLARE_STARTUP_KIT_DIR", None)
        return env

    def start(self, participant: str) -> None:
        """``startup/start.sh`` of the participant's kit, in its namespace, under a keeper."""
        kit = self.kit(participant)
        for name in ("daemon_pid.fl", "pid.fl", "shutdown.fl", "restart.fl"):  # a killed daemon's leftovers
            (kit / name).unlink(missing_ok=True)
        command = [*self.wan.exec_prefix(participant), "bash", str(kit / "startup" / "start.sh")]
        done, keeper = run_kept(command, timeout=60, env=self.env(), cwd=str(kit))
        self.keepers.setdefault(participant, []).append(keeper)
        if done.returncode != 0:
            raise RehearseError(f"{participant}'s startup/start.sh failed ({done.returncode}): {done.stderr[-500:]}")

    def in_ns(self, participant: str, command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        from medflare.console.processes import flare_admin_command  # in the rehearsal's home: processes.py says why

        with flare_admin_command(self.work / "home", self.env()) as popen_args:
            return subprocess.run([*self.wan.exec_prefix(participant), *command], capture_output=True, text=True,
                                  timeout=timeout, **popen_args)

    def nvflare(self, participant: str, admin: str, *args: str, timeout: float = 300) -> dict[str, Any]:
        """``nvflare ... --startup-kit <admin's kit> --format json`` run in ``participant``'s namespace."""
        from medflare.console.processes import nvflare_command, nvflare_reply

        command = [*nvflare_command(), *args, "--startup-kit", str(self.kit(admin)), "--format", "json"]
        return nvflare_reply(self.in_ns(participant, command, timeout))

    def connected(self) -> list[str]:
        """Hospitals the server lists as connected, as the coordinating centre sees it (its admin kit, from the
        server's namespace)."""
        reply = self.nvflare(self.server["name"], self.project_admin, "system", "status", timeout=60)
        text = json.dumps(reply.get("data", {}))
        return [site for site in self.hospitals if f'"{site}"' in text]

    def wait_connected(self, sites: list[str], timeout: float) -> float:
        started = time.time()
        while time.time() - started < timeout:
            if set(sites) <= set(self.connected()):
                return time.time() - started
            time.sleep(1)
        raise RehearseError(f"{sites} did not all connect to {self.server['name']} within {timeout:.0f} s; "
                            f"see their kits' log.txt")

    def start_all(self) -> None:
        with self.timed("start_and_connect"):
            for participant in [self.server["name"], *self.hospitals]:
                self.start(participant)
            self.wait_connected(self.hospitals, timeout=180)
        self.echo(f"rehearse: server and {len(self.hospitals)} hospitals started from their kits and connected "
                  f"({self.timings['start_and_connect']:.0f} s)")

    # ----- the job -----------------------------------------------------------------------------------------
    def run_config(self) -> Any:
        from medflare.console.deploy.apps import deployment_run

        plan = self.plan
        return deployment_run(
            plan.method, model=plan.model, rounds=plan.rounds, clients=len(self.hospitals),
            min_clients=plan.min_clients or len(self.hospitals), data={"source": "site"}, task=dict(TASK),
            train={"max_steps": plan.max_steps, "batch_size": plan.batch_size},
            straggler_seconds=plan.straggler_seconds, task_timeout=plan.task_timeout,
            transfer_dtype=plan.transfer_dtype, download_dtype=plan.download_dtype, name=f"rehearse-{plan.method}")

    def export(self) -> Path:
        from medflare.console.job_export import write_job
        from medflare.plan import resolve

        self.job_plan = resolve(self.run_config(), "preinstalled", check_files=False)
        return write_job(self.job_plan, self.work / "jobs", "preinstalled")  # what `medflare export` writes

    def preflight(self, job_dir: Path) -> dict[str, str]:
        """``medflare preflight KIT --job JOB`` for each hospital, in its namespace, as its admin runs it before
        the job (the server up, reached by its name); each hospital's overall result, or RehearseError naming the
        failing checks."""
        results = {}
        for site in self.hospitals:
            done = self.in_ns(site, [sys.executable, "-m", "medflare.console.cli", "preflight", str(self.kit(site)),
                                     "--job", str(job_dir), "--json"], timeout=300)
            try:
                report = json.loads(done.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError) as exc:
                raise RehearseError(f"{site}'s preflight printed no report ({done.returncode}): "
                                    f"{done.stderr[-500:]}") from exc
            failed = [f"{c['check']}: {c['detail']}" for c in report["checks"] if c["status"] == "FAIL"]
            if failed:
                raise RehearseError(f"{site}'s preflight failed: " + "; ".join(failed))
            results[site] = report["overall"]
        self.echo(f"rehearse: preflight {', '.join(f'{site} {result}' for site, result in results.items())}")
        return results

    def submit(self, job_dir: Path) -> str:
        reply = self.nvflare(self.lead, self.lead, "job", "submit", "-j", str(job_dir))
        job_id = (reply.get("data") or {}).get("job_id")
        if reply["exit_code"] != 0 or not job_id:
            raise RehearseError(f"the lead's 'nvflare job submit' failed: {reply.get('message', reply)}")
        if not self.job_ids:  # fault times and the job's time count from the first submission
            self.submitted_at = time.time()
        self.job_ids.append(job_id)
        self.echo(f"rehearse: {self.lead} submitted {job_dir.name} from its namespace: job {job_id}")
        return job_id

    def resubmit(self, job_dir: Path) -> str:
        """The documented recovery from a server crash (``docs/deploy.md`` §8): once every hospital is connected to
        the restarted server, the lead submits the same job again with ``resume_from`` = the crashed job's id."""
        from medflare.console.job_export import set_resume

        crashed, self.resume_from = self.resume_from, ""
        event = next(e for e in self.events if e.get("crashed_job") == crashed)
        event["reconnected_after"] = self.wait_connected(self.hospitals, timeout=180)
        resumed = set_resume(shutil.copytree(job_dir, self.work / "jobs" / f"{job_dir.name}-resumed"), crashed)
        event["resumed_job"] = self.submit(resumed)
        return event["resumed_job"]

    def server_results(self, job_id: str) -> dict[str, Any] | None:
        from medflare.flare.controller import RESULTS_FILE

        path = self.kit(self.server["name"]) / job_id / "app_server" / RESULTS_FILE
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())
        return None

    def follow(self, job_id: str) -> int:
        """``medflare watch`` in the lead's namespace until the job ends, while the scripted faults play out;
        returns watch's exit code."""
        command = [*self.wan.exec_prefix(self.lead), sys.executable, "-m", "medflare.console.cli", "watch", job_id,
                   "--startup-kit", str(self.kit(self.lead)), "--interval", "1",
                   "--timeout", str(int(self.plan.job_timeout))]
        watcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env=self.env(), start_new_session=True)

        def read() -> None:
            for line in watcher.stdout:
                self.echo(f"  lead> {line.rstrip()}")

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            # a crashed server ends watch (or leaves it waiting): the loop goes on until the server is back
            while watcher.poll() is None or self._server_down():
                rounds_started = None
                if any(p["state"] != "done" for p in self.pending):
                    results = self.server_results(job_id)
                    rounds_started = len(results["rounds"]) + 1 if results else int(self._job_running(job_id))
                for item in self.pending:
                    self._advance(item, rounds_started)
                if self.resume_from == job_id:  # its server is back: the job stays RUNNING for good (FLARE 2.9)
                    return watcher.poll() or 0
                time.sleep(0.5)
            self._finish_pending()
        finally:
            if watcher.poll() is None:
                end_processes([watcher])
            reader.join(timeout=10)
        return watcher.returncode

    def _job_running(self, job_id: str) -> bool:
        return (self.kit(self.server["name"]) / job_id / "app_server").is_dir()

    def _server_down(self) -> bool:
        return any(p["fault"].kind == "server" and p["state"] == "struck" for p in self.pending)

    def _finish_pending(self) -> None:
        """The job ended first: links come back and kits start, for the clean-up and checks; a server crash that
        has not struck yet is recorded as not played (a crash after the job would rehearse nothing)."""
        for item in self.pending:
            if item["fault"].kind == "server" and item["state"] == "waiting":
                item["state"] = "done"
                self.events.append({**item["record"], "not_played": "the job ended before it was due"})
            while item["state"] != "done":
                item["due"] = 0.0
                self._advance(item, None)

    def _schedule(self, fault: Fault) -> dict[str, Any]:
        return {"fault": fault, "state": "waiting", "due": None, "record": {"fault": fault.describe(), "site": fault.site}}

    def _advance(self, item: dict[str, Any], rounds_started: int | None) -> None:
        fault, record, now = item["fault"], item["record"], time.time()
        if item["state"] == "waiting":
            if fault.round is not None:
                if rounds_started is not None and rounds_started >= fault.round and item["due"] is None:
                    item["due"] = now + MID_ROUND_DELAY
            elif item["due"] is None:
                item["due"] = self.submitted_at + fault.seconds
            if item["due"] is not None and now >= item["due"]:
                if fault.kind == "outage":
                    self.wan.set_link(fault.site, False)
                else:
                    record["killed_pids"] = len(self.wan.end_processes(self._participant(fault), sig=signal.SIGKILL))
                if fault.kind == "server":
                    record["crashed_job"] = self.job_ids[-1]
                record["struck_at"] = now - self.submitted_at
                self.echo(f"rehearse: fault: {fault.describe()} (at {record['struck_at']:.1f} s)")
                item["state"], item["due"] = "struck", now + fault.duration
        elif item["state"] == "struck" and now >= item["due"]:
            if fault.kind == "outage":
                self.wan.set_link(fault.site, True)
                self.echo(f"rehearse: {fault.site}'s link is back")
            else:
                if fault.kind == "server":  # what the crashed job left: the resumed job must start from it
                    record["checkpoint"] = self.checkpoint_facts(record["crashed_job"])
                    self.resume_from = record["crashed_job"]
                self.start(self._participant(fault))
                self.echo(f"rehearse: {self._participant(fault)} started again from its kit")
            record["recovered_at"] = time.time() - self.submitted_at
            item["state"] = "done"
            self.events.append(record)

    def _participant(self, fault: Fault) -> str:
        return self.server["name"] if fault.kind == "server" else fault.site

    def checkpoint_facts(self, job_id: str) -> dict[str, Any]:
        """The last round job ``job_id``'s controller checkpointed, and the digest of the model it holds (what a
        resumed job must continue from); {} when there is none."""
        from medflare.flare.controller import CHECKPOINT_FILE
        from medflare.ops.checkpoint import load_checkpoint
        from medflare.resume import model_digest

        path = self.kit(self.server["name"]) / job_id / "app_server" / CHECKPOINT_FILE
        try:
            params, state = load_checkpoint(path)
        except (OSError, ValueError, KeyError, MedflareError):
            return {}
        return {"next_round": int(state["next_round"]), "model_digest": model_digest(params)}

    def download_and_report(self, job_id: str) -> Path:
        """The lead downloads the job and builds the report, as ``docs/deploy-lead.md`` says."""
        from medflare.flare.controller import RESULTS_FILE

        reply = self.nvflare(self.lead, self.lead, "job", "download", job_id, "-o", str(self.work / "download"),
                             "--force")
        if reply["exit_code"] != 0:
            raise RehearseError(f"the lead's 'nvflare job download' failed: {reply.get('message', reply)}")
        found = sorted((self.work / "download").glob(f"**/app_server/{RESULTS_FILE}"))
        if not found:
            raise RehearseError(f"the downloaded job has no {RESULTS_FILE}: it did not run (see the server log)")
        done = self.in_ns(self.lead, [sys.executable, "-m", "medflare.console.cli", "report", str(found[0]), "-o",
                                      str(self.work / "report")])
        if done.returncode != 0:
            last = "\n".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise RehearseError(f"'medflare report' failed: {last}")
        return found[0]

    def job_status(self, job_id: str) -> str:
        reply = self.nvflare(self.lead, self.lead, "job", "meta", job_id, timeout=60)
        return str((reply.get("data") or {}).get("status", "UNKNOWN"))

    def keep_logs(self, out: Path) -> None:
        """The server's and every hospital's log, and each hospital's own medflare site log of every job (where
        its task time went; this machine plays every hospital: the logs are all here)."""
        from medflare.site_runtime import SITE_LOG_FILE

        if not hasattr(self, "prod"):
            return
        for participant in [self.server["name"], *self.hospitals]:
            log = self.kit(participant) / "log.txt"
            if log.is_file():
                (out / "logs").mkdir(parents=True, exist_ok=True)
                shutil.copy(log, out / "logs" / f"{participant}.log")
            for job_id in self.job_ids:
                for site_log in (self.kit(participant) / job_id).glob(f"*/{SITE_LOG_FILE}"):
                    shutil.copy(site_log, out / "logs" / f"{participant}.{job_id}.{SITE_LOG_FILE}")

    def close(self) -> None:
        """End every process, remove every namespace, qdisc and hosts file, and the kits. Never raises."""
        with contextlib.suppress(Exception):
            end_processes([k for keepers in self.keepers.values() for k in keepers])
        if self.wan is not None:
            self.wan.teardown()
        for folder in self.private_folders():  # every participant's private key
            shutil.rmtree(folder, ignore_errors=True)

    def private_folders(self) -> list[Path]:
        """What :meth:`close` removes besides namespaces and processes (the reaper's too, if this process dies)."""
        return [self.work / name for name in PRIVATE_FOLDERS]


# ----- checks ----------------------------------------------------------------------------------------------------
def model_is_finite(path: Path, job_plan: RunPlan) -> str | None:
    """None when the persisted global model loads with exactly the keys of the model of ``job_plan`` (the job's
    :class:`medflare.plan.RunPlan`) and only finite values, else why."""
    import numpy as np
    import torch

    from medflare.server_setup import global_model

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        return f"{path.name} does not load: {exc}"
    expected = global_model(replace(job_plan.network, pretrained=None))
    if set(state) != set(expected.state_dict()):
        return f"{path.name} has keys {sorted(set(state) ^ set(expected.state_dict()))} the method's model has not"
    bad = [k for k, v in state.items() if not np.isfinite(np.asarray(v, dtype=np.float64)).all()]
    return f"{path.name} has non-finite values in {bad}" if bad else None


def check_outcome(plan: Rehearsal, status: str, results: dict[str, Any], model_problem: str | None,
                  hospitals: list[str], events: list[dict[str, Any]], rejoined: dict[str, bool],
                  server_log: str, job_id: str, submitted_at: float | None = None) -> list[dict[str, Any]]:
    """What the deployment promises, each as {check, expected, observed, ok}; ``submitted_at`` (the job's
    submission time) places the faults' times, relative to it, among the rounds'."""
    from medflare.console.deploy.policies import SITE_HEARTBEAT_TIMEOUT

    rounds = results.get("rounds", [])
    walls = [r.get("wall_seconds", 0.0) for r in rounds]
    faulted = {f.site for f in plan.faults if f.kind != "server"}
    dead_site_report = "terminal outcome unavailable from"
    killed = {f.site for f in plan.faults if f.kind == "kill"}
    status_ok = status == "FINISHED:COMPLETED" or (
        status == "FINISHED:ABNORMAL" and bool(killed) and f"Failing job {job_id}: {dead_site_report}" in server_log)
    checks = [
        _check("job status", "FINISHED:COMPLETED" + (
            " (or FINISHED:ABNORMAL naming the killed site as dead)" if killed else ""), status, status_ok),
        _check("rounds", f"all {plan.rounds}, no error",
               f"{len(rounds)}" + (f", error: {results['error']}" if results.get("error") else ""),
               len(rounds) == plan.rounds and not results.get("error")),
        _check("model", "FL_global_model.pt loads, finite, the method's keys", model_problem or "ok",
               model_problem is None),
        _check("longest round", plan.bound_text(), f"{max(walls, default=0):.1f} s",
               bool(walls) and max(walls) <= plan.round_bound()),
    ]
    waits = [r.get("wall_seconds", 0.0) - max((v.get("result_at", 0.0) for v in r.get("sites", {}).values()),
                                              default=0.0)
             for r in rounds if set(hospitals) - set(r.get("share", {}))]
    if waits:  # a round short of a site: once the others answered, it waits the straggler time, not more
        checks.append(_check("straggler wait", f"rounds short of a site end <= {plan.straggler_seconds} + "
                                               f"{STRAGGLER_SLACK:.0f} s after the last result",
                             f"longest {max(waits):.1f} s over {len(waits)} round(s)",
                             max(waits) <= plan.straggler_seconds + STRAGGLER_SLACK))
    healthy = [s for s in hospitals if s not in faulted]
    in_every = all(set(healthy) <= set(r.get("share", {})) for r in rounds)
    checks.append(_check("healthy hospitals", f"{healthy} in every round's aggregate",
                         "yes" if in_every else "missing from some round", in_every))
    for site in sorted(faulted):
        missed = [r["round"] + 1 for r in rounds if site not in r.get("share", {})]
        checks.append(_check(f"{site} rejoined", "connected to the server again after its fault",
                             "connected" if rejoined.get(site) else "not connected", bool(rejoined.get(site))))
        outage = [f for f in plan.faults if f.site == site and f.kind == "outage"]
        if outage and plan.all_required():  # each round waited for it: it is in every round's aggregate
            checks.append(_check(f"{site} in every round", "every hospital required: each round waits for it "
                                 "through the outage", f"missed rounds {missed}", not missed))
        elif outage and outage[0].duration < SITE_HEARTBEAT_TIMEOUT:
            back = bool(missed) and any(site in r.get("share", {}) for r in rounds if r["round"] + 1 > missed[0])
            # an outage that outlasts the last round's start leaves no round to come back in: nothing to hold against
            none_left = bool(missed) and not back and not rounds_after_recovery(site, rounds, events, submitted_at)
            observed = "; back afterwards" if back else "; the job had no later round" if none_left else "; not back"
            checks.append(_check(f"{site} back in the job", "misses the cut-off round(s), in a later round's "
                                 "aggregate again (when the job has one)", f"missed rounds {missed}" + observed,
                                 back or none_left))
        else:
            checks.append(_check(f"{site} rounds missed", "recorded", f"{missed}", True))
    for event in events:
        played = (f"struck at {event.get('struck_at', 0):.1f} s, recovered at {event.get('recovered_at', 0):.1f} s"
                  if "struck_at" in event else f"not played: {event.get('not_played', 'unknown')}")
        checks.append(_check("fault played", event["fault"], played, "struck_at" in event))
    crashes = [e for e in events if "crashed_job" in e]
    return checks + (server_crash_checks(plan, results, crashes[0]) if crashes else [])


def rounds_after_recovery(site: str, rounds: list[dict[str, Any]], events: list[dict[str, Any]],
                          submitted_at: float | None) -> list[dict[str, Any]]:
    """The rounds that started after ``site``'s last fault recovered (every round when the times are unknown)."""
    recovered = [e["recovered_at"] for e in events if e.get("site") == site and "recovered_at" in e]
    if submitted_at is None or not recovered:
        return rounds
    return [r for r in rounds if float(r.get("started_at") or 0.0) - submitted_at >= max(recovered)]


def stalled_rounds(plan: Rehearsal, rounds: list[dict[str, Any]], events: list[dict[str, Any]],
                   submitted_at: float) -> list[dict[str, Any]]:
    """The rounds that took longer than a fault-free round may (work and the straggler wait), each with its cause:
    the scripted faults whose time overlapped it, or that none did."""
    calm = WORK_ALLOWANCE + plan.straggler_seconds + 5.0
    stalled = []
    for record in rounds:
        wall = float(record.get("wall_seconds") or 0.0)
        if wall <= calm:
            continue
        start = float(record.get("started_at") or submitted_at) - submitted_at
        overlapping = [e["fault"] for e in events if "struck_at" in e
                       and e["struck_at"] <= start + wall and e.get("recovered_at", float("inf")) >= start]
        stalled.append({"round": record.get("round", 0) + 1, "wall_seconds": round(wall, 1),
                        "cause": "; ".join(overlapping) or "no scripted fault overlapped it (the sites' work, "
                                                               "the network, or the machine's load)"})
    return stalled


def server_crash_checks(plan: Rehearsal, results: dict[str, Any], crash: dict[str, Any]) -> list[dict[str, Any]]:
    """A server crash's promises: the hospitals connect to the restarted server, and the resubmitted job continues
    from the crashed job's last checkpoint (same round, same model) and plays every round exactly once."""
    checkpoint = crash.get("checkpoint", {})
    done = checkpoint.get("next_round", 0)
    start = (results.get("resumed") or [{}])[-1]
    resumed_at = start["start_round"] + 1 if isinstance(start.get("start_round"), int) else "-"
    played = [r.get("round") for r in results.get("rounds", [])]
    reconnected = crash.get("reconnected_after")
    same_model = start.get("initial_model_digest") == checkpoint.get("model_digest")
    model = "the checkpoint's" if same_model else "another"
    return [
        _check("server restarted", "every hospital connected to the restarted server",
               f"after {reconnected:.0f} s" if reconnected is not None else "not connected", reconnected is not None),
        _check("resumed from the checkpoint", f"job {crash.get('resumed_job')} resumes job {crash['crashed_job']} "
               f"after its checkpointed round with its model: rounds {done + 1}-{plan.rounds}",
               f"checkpoint after round {done}; resumed at round {resumed_at} from {start.get('from_job', 'nothing')}"
               f"; model {model}",
               1 <= done < plan.rounds and start.get("from_job") == crash["crashed_job"]
               and start.get("start_round") == done and same_model),
        _check("every round once", f"rounds 1-{plan.rounds} in order, none repeated",
               ", ".join(str(r + 1) for r in played if isinstance(r, int)) or "none",
               played == list(range(plan.rounds))),
    ]


def _check(check: str, expected: str, observed: str, ok: bool) -> dict[str, Any]:
    """One of the rehearsal's checks, as ``rehearsal.json`` and the checks table hold it."""
    return {"check": check, "expected": expected, "observed": observed, "ok": ok}


# ----- entry point -----------------------------------------------------------------------------------------------
def rehearse(plan: Rehearsal, out_dir: str | Path, echo: Echo = print, overwrite: bool = False) -> dict[str, Any]:
    """Run one rehearsal; write report, logs and ``rehearsal.json`` into ``out_dir``; return the record (``ok``
    false when a check failed). RehearseError: namespaces are unavailable (one line why), or it could not run."""
    from medflare.console.files import OutputTarget

    reason = unavailable_reason()
    if reason:
        raise RehearseError(f"rehearse {reason}")
    if plan.hospitals < 1 or plan.rounds < 1:
        raise ConfigError("--hospitals and --rounds must be at least 1")
    for stale in sweep_stale():
        echo(f"rehearse: removed {stale}, left by a rehearsal that died")
    target = OutputTarget(Path(out_dir), overwrite=overwrite, option="-o")
    staging = target.begin()
    stage = Stage(plan, staging / "work", echo)
    # the kits and the CA's keys go below: readable by this account only from the start, so a SIGKILLed rehearsal
    # (whose folder the next one sweeps) never leaves them open to others in the meantime
    stage.work.mkdir(mode=0o700)
    stage.work.chmod(0o700)
    reaper = start_reaper(os.getpid(), stage.private_folders())  # before any namespace: SIGKILL cannot be caught
    try:
        return _rehearse(plan, out_dir, echo, stage, target, staging)
    finally:
        stop_reaper(reaper)


def _rehearse(plan: Rehearsal, out_dir: str | Path, echo: Echo, stage: Stage, target: Any,
              staging: Path) -> dict[str, Any]:
    """:func:`rehearse` once its output folder (``target``, staged in ``staging``) and its reaper are set up."""
    from medflare.console.deploy.policies import SITE_HEARTBEAT_TIMEOUT

    record: dict[str, Any] = {"plan": {**asdict(plan), "project_file": str(plan.project_file)}}
    try:
        stage.provision()
        stage.network()
        stage.start_all()
        with stage.timed("export"):
            job_dir = stage.export()
        with stage.timed("preflight"):
            record["preflight"] = stage.preflight(job_dir)
        with stage.timed("submit"):
            job_id = stage.submit(job_dir)
        code = stage.follow(job_id)
        if stage.resume_from:  # the server crashed and is back: the lead resubmits the job to resume it
            job_id = stage.resubmit(job_dir)
            code = stage.follow(job_id)
        stage.timings["job"] = time.time() - stage.submitted_at
        with stage.timed("status"):
            status = stage.job_status(job_id)
        for event in stage.events:  # FLARE 2.9 never ends a job its server lost (docs/deploy.md §8)
            if "crashed_job" in event:
                event["crashed_job_status"] = stage.job_status(event["crashed_job"])
        rejoined = {}
        for site in {f.site for f in plan.faults if f.kind != "server"}:
            with contextlib.suppress(RehearseError):
                stage.wait_connected([site], timeout=SITE_HEARTBEAT_TIMEOUT + 30)
                rejoined[site] = True
        with stage.timed("download_and_report"):
            results_path = stage.download_and_report(job_id)
        results = json.loads(results_path.read_text())
        model_problem = model_is_finite(results_path.parent / "FL_global_model.pt", stage.job_plan)
        checks = check_outcome(plan, status, results, model_problem, stage.hospitals, stage.events, rejoined,
                               stage.server_log(), job_id, stage.submitted_at)
        record["stalled_rounds"] = stalled_rounds(plan, results.get("rounds", []), stage.events, stage.submitted_at)
        for stalled in record["stalled_rounds"]:
            stage.echo(f"rehearse: round {stalled['round']} took {stalled['wall_seconds']} s: {stalled['cause']}")
        record.update(
            job_id=job_id, jobs=stage.job_ids, status=status, watch_exit=code, hospitals=stage.hospitals,
            addresses={name: host.address for name, host in stage.wan.hosts.items()},
            rounds=[{"round": r["round"] + 1, "wall_seconds": r.get("wall_seconds"),
                     "sites": sorted(r.get("share", {}))} for r in results.get("rounds", [])],
            faults=stage.events, checks=checks, ok=all(c["ok"] for c in checks))
        if not record["ok"]:
            record["cause"] = failure_cause(record, results, stage.server_log())
        for item in (stage.work / "report").iterdir():
            shutil.move(str(item), staging / item.name)
        shutil.copy(results_path, staging / results_path.name)  # the lead's download: per-round bytes and timings
        stage.keep_logs(staging)
    except BaseException as exc:
        from medflare.console.processes import quiet_on_closed_output, signals_held

        with signals_held():  # a second Ctrl-C must not stop the clean-up half-way
            stage.echo = quiet_on_closed_output(echo)
            stage.echo(f"rehearse: stopped ({exc or type(exc).__name__}); removing namespaces, processes and kits")
            logs = ""
            with contextlib.suppress(Exception):
                logs = stage.server_log()[-20000:] if hasattr(stage, "prod") else ""
            stage.close()
            target.abandon(logs + f"\nrehearse: stopped: {exc or type(exc).__name__}\n")
        raise
    with stage.timed("close"):
        stage.close()
    stage.timings["total"] = time.time() - stage.t0
    record["timings"] = {k: round(v, 1) for k, v in stage.timings.items()}
    shutil.rmtree(stage.work, ignore_errors=True)
    (staging / "rehearsal.json").write_text(json.dumps(record, indent=2) + "\n")
    cause = f"\n\nCause: {record['cause']}" if "cause" in record else ""
    (staging / "rehearsal.md").write_text(checks_table(record["checks"]) + cause + "\n")
    target.publish()
    echo(checks_table(record["checks"]))
    echo(summary_line(record, Path(out_dir)))
    return record


def summary_line(record: dict[str, Any], out_dir: Path) -> str:
    """A rehearsal's last line: passed, or CHECKS FAILED with its cause (:func:`failure_cause`); where it wrote."""
    outcome = "all checks passed" if record["ok"] else f"CHECKS FAILED ({record.get('cause', 'cause unknown')})"
    return f"rehearse: {outcome}; {out_dir}/rehearsal.json, report.md, logs/ ({record['timings']['total']:.0f} s)"


def failure_cause(record: dict[str, Any], results: dict[str, Any], server_log: str) -> str:
    """Why a rehearsal failed, in one line for its summary: the failed checks; a job that did not complete with its
    status and the controller's recorded error; the faults that struck (which, at which site); and the server's
    own reason (FLARE's "Failing job" line, else its first error line about the job)."""
    parts = ["failed: " + ", ".join(c["check"] for c in record["checks"] if not c["ok"])]
    if record["status"] != "FINISHED:COMPLETED":
        error = results.get("error")
        parts.append(f"job {record['job_id']} ended {record['status']}" + (f": {error}" if error else ""))
    struck = [event["fault"] for event in record["faults"] if "struck_at" in event]
    parts.append("faults that struck: " + "; ".join(struck) if struck else "no fault struck")
    # a completed job's error lines (a job cell gone at its end) are no reason: only a failed job's are
    reason = server_reason(server_log, record["job_id"]) if record["status"] != "FINISHED:COMPLETED" else None
    if reason:
        parts.append(f"server: {reason}")
    return " | ".join(parts)


def server_reason(server_log: str, job_id: str, limit: int = 300) -> str | None:
    """The server log's first line saying why job ``job_id`` failed: FLARE's "Failing job <id>" line, else the first
    ERROR line naming the job, else the first ERROR line (cut to ``limit`` characters); None when there is none."""
    lines = server_log.splitlines()
    found = next((line for line in lines if f"Failing job {job_id}" in line), None) or \
        next((line for line in lines if ERROR_LINE.search(line) and job_id in line), None) or \
        next((line for line in lines if ERROR_LINE.search(line)), None)
    return found.strip()[:limit] if found else None


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """``rows`` as a Markdown table of ``columns``, the last one (``ok``) as yes/NO."""
    lines = [f"| {' | '.join(c.replace('_', ' ') for c in columns)} |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join([*(str(r[c]) for c in columns[:-1]), "yes" if r[columns[-1]] else "NO"]) + " |"
              for r in rows]
    return "\n".join(lines)


def checks_table(checks: list[dict[str, Any]]) -> str:
    """The rehearsal's checks as a Markdown table (check, expected, observed, ok)."""
    return markdown_table(checks, ["check", "expected", "observed", "ok"])


# ----- the fault matrix ------------------------------------------------------------------------------------------
STRAGGLER = 10


def fault_matrix() -> list[tuple[str, Rehearsal, str]]:
    """(name, rehearsal, expected outcome) of ``make rehearse-faults``: 3 hospitals, min_clients 2."""
    base = dict(hospitals=3, min_clients=2, rounds=4, straggler_seconds=STRAGGLER, max_steps=20)
    return [
        ("link down mid-round", Rehearsal(**base, faults=[Fault("outage", "hospital-b", 2, 0, 3 * STRAGGLER)]),
         f"round 2 goes on without hospital-b after the {STRAGGLER} s straggler wait; hospital-b is back in a "
         "later round; job COMPLETED"),
        ("hospital killed, kit restarted", Rehearsal(**base, faults=[Fault("kill", "hospital-c", 2, 0, 5)]),
         "the other two finish every round; hospital-c's restarted kit connects to the server again; job COMPLETED "
         "(or ABNORMAL naming hospital-c as dead)"),
        ("one hospital at 10 Mbit/s", Rehearsal(**base, rates={"hospital-a": 10, "hospital-b": 1000,
                                                                 "hospital-c": 1000}),
         "every hospital in every round; job COMPLETED"),
        ("server killed, job resumed", Rehearsal(**base, faults=[Fault("server", SERVER, 3, 0, 5)]),
         "every hospital connects to the restarted server; the job resubmitted with resume_from continues at the "
         "crashed job's last checkpoint with its model, every round once; job COMPLETED"),
    ]


def run_fault_matrix(out_dir: str | Path, echo: Echo = print, overwrite: bool = False,
                     only: list[str] | None = None) -> list[dict[str, Any]]:
    """Every fault of :func:`fault_matrix` in its own rehearsal; writes ``faults.md`` (fault, expected, observed,
    longest round) into ``out_dir``."""
    out = Path(out_dir)
    rows = []
    for index, (name, plan, expected) in enumerate(fault_matrix()):
        if only and str(index + 1) not in only:
            continue
        echo(f"rehearse: fault {index + 1}: {name}")
        record = rehearse(plan, out / f"fault-{index + 1}", echo, overwrite=overwrite)
        failed = [c for c in record["checks"] if not c["ok"]]
        longest = max((r["wall_seconds"] or 0 for r in record["rounds"]), default=0)
        sites = "; ".join(f"r{r['round']}: {','.join(s.split('-')[-1] for s in r['sites'])}" for r in record["rounds"])
        crashes = [e for e in record["faults"] if "crashed_job" in e]
        resumed = [f"; resumed at round {e.get('checkpoint', {}).get('next_round', -1) + 1} by job "
                   f"{e.get('resumed_job')}" for e in crashes]
        observed = f"{record['status']}; sites per round {sites}" + "".join(resumed) + (
            f"; FAILED: {', '.join(c['check'] for c in failed)}" if failed else "")
        rows.append({"fault": name, "expected": expected, "observed": observed,
                     "longest_round": f"{longest:.1f} s (bound {plan.round_bound():.0f} s)", "ok": record["ok"]})
    table = markdown_table(rows, ["fault", "expected", "observed", "longest_round", "ok"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.md").write_text(table + "\n")
    echo(table)
    return rows


# ----- command line ----------------------------------------------------------------------------------------------
def add_rehearse_options(parser: Any) -> None:
    """``medflare rehearse``'s options."""
    parser.add_argument("--hospitals", type=int, default=2, help="hospitals (default 2)")
    parser.add_argument("--method", default="fedavg", help="registered method (default fedavg)")
    parser.add_argument("--model", default="cnn", help="model (default cnn)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    parser.add_argument("--min-clients", type=int, default=0, help="sites each round needs (default: all)")
    parser.add_argument("--straggler", type=int, default=10,
                        help="seconds a round waits for the rest once min-clients answered (default 10)")
    parser.add_argument("--task-timeout", type=int, default=0, help="seconds a site may take per task "
                                                                    "(default: medflare's 3600)")
    parser.add_argument("--max-steps", type=int, default=5, help="local steps per round (default 5)")
    parser.add_argument("--images", type=int, default=200, help="synthetic training images per hospital")
    parser.add_argument("--rate", action="append", default=[], metavar="SITE=MBIT",
                        help="shape a hospital's link with tc tbf, both ways, e.g. hospital-b=10")
    parser.add_argument("--outage", action="append", default=[], metavar="SITE@WHEN:SECONDS",
                        help="take a hospital's link down at WHEN (roundK: once round K started; or seconds "
                             "after submission) for SECONDS, e.g. hospital-b@round2:30")
    parser.add_argument("--kill", action="append", default=[], metavar="SITE@WHEN:SECONDS",
                        help="SIGKILL every process of a hospital at WHEN, start its kit again SECONDS later")
    parser.add_argument("--kill-server", action="append", default=[], metavar="WHEN:SECONDS",
                        help="SIGKILL every process of the server at WHEN, start its kit again SECONDS later; the "
                             "lead then resubmits the job with resume_from (e.g. round3:5)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds the job may take (default 900)")
    parser.add_argument("-o", "--output", default="runs/rehearse", help="result folder (default runs/rehearse)")
    parser.add_argument("--overwrite", action="store_true", help="replace medflare's earlier results there")


def plan_from_args(args: Any) -> Rehearsal:
    """The rehearsal the command line asks for (hospitals, link rates, outages, the job)."""
    rates = {}
    for item in args.rate:
        site, sep, mbit = item.partition("=")
        try:
            rates[site] = float(mbit)
        except ValueError:
            sep = ""
        if not sep or rates[site] <= 0:
            raise ConfigError(f"--rate '{item}' must be SITE=MBIT with MBIT > 0 (e.g. hospital-b=10)")
    faults = [Fault.parse("outage", t) for t in args.outage] + [Fault.parse("kill", t) for t in args.kill]
    faults += [Fault.server_crash(t) for t in args.kill_server]
    return Rehearsal(hospitals=args.hospitals, method=args.method, model=args.model, rounds=args.rounds,
                     min_clients=args.min_clients, straggler_seconds=args.straggler, task_timeout=args.task_timeout,
                     max_steps=args.max_steps, images=args.images, rates=rates, faults=faults,
                     job_timeout=args.timeout)


def cmd_rehearse(args: Any) -> int:
    """``medflare rehearse``: exit 0 when every check passed, 1 when one failed."""
    record = rehearse(plan_from_args(args), args.output, overwrite=args.overwrite)
    return 0 if record["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m medflare.console.deploy.rehearse``: a rehearsal, or its fault matrix (``faults``)."""
    import argparse

    from medflare.console.processes import Interrupted, stop_on_signals

    parser = argparse.ArgumentParser(prog="python -m medflare.console.deploy.rehearse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="one rehearsal (as medflare rehearse)")
    add_rehearse_options(one)
    faults = sub.add_parser("faults", help="the fault matrix: one rehearsal per fault, a table in OUT/faults.md")
    faults.add_argument("-o", "--output", default="runs/rehearse-faults")
    faults.add_argument("--overwrite", action="store_true")
    faults.add_argument("--only", action="append", help="run only fault N (1-based; repeatable)")
    args = parser.parse_args(argv)
    try:
        with stop_on_signals():
            if args.command == "faults":
                rows = run_fault_matrix(args.output, overwrite=args.overwrite, only=args.only)
                return 0 if all(r["ok"] for r in rows) else 1
            return cmd_rehearse(args)
    except MedflareError as exc:
        print(f"medflare: error: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"rehearse: interrupted by {exc}; removed every namespace, process and kit it made", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
