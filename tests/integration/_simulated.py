"""One job through ``nvflare simulator`` as a test starts it, with the server's results and every log it wrote."""

import json
import subprocess
from pathlib import Path

from medflare.console.simulate import nvflare_command


def simulate(job: Path, workspace: Path, sites: int = 2, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """The server's ``medflare_results.json`` of ``job`` run by ``nvflare simulator`` (``sites`` sites, one thread
    each) in ``workspace`` (with the environment ``env``, else this process's), and every log it wrote."""
    sim = subprocess.run(nvflare_command() + ["simulator", str(job), "-w", str(workspace), "-n", str(sites),
                                              "-t", str(sites)], capture_output=True, text=True, timeout=600, env=env)
    logs = "\n".join(path.read_text(errors="replace") for path in workspace.glob("**/log.txt"))
    found = sorted(workspace.glob("**/app_server/medflare_results.json"))
    assert found, f"no results: {sim.stdout[-2000:]}{sim.stderr[-2000:]}"
    return json.loads(found[0].read_text()), logs + sim.stdout + sim.stderr
