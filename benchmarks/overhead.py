"""Framework cost: one medflare job in FLARE's simulator against a bare PyTorch loop doing the same work.

Both sides train the same model on the same site partitions with the same number of optimizer steps,
evaluate the global model on every site's val and test split each round, and average the weights. The bare
loop runs the sites one after another in this process (no FLARE, no serialization, no medflare trainer); the
simulator runs one process per site. Reported: wall seconds per round on each side (first round excluded on
both sides, since it holds process and data start-up), their ratio, and FLARE's start-up.

Usage:
    python benchmarks/overhead.py [--rounds 6] [--clients 2] [--steps 10] [--model cnn] [--out runs/bench-overhead]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from medflare.data import DataConfig, make_site_data
from medflare.models import create_model
from medflare.run_config import RunConfig
from medflare.simulate import run_simulation


def bare_loop(run: RunConfig, steps: int) -> list[float]:
    """FedAvg by hand: per round, every site evaluates, trains ``steps`` Adam steps, then weights are averaged."""
    torch.set_num_threads(1)  # what each simulated site gets
    task = run.task_spec()
    sites = [
        make_site_data(DataConfig(**{**run.site_data(), "num_classes": task.num_classes}), i, name)
        for i, name in enumerate(run.site_names)
    ]
    torch.manual_seed(run.seed)
    global_model = create_model(run.model, task.num_classes, task.in_channels, image_size=task.image_size)
    models = [create_model(run.model, task.num_classes, task.in_channels, image_size=task.image_size) for _ in sites]
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    round_seconds = []
    for _ in range(run.rounds):
        start = time.perf_counter()
        states, sizes = [], []
        for data, model, optimizer in zip(sites, models, optimizers):
            model.load_state_dict(global_model.state_dict())
            for split in (data.val, data.test):
                _evaluate(model, split)
            _train(model, optimizer, data.train, steps, run.train.get("batch_size", 64))
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            sizes.append(len(data.train))
        weights = np.array(sizes, dtype=np.float64) / sum(sizes)
        averaged = {
            k: sum(w * s[k].double() for w, s in zip(weights, states)).to(states[0][k].dtype) for k in states[0]
        }
        global_model.load_state_dict(averaged)
        round_seconds.append(time.perf_counter() - start)
    return round_seconds


def _train(model, optimizer, dataset, steps: int, batch_size: int) -> None:
    model.train()
    done = 0
    while done < steps:
        for images, labels in DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True):
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            done += 1
            if done >= steps:
                return


def _evaluate(model, dataset) -> None:
    model.eval()
    with torch.no_grad():
        for images, _ in DataLoader(dataset, batch_size=256):
            torch.softmax(model(images), dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per site per round")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--data", default="synthetic:n=1200")
    parser.add_argument("--task-request-interval", type=float, default=0.1)
    parser.add_argument("--out", default="runs/bench-overhead")
    args = parser.parse_args()

    run = RunConfig(
        method="fedavg", model=args.model, rounds=args.rounds, clients=args.clients,
        data={"source": args.data, "partition": "iid"}, train={"max_steps": args.steps, "batch_size": 64},
        task_request_interval=args.task_request_interval,
    )
    bare = bare_loop(run, args.steps)
    summary = run_simulation(run, Path(args.out) / "flare", echo=lambda line: None, overwrite=True)
    flare = summary["timing"]["per_round_seconds"]
    bare_mean, flare_mean = float(np.mean(bare[1:])), float(np.mean(flare[1:]))
    result = {
        "config": vars(args),
        "bare_round_seconds": bare,
        "flare_round_seconds": flare,
        "bare_mean_round_seconds": bare_mean,
        "flare_mean_round_seconds": flare_mean,
        "ratio_flare_over_bare": flare_mean / bare_mean,
        "flare_overhead_per_round_seconds": flare_mean - bare_mean,
        "flare_startup_seconds": summary["timing"].get("startup_seconds"),
        "flare_first_round_seconds": flare[0],
        "flare_total_seconds": summary["timing"].get("total_seconds"),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"per round (rounds 2..{args.rounds}): bare PyTorch {bare_mean:.3f} s, medflare on FLARE simulator "
        f"{flare_mean:.3f} s -> ratio {result['ratio_flare_over_bare']:.2f}x "
        f"(+{result['flare_overhead_per_round_seconds']:.3f} s/round); FLARE start-up "
        f"{result['flare_startup_seconds']:.1f} s, first round {flare[0]:.1f} s"
    )


if __name__ == "__main__":
    main()
