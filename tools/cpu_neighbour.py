"""A CPU-heavy neighbour for a fresh-clone CI run (issue 47): ResNet-18 training steps on random images with
``--threads`` torch threads until killed (or ``--seconds``), printing its pace every 100 steps.

    .venv/bin/python tools/cpu_neighbour.py --threads 2 &   # then tools/fresh_clone_ci.sh /tmp/ci-loaded
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3600.0, help="stop after this long (default 1 h)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = torchvision.models.resnet18(num_classes=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    images, labels = torch.randn(32, 3, 64, 64), torch.randint(0, 2, (32,))
    steps, start = 0, time.time()
    while time.time() - start < args.seconds:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        steps += 1
        if steps % 100 == 0:
            print(f"{time.time() - start:.0f} s: {steps} steps", flush=True)


if __name__ == "__main__":
    main()
