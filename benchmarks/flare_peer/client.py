"""FLARE's own FedAvg, the floor of the peer benchmark: the Client API around the bare loop's site.

``benchmarks/peer_flower.py`` (sides ``flare-sim``) runs this script with FLARE 2.9's ``FedAvgRecipe`` (PyTorch,
FLARE's ``FedAvg`` controller, its persistor and in-process Client API executor), so FLARE moves the same model
between the same sites doing the same work (``fedavg_site.FedAvgSite``) as medflare, Flower and the bare loop do,
with nothing of medflare in between. A site reads its spec from the workload file (``MEDFLARE_PEER_WORKLOAD``),
refuses to train when its partition's digest differs, and appends one line per round to
``<MEDFLARE_PEER_RESULT>.<site>.jsonl``: when (``time.time()``) it had the model, its own seconds of work, and when
it handed the result back to FLARE.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import nvflare.client as flare
import torch
from fedavg_site import FedAvgSite, spec_from_dict

from flare_peer.model import PREFIX

WORKLOAD_ENV, RESULT_ENV = "MEDFLARE_PEER_WORKLOAD", "MEDFLARE_PEER_RESULT"


def site_of(name: str) -> FedAvgSite:
    load = json.loads(Path(os.environ[WORKLOAD_ENV]).read_text())
    site = FedAvgSite(spec_from_dict(next(s for s in load["sites"] if s["name"] == name)))
    if site.digest() != load["digests"][name]:
        raise RuntimeError(f"{name}: partition digest {site.digest()[:12]} differs from the workload's")
    return site


def as_numpy(value) -> np.ndarray:
    return value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)


def main() -> None:
    flare.init()
    name = flare.get_site_name()
    site = site_of(name)
    record = Path(f"{os.environ[RESULT_ENV]}.{name}.jsonl")
    while flare.is_running():
        model = flare.receive()
        if model is None:
            break
        entered = time.time()
        state, timing = site.round({key.removeprefix(PREFIX): as_numpy(value) for key, value in model.params.items()})
        left = time.time()
        with record.open("a") as out:
            out.write(json.dumps({"round": model.current_round, "entered_at": entered, "left_at": left,
                                  "work": timing["work"]}) + "\n")
        flare.send(flare.FLModel(params={PREFIX + key: torch.from_numpy(value) for key, value in state.items()},
                                 meta={"NUM_STEPS_CURRENT_ROUND": site.n_train}))


if __name__ == "__main__":
    main()
