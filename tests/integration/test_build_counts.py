"""Issue 50: the plan is decided once and carried. In one 2-site run in FLARE's simulator, started as a user starts
it (``medflare run``), every process builds the method's server rule at most once and each training setting it
uses once: the command line resolves the plan, the server and each site read the plan file once (the same plan),
the server's aggregator builds its round core from it, each site takes its typed settings from it; nobody
re-derives them."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.smoke]

# Loaded by every Python process of the run (the command line, FLARE's simulator, its sites): wraps the
# builders and the checks where they are defined, before any module binds them, and appends one line per call to a log.
COUNTER = textwrap.dedent('''
    import hashlib, importlib.machinery, json, os, sys

    TARGETS = {"medflare.server_setup": ("server_rule",), "medflare.site_config": ("resolve_train_config",),
               "medflare.plan": ("read_plan", "validated")}

    def _counted(module_name, function):
        def counted(*args, **kwargs):
            result = function(*args, **kwargs)
            key = hashlib.sha256(repr(result).encode()).hexdigest()[:12]  # which settings (or rule) was built
            with open(os.environ["MEDFLARE_BUILD_LOG"], "a") as log:
                log.write(json.dumps([os.getpid(), function.__name__, key]) + "\\n")
            return result
        return counted

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name not in TARGETS:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                for function in TARGETS[name]:
                    setattr(module, function, _counted(name, getattr(module, function)))
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder)
''')


def test_one_simulator_run_builds_the_server_rule_and_each_sites_training_once_per_process(tmp_path: Path) -> None:
    hooks, log = tmp_path / "hooks", tmp_path / "builds.jsonl"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(COUNTER)
    env = {**os.environ, "MEDFLARE_BUILD_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])])}
    medflare = [sys.executable, "-c", "import sys; from medflare.console.cli import main; sys.exit(main())"]
    done = subprocess.run([*medflare, "run", "fedavg", "--rounds", "2", "--clients", "2", "--max-steps", "2",
                           "--data", "synthetic:n=200", "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    calls = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    by_process = collections.defaultdict(collections.Counter)
    for pid, builder, built in calls:
        by_process[pid][(builder, built)] += 1
    # the command line, the server and two sites at least (FLARE may start helper processes that build nothing)
    assert len(by_process) >= 3, by_process
    rules = {pid: sum(n for (builder, _), n in counts.items() if builder == "server_rule")
             for pid, counts in by_process.items()}
    assert sorted(rules.values())[-2:] == [1, 1], rules  # the command line's plan and the server's aggregator
    for pid, counts in by_process.items():
        assert all(n == 1 for n in counts.values()), (pid, counts)  # nothing built twice in one process
    trains = [n for counts in by_process.values() for (builder, _), n in counts.items()
              if builder == "resolve_train_config"]
    reads = {pid: built for pid, counts in by_process.items() for (builder, built) in counts if builder == "read_plan"}
    assert len(reads) >= 3 and len(set(reads.values())) == 1, by_process  # the server and each site: one plan, once
    assert sum(trains) == 1, by_process  # the command line resolves the job's (the sites set none of their own);
    # each site takes its typed settings from the plan file and resolves nothing again
    checks = [n for counts in by_process.values() for (builder, _), n in counts.items() if builder == "validated"]
    assert checks == [1], by_process  # the layered run is checked once, by the resolver; no runner checks it again
