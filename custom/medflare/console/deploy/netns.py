"""A private wide-area network on one machine: one Linux network namespace per participant, joined by a bridge
that lives in a namespace of its own (``medflare rehearse``; needs root).

Every namespace (``mfr-<owner pid>-<role>``), veth pair, qdisc and ``/etc/netns/<ns>/hosts`` file made here is
removed by :meth:`Wan.teardown`, also after a failure; those of a rehearsal that was SIGKILLed by its reaper
(:mod:`medflare.console.deploy.reaper`, :func:`sweep_owner`) at once, and by :func:`sweep_stale` the next time one starts. Nothing is added to the root network namespace: the veth pairs are
made inside the bridge's namespace and their far ends moved into the participants'.

Per participant the link can be shaped (``tc tbf`` both ways: ``eth0``'s egress is its upload, the bridge port's
its download) and taken down and back (the bridge port: the participant loses carrier). The kernel here has no
``netem``: latency and random loss cannot be emulated.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from medflare.console.processes import end_processes

PREFIX = "mfr"  # every namespace this module makes is mfr-<pid>-<role>
NETNS_ETC = Path("/etc/netns")
NAME = re.compile(rf"^{PREFIX}-(\d+)-[a-z0-9]+$")
SUBNET = "10.213.0"  # /24 inside the rehearsal's namespaces only (the root namespace never sees it)
BRIDGE = "br0"


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be made or changed; the message says which command failed."""


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "needs root: it creates network namespaces, veth pairs and tc qdiscs (run it as root, e.g. in CI)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (iproute2), which is not installed"
    if not Path("/proc/self/ns/net").exists():
        return "this kernel has no network namespaces (/proc/self/ns/net is missing)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here ('ip netns add' said: {made.stderr.strip() or made.returncode})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(command), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetnsError(f"'{' '.join(command)}' failed ({done.returncode}): {done.stderr.strip()}")
    return done


def list_namespaces() -> list[str]:
    """Names of every named network namespace (``ip netns list``)."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    """Processes inside namespace ``ns``."""
    out = _run("ip", "netns", "pids", ns, check=False).stdout
    return [int(pid) for pid in out.split() if pid.isdigit()]


def end_namespace_processes(namespaces: list[str], sig: int = signal.SIGTERM) -> list[int]:
    """End every process inside ``namespaces`` (``sig``, then SIGKILL after 5 s, all namespaces at once: one grace
    period, not one per namespace); only processes in a namespace this module made are ever signalled. Returns
    their pids."""
    pids = [pid for ns in namespaces for pid in namespace_pids(ns)]
    processes = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            processes.append(psutil.Process(pid))
    end_processes(processes, grace_seconds=5.0, first=sig)
    return pids


def delete_namespace(ns: str) -> None:
    """End what runs in ``ns``, delete it and its ``/etc/netns/<ns>`` folder."""
    if ns in list_namespaces():
        end_namespace_processes([ns])
        _run("ip", "netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only when empty: another tool's namespaces keep theirs


def sweep_stale() -> list[str]:
    """Delete the namespaces (and hosts folders) of rehearsals whose process is gone; return their names."""
    stale = []
    names = set(list_namespaces()) | ({p.name for p in NETNS_ETC.iterdir()} if NETNS_ETC.is_dir() else set())
    for ns in sorted(names):
        match = NAME.match(ns)
        if match and not psutil.pid_exists(int(match.group(1))):
            delete_namespace(ns)
            stale.append(ns)
    return stale


def sweep_owner(owner: int) -> list[str]:
    """Delete the namespaces (their processes ended first) and hosts folders of the rehearsal of process ``owner``
    (``mfr-<owner>-*``: what its :class:`Wan` made, and nothing else); return their names."""
    prefix = f"{PREFIX}-{owner}-"
    names = set(list_namespaces()) | ({p.name for p in NETNS_ETC.iterdir()} if NETNS_ETC.is_dir() else set())
    owned = sorted(ns for ns in names if ns.startswith(prefix) and NAME.match(ns))
    with contextlib.suppress(Exception):  # every participant's processes in one grace period
        end_namespace_processes([ns for ns in owned if ns in list_namespaces()], sig=signal.SIGTERM)
    for ns in owned:
        delete_namespace(ns)
    return owned


@dataclass
class Host:
    """One participant (e.g. ``hospital-a``) on the WAN: its namespace and IPv4 address on the bridge."""

    name: str
    ns: str
    address: str
    port: str  # the bridge-side end of its veth pair (in the bridge's namespace)
    rate_mbit: float | None = None  # None: unshaped
    up: bool = True


@dataclass
class Wan:
    """The rehearsal's network: a bridge namespace and one namespace per participant."""

    names: list[str]  # in order of their addresses, <SUBNET>.<10 + index>
    # host name -> the participant whose address it resolves to, in every namespace's /etc/netns/<ns>/hosts
    hosts_entries: dict[str, str] = field(default_factory=dict)
    owner: int = field(default_factory=os.getpid)  # the pid the names carry: a sweep deletes them once it is gone
    hosts: dict[str, Host] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)

    @property
    def bridge_ns(self) -> str:
        return f"{PREFIX}-{self.owner}-wan"

    def up(self) -> None:
        """Create the bridge, every participant's namespace, link, address and hosts file."""
        self._add_namespace(self.bridge_ns)
        _run("ip", "-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "-n", self.bridge_ns, "link", "set", BRIDGE, "up")
        for index, name in enumerate(self.names):
            host = Host(name, f"{PREFIX}-{self.owner}-p{index}", f"{SUBNET}.{10 + index}", f"v{index}")
            self._add_namespace(host.ns)
            _run("ip", "-n", self.bridge_ns, "link", "add", host.port, "type", "veth", "peer", "name", "eth0",
                 "netns", host.ns)
            _run("ip", "-n", self.bridge_ns, "link", "set", host.port, "master", BRIDGE)
            _run("ip", "-n", self.bridge_ns, "link", "set", host.port, "up")
            _run("ip", "-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.ns, "link", "set", "eth0", "up")
            self.hosts[name] = host
        lines = ["127.0.0.1 localhost", *(f"{self.hosts[p].address} {h}" for h, p in self.hosts_entries.items())]
        for host in self.hosts.values():
            folder = NETNS_ETC / host.ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join([*lines, f"{host.address} {host.name}"]) + "\n")

    def _add_namespace(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self.made.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def exec_prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program inside ``name``'s namespace, with its hosts file."""
        return ["ip", "netns", "exec", self.hosts[name].ns]

    def set_rate(self, name: str, mbit: float | None) -> None:
        """Shape ``name``'s link to ``mbit`` Mbit/s each way with ``tc tbf`` (None removes the shaping)."""
        for ns, dev in self._link_ends(name):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if mbit is not None:
                rate_bits = mbit * 1e6
                burst = max(32_000, int(rate_bits / 8 / 100))  # 10 ms worth of bytes, at least 32 kB
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "100ms")
        self.hosts[name].rate_mbit = mbit

    def qdiscs(self, name: str) -> str:
        """``tc qdisc show`` of both ends of ``name``'s link."""
        return "".join(_run("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev, check=False).stdout
                       for ns, dev in self._link_ends(name))

    def _link_ends(self, name: str) -> tuple[tuple[str, str], ...]:
        """(namespace, device) of both ends of ``name``'s link: its ``eth0`` and its bridge port."""
        host = self.hosts[name]
        return (host.ns, "eth0"), (self.bridge_ns, host.port)

    def set_link(self, name: str, up: bool) -> None:
        """Take ``name``'s link down (its bridge port; the participant loses carrier) or bring it back."""
        host = self.hosts[name]
        _run("ip", "-n", self.bridge_ns, "link", "set", host.port, "up" if up else "down")
        host.up = up

    def end_processes(self, name: str, sig: int = signal.SIGTERM) -> list[int]:
        """End every process running in ``name``'s namespace; return their pids."""
        return end_namespace_processes([self.hosts[name].ns], sig=sig)

    def teardown(self) -> None:
        """Remove everything :meth:`up` made, participants first (their processes are ended), the bridge last.
        Never raises: it runs after failures."""
        with contextlib.suppress(Exception):  # every participant's processes in one grace period
            end_namespace_processes([ns for ns in self.made if ns in list_namespaces()])
        for ns in reversed(self.made):
            with contextlib.suppress(Exception):
                delete_namespace(ns)
        deadline = time.time() + 10
        while time.time() < deadline and set(self.made) & set(list_namespaces()):
            time.sleep(0.2)
        self.made = [ns for ns in self.made if ns in list_namespaces()]
