"""FCA against FedAvg-BSM, FedRep, FedBABU, FedRS and local-only: generalization and specialization (FCA's
protocol), several seeds, identical data, rounds and training settings, in FLARE's simulator.

Settings (every federated split is simulated; no real hospital IDs):
  synthetic  the ich-split2-like scenario: 5 long-tailed classes (imbalance 20), 10 sites, per-class
             Dirichlet 50/30/10/5/0.5 and each class dropped per site with probability 0.3 (FCA §4.5.1 "Split 2")
  retina     RetinaMNIST (../shared/data, MD5-checked), 5 sites, the same recipe with the per-class alphas
             ordered by RetinaMNIST's training counts (grade 0: 50, 2: 30, 3: 10, 1: 5, 4: 0.5), drop 0.3

Both: each site's val/test split follows its own training class mix (data.eval_split=like_train); Adam lr 1e-3,
weight decay 5e-4, batch 64, one local epoch, lr x 0.1 at 3/4 and 7/8 of the rounds (FCA's schedule scaled),
every method with balanced softmax (eps 1e-9) as FCA trains its baselines, and every method the same network
(--model, default cnn; FCA's own default is EfficientNet-Lite0, so it is pinned here for all alike; the paper's
backbone is EfficientNet-B0, whose offline stand-in is --model efficientnet_lite0 --pretrained imagenet). FedRS uses the authors' soft restriction: the
paper's hard one only rescales missing classes, which balanced softmax already silences, so it trains as BSM-FL.

Figures per run (medflare.evaluation.personalization_figures):
  generalization   bACC / bAUC of the global model on the pooled test splits (none without a global classifier)
  specialization   bACC / bAUC of each site's own model on its own test split, mean over sites
  gs_mean          their mean (the paper's "Average of G&S")
  sites_beating_local  sites whose specialization bACC is above local-only's at that site (same seed)

Usage:
    python benchmarks/fca_vs_baselines.py --setting synthetic [--seeds 0 1 2] [--rounds 20] [--model cnn] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarking import mean_std, run_cell

from medflare.console.processes import stop_on_signals
from medflare.console.scenarios import load_scenario
from medflare.data.checksums import verify_medmnist_file
from medflare.evaluation import personalization_figures
from medflare.run_config import RunConfig, merge_sections

RETINA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "medmnist" / "retinamnist.npz"
METHODS = ("fca", "bsm-fl", "fedrep", "fedbabu", "fedrs", "local-only")
# Every method trains with balanced softmax at FCA's prior floor (local-only's default loss is plain CE).
METHOD_ARGS = {"bsm-fl": {"eps": 1e-9}, "local-only": {"loss": "bsm", "eps": 1e-9}, "fedrs": {"restriction": "soft"}}
FIGURES = ("generalization_bacc", "specialization_bacc", "gs_mean_bacc",
           "generalization_bauc", "specialization_bauc", "gs_mean_bauc")


def setting_config(
    setting: str, seed: int, rounds: int, method: str, max_steps: int, model: str = "cnn",
    pretrained: str | None = None,
) -> RunConfig:
    """The run configuration of one (setting, seed, method) cell; every method trains ``model``."""
    base = load_scenario("ich-split2-like")
    if setting == "retina":
        verify_medmnist_file(RETINA)
        base = merge_sections(base, {"clients": 5, "data": {
            "source": f"medmnist:{RETINA}", "partition": "class-dirichlet:50/5/30/10/0.5:0.3"}})
    elif setting != "synthetic":
        raise SystemExit(f"unknown setting '{setting}'")
    train: dict[str, Any] = {"milestones": scaled_milestones(rounds)}
    if max_steps:
        train["max_steps"] = max_steps
    override = {"method": method, "seed": seed, "rounds": rounds, "name": f"{method}-s{seed}", "train": train,
                "model": model, "pretrained": pretrained, "method_args": METHOD_ARGS.get(method, {})}
    return RunConfig(**merge_sections(base, override))


def scaled_milestones(rounds: int) -> list[int]:
    """FCA's lr decays (rounds 60 and 70 of 80) at 3/4 and 7/8 of ``rounds``; short runs keep the distinct ones
    after round 0 (2 rounds: [1]; 1 round: none)."""
    return sorted({m for m in (int(0.75 * rounds), int(0.875 * rounds)) if m > 0})


def figures_of(final: dict[str, Any]) -> dict[str, Any]:
    """FCA's figures from ``summary.json``'s ``final`` (pooled test metrics at its top level). A method without
    them (bsm-fl) is a single-model method: its sites keep the global model, as for FedRS."""
    if "specialization_bacc" in final:
        return final
    evaluation = {"test": final, "by_site": final.get("by_site", {}), "site_mean": final.get("site_mean", {})}
    return {**final, **personalization_figures(evaluation, global_classifier=True, specialization=None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=["synthetic", "retina"], required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=0, help="cap optimizer steps per site per round (0 = full epochs)")
    parser.add_argument("--model", default="cnn", help="the network every method trains (default cnn)")
    parser.add_argument("--pretrained", default=None, help="initial weights for --model, e.g. imagenet")
    parser.add_argument("--out", default=None)
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from the runs already in --out")
    args = parser.parse_args()
    out = Path(args.out or f"runs/bench-fca-{args.setting}")
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
    started = time.time()
    for seed in args.seeds:
        for method in args.methods:
            run_dir = out / f"{method}-seed{seed}"
            print(f"[{time.time() - started:6.0f}s] {args.setting} seed {seed} {method} ...", flush=True)
            if args.report_only:
                summary = json.loads((run_dir / "summary.json").read_text())
            else:
                run = setting_config(args.setting, seed, args.rounds, method, args.max_steps, args.model,
                                     args.pretrained)
                summary, _ = run_cell(run, run_dir)  # an identical finished run is reused
            figures = figures_of(summary["final"])
            cell = {"seed": seed, **{k: figures.get(k) for k in FIGURES},
                    "specialization_by_site": figures["specialization_by_site"],
                    "round_seconds": summary["timing"]["mean_round_seconds"]}
            rows[method].append(cell)
            print("         " + ", ".join(f"{k} {v:.4f}" for k, v in cell.items() if k in FIGURES and v is not None),
                  flush=True)
    count_sites_beating_local(rows)
    write_report(args, rows, out, time.time() - started)


def count_sites_beating_local(rows: dict[str, list[dict[str, Any]]]) -> None:
    """Per cell: how many sites' specialization bACC is above what local-only reaches at that site (same seed)."""
    local = {cell["seed"]: cell["specialization_by_site"] for cell in rows.get("local-only", [])}
    for method, cells in rows.items():
        for cell in cells:
            alone = local.get(cell["seed"])
            if method != "local-only" and alone:
                mine = cell["specialization_by_site"]
                cell["sites_beating_local"] = sum(mine[s]["bacc"] > alone[s]["bacc"] for s in mine if s in alone)
                cell["sites"] = len(mine)


def write_report(args: argparse.Namespace, rows: dict[str, list[dict[str, Any]]], out: Path, seconds: float) -> None:
    lines = [
        f"# FCA vs baselines: {args.setting}, seeds {args.seeds}, {args.rounds} rounds, model {args.model}",
        "",
        "| method | generalization bACC | specialization bACC | G&S mean bACC | generalization bAUC | "
        "specialization bAUC | G&S mean bAUC | sites above local-only |",
        "|---|---|---|---|---|---|---|---|",
    ]
    table: dict[str, dict[str, Any]] = {}
    for method, cells in rows.items():
        stats = {k: mean_std([c[k] for c in cells if c.get(k) is not None]) for k in FIGURES}
        beating = [c["sites_beating_local"] for c in cells if "sites_beating_local" in c]
        stats["sites_beating_local"] = mean_std(beating)
        table[method] = stats
        text = ["—" if stats[k] is None else f"{stats[k][0]:.3f} ± {stats[k][1]:.3f}" for k in FIGURES]
        sites = cells[0].get("sites") if cells else None
        above = "—" if not beating else f"{stats['sites_beating_local'][0]:.1f} / {sites}"
        lines.append(f"| {method} | " + " | ".join(text) + f" | {above} |")
    timing = ("Report rebuilt from the runs in this folder (--report-only)." if args.report_only
              else f"Wall time of the whole benchmark: {seconds / 60:.1f} min.")
    lines += ["", "— : not defined (no global classifier), or the local-only reference itself.", timing, ""]
    (out / "results.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows, "table": table}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    with stop_on_signals():  # a stop request stops the running simulator too
        main()
