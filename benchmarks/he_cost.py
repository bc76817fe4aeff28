"""Seconds and bytes per round with and without encrypted aggregation (secure_aggregation=he) in a real POC.

One POC with FLARE's HEBuilder contexts in its kits, two sites, synthetic data; for each model one plaintext job,
then the same job encrypted, one after the other (never two jobs at once, so their rounds do not share the CPU).
Each job's ``medflare_results.json`` gives, per round, the server's wall seconds, the bytes each site uploaded
(arrays + meta; ciphertext bytes under HE) and the bytes of the train task one site downloaded.

Usage: ``python benchmarks/he_cost.py [--models cnn resnet18] [--rounds 3] [--out runs/bench-he]``
(``make bench-he``). Writes ``<out>/he_cost.json`` and ``<out>/he_cost.md``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

from medflare.console.deploy.poc import PocSession, find_results
from medflare.console.job_export import write_job
from medflare.plan import resolve
from medflare.run_config import RunConfig

DATA = {"source": "synthetic:n=400", "partition": "iid"}
TRAIN = {"max_steps": 5, "batch_size": 32}


def free_port() -> int:
    """A loopback port nothing listens on now (other POCs on this machine keep theirs)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_run(model: str, he: bool, rounds: int) -> RunConfig:
    run = RunConfig(method="fedavg", model=model, rounds=rounds, clients=2, data=dict(DATA), train=dict(TRAIN),
                    name=f"{model}-{'he' if he else 'plain'}", secure_aggregation="he" if he else "off")
    return run


def per_round(results: dict) -> dict:
    """Mean over the rounds after the first (which also loads the job): seconds, upload and download bytes."""
    rounds = results["rounds"][1:] or results["rounds"]
    upload = [statistics.mean(site["bytes"] for site in r["payload"].values()) for r in rounds]
    return {
        "rounds": len(results["rounds"]),
        "round_seconds": statistics.mean(r["wall_seconds"] for r in rounds),
        "aggregate_seconds": statistics.mean(r["server_seconds"].get("aggregate", 0.0) for r in rounds),
        "upload_bytes_per_site": statistics.mean(upload),
        "download_bytes_per_site": statistics.mean(r.get("task_bytes", {}).get("train", 0) for r in rounds),
    }


def table(rows: list[dict]) -> str:
    lines = ["| model | aggregation | s/round | server aggregate s | upload MB/site/round | download MB/site/round |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['model']} | {row['aggregation']} | {row['round_seconds']:.1f} | "
                     f"{row['aggregate_seconds']:.2f} | {row['upload_bytes_per_site'] / 1e6:.2f} | "
                     f"{row['download_bytes_per_site'] / 1e6:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "resnet18"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one job may take")
    parser.add_argument("--out", default="runs/bench-he")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    session = PocSession(out / "poc", port=free_port(), echo=print, tied=True)
    rows: list[dict] = []
    with session.hold():
        try:
            session.prepare(2, allow_job_data=True, he=True)
            session.start()
            for model in args.models:
                for he in (False, True):
                    run = job_run(model, he, args.rounds)
                    job_id = session.submit(write_job(resolve(run, "byoc", deployed=True), out / "jobs", "byoc"))
                    status = session.wait(job_id, timeout=args.timeout)
                    row = {"model": model, "aggregation": "he (CKKS)" if he else "plaintext", "status": status}
                    if status == "FINISHED:COMPLETED":
                        results_path = find_results(session.download(job_id, out / "download" / run.job_name))
                        row.update(per_round(json.loads(results_path.read_text())))
                    rows.append(row)
                    print(json.dumps(row))
                    (out / "he_cost.json").write_text(json.dumps(rows, indent=1) + "\n")
        finally:
            session.discard()
    done = [row for row in rows if "round_seconds" in row]
    stamp = time.strftime("%Y-%m-%d")
    command = "python benchmarks/he_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "he_cost.md").write_text(f"{table(done)}\n\n`{command}`, {stamp}\n")
    print(table(done))
    return 0 if len(done) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
