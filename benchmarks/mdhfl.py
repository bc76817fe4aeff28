"""MDH-FL against FedMD and local-only training, under label noise, with a different architecture per site.

Every run goes through FLARE's simulator. Three sites train ResNet-10, ShuffleNetV2 and MobileNetV2 (the
paper's heterogeneous models without ResNet-12, the slowest on CPU); 20 % of the training split is held out as
the unlabelled public set (disjoint from every site), the rest is split Dirichlet(0.5) over the sites, and the
training labels get pair-flip or symmetric noise. Each site's own model is scored on its clean test share.

Settings:
  synthetic  the built-in generator: 5 classes, 1,200 training images at 28 px (RGB)
  retina     RetinaMNIST (../shared/data, MD5-checked): 5 grades, 1,080 training images at 28 px (RGB)
  Every federated split is simulated (no real hospital IDs).

Sites score their own model once, after the last round (site_evaluation=final), so the bytes per round are the
method's own traffic.

Variants: mdhfl, fedmd, local-only (SCE, the same private data); --ablations adds MDH-FL without SCE
(method.loss=ce) and without KL (method.distill=false). Reported: accuracy per site (architecture) and the mean
over sites, mean ± std over seeds; and the bytes each site sends per round, measured from the payload audit,
against the expected public rows per round × classes × 2 bytes (float16).

Usage:
    python benchmarks/mdhfl.py --setting retina [--seeds 0 1 2] [--noise clean pairflip:0.2 symmetric:0.2]
        [--rounds 8] [--ablations] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from medflare.data.checksums import verify_medmnist_file
from medflare.run_config import RunConfig
from medflare.simulate import run_simulation

RETINA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist" / "retinamnist.npz"
SITE_MODELS = {"site-1": "resnet10", "site-2": "shufflenet", "site-3": "mobilenet_v2"}
CLASSES = 5
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mdhfl": ("mdhfl", {}),
    "fedmd": ("fedmd", {}),
    "local-only": ("local-only", {"loss": "sce"}),
}
ABLATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "mdhfl w/o SCE": ("mdhfl", {"loss": "ce"}),
    "mdhfl w/o KL": ("mdhfl", {"distill": False}),
}


def source(setting: str) -> str:
    if setting == "synthetic":
        return f"synthetic:n=1200,classes={CLASSES},n_val=150,n_test=300"
    verify_medmnist_file(RETINA)
    return f"medmnist:{RETINA}"


def run_config(args: argparse.Namespace, variant: str, noise: str, seed: int) -> RunConfig:
    """One cell: the same private data, public set and per-site models for every variant of a (noise, seed)."""
    method, method_args = {**VARIANTS, **ABLATIONS}[variant]
    kind, _, rate = noise.partition(":")
    data = {
        "source": source(args.setting), "partition": "dirichlet:0.5", "public_fraction": 0.2, "augment": "none",
        "label_noise": float(rate or 0), "noise_kind": "symmetric" if kind == "clean" else kind,
    }
    if method != "local-only":
        method_args = {"public_per_round": args.public_per_round, **method_args}
    return RunConfig(
        method=method, seed=seed, rounds=args.rounds, clients=len(SITE_MODELS), model="resnet10",
        site_model=SITE_MODELS, data=data, method_args=method_args, site_evaluation="final",
        train={"batch_size": 16, "max_steps": args.max_steps}, audit=True,
        name=f"{variant.replace(' ', '').replace('/', '-')}-{noise.replace(':', '')}-s{seed}",
    )


def sent_array_bytes(out: Path) -> dict[str, list[int]]:
    """Bytes of the arrays each site sent per round (probabilities), from its payload audit."""
    per_site = {}
    for site in SITE_MODELS:
        path = out / "sites" / site / "medflare_payload_audit.jsonl"
        if not path.is_file():
            continue
        rounds: dict[int, int] = {}
        current = 0
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["direction"] == "task":
                current = int(record["header"].get("round", current))
            elif record["task"] != "validate":
                rounds[current] = rounds.get(current, 0) + int(record.get("bytes", 0))
        per_site[site] = [rounds[r] for r in sorted(rounds)]
    return per_site


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {std:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=["synthetic", "retina"], required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--noise", nargs="+", default=["clean", "pairflip:0.2", "symmetric:0.2"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=8, help="cap on local optimizer steps per site and round")
    parser.add_argument("--public-per-round", type=int, default=64, help="public rows exchanged per round")
    parser.add_argument("--ablations", action="store_true", help="add MDH-FL without SCE and without KL")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or f"runs/bench-mdhfl-{args.setting}")
    out.mkdir(parents=True, exist_ok=True)
    variants = list(VARIANTS) + (list(ABLATIONS) if args.ablations else [])
    cells: list[dict[str, Any]] = []
    started = time.time()
    for noise in args.noise:
        for seed in args.seeds:
            for variant in variants:
                run = run_config(args, variant, noise, seed)
                print(f"[{time.time() - started:6.0f}s] {args.setting} {noise} seed {seed} {variant} ...", flush=True)
                summary = run_simulation(run, out / run.name, echo=lambda line: None)
                final = summary["final"]
                cells.append({
                    "noise": noise, "seed": seed, "variant": variant,
                    "by_site": {s: m["accuracy"] for s, m in final["by_site"].items()},
                    "site_mean": final["site_mean"]["accuracy"],
                    "sent_bytes_per_round": sent_array_bytes(out / run.name),
                    "payload_bytes_per_round": {s: p["bytes_per_round"] for s, p in summary["payload"].items()},
                    "mean_round_seconds": summary["timing"]["mean_round_seconds"],
                })
                print(f"         mean accuracy {final['site_mean']['accuracy']:.4f}", flush=True)
    write_report(args, variants, cells, out, time.time() - started)


def write_report(args: argparse.Namespace, variants: list[str], cells: list[dict[str, Any]], out: Path,
                 seconds: float) -> None:
    sites = list(SITE_MODELS)
    lines = [
        f"# MDH-FL vs FedMD vs local-only: {args.setting}, seeds {args.seeds}, {args.rounds} rounds, "
        f"max {args.max_steps} local steps, {args.public_per_round} public rows per round",
        "",
        "| noise | method | " + " | ".join(f"{s} ({SITE_MODELS[s]})" for s in sites) + " | mean |",
        "|---|---|" + "---|" * (len(sites) + 1),
    ]
    for noise in args.noise:
        for variant in variants:
            rows = [c for c in cells if c["noise"] == noise and c["variant"] == variant]
            per_site = [mean_std([c["by_site"][s] for c in rows]) for s in sites]
            lines.append(f"| {noise} | {variant} | " + " | ".join(per_site) + f" | {mean_std([c['site_mean'] for c in rows])} |")
    expected = args.public_per_round * CLASSES * 2
    exchanged = [c for c in cells if c["variant"] in ("mdhfl", "fedmd")]
    measured = sorted({b for c in exchanged for v in c["sent_bytes_per_round"].values() for b in v})
    total = sorted({b for c in exchanged for v in c["payload_bytes_per_round"].values() for b in v})
    lines += ["", f"Arrays sent per site and round (payload audit, mdhfl and fedmd): {measured} bytes; expected public "
              f"rows per round x classes x 2 bytes = {args.public_per_round} x {CLASSES} x 2 = {expected} bytes. "
              f"With meta (controller's count): {min(total)}-{max(total)} bytes per site and round.",
              "", f"Wall time of the whole benchmark: {seconds / 60:.1f} min.", ""]
    (out / "results.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps({"args": vars(args), "site_models": SITE_MODELS, "cells": cells},
                                                 indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
