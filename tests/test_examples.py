"""The examples of docs/own-model-and-data.md run as documented, at smoke size, and really train the user's code:
the global model each run saves has exactly the state-dict shapes of the user's own network."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # make test-heavy

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
# Smoke size: one site is enough to show that the server and a site both build and train the user's code.
SMOKE = ["--clients", "1", "--rounds", "1", "--max-steps", "1", "--batch-size", "8"]


def medflare(args: list[str], out: Path | None = None, python_path: Path | None = None,
             expect: int = 0) -> subprocess.CompletedProcess:
    """``medflare ARGS`` from the repository root, as the docs run it; ``python_path`` adds installed packages."""
    env = dict(os.environ)
    if python_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(python_path), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "medflare.console.cli", *args, *(["--out", str(out)] if out else [])]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def saved_shapes(out: Path) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the global model the run saved."""
    state = torch.load(out / "FL_global_model.pt", map_location="cpu", weights_only=False)["model"]
    return {key: tuple(value.shape) for key, value in state.items()}


def classifier_shapes(backbone: nn.Module, head: nn.Linear) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes of ``Classifier(backbone, head)``, built here without medflare's registry."""
    shapes = {f"backbone.{key}": tuple(value.shape) for key, value in backbone.state_dict().items()}
    return shapes | {f"head.{key}": tuple(value.shape) for key, value in head.state_dict().items()}


def test_monai_network_trains_on_the_own_dataset_plugin(tmp_path: Path) -> None:
    from monai.networks.nets import DenseNet121

    images = tmp_path / "lesions"
    subprocess.run([sys.executable, str(EXAMPLES / "own_dataset" / "make_demo_images.py"), str(images),
                    "--per-class", "15"], check=True, capture_output=True)
    plugins = ["examples/own_model/monai_densenet.py", "examples/own_dataset/lesions.py"]
    medflare(["run", "fedavg", "--model", "monai_densenet121", "--data", f"lesions:{images}",
              "--set", f"plugins={json.dumps(plugins)}", *SMOKE], out=tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["model"] == "monai_densenet121" and summary["rounds_completed"] == 1
    assert summary["config"]["task"]["class_names"] == ["benign", "malignant"]  # read by the user's Dataset
    assert summary["config"]["task"]["image_size"] == 32  # after the example's MONAI Resize
    custom = next((tmp_path / "run" / "job").glob("*/app/custom/medflare_plugins"))
    assert {"monai_densenet.py", "lesions.py"} <= {path.name for path in custom.iterdir()}  # BYOC: the job carries them
    network = DenseNet121(spatial_dims=2, in_channels=1, out_channels=2)
    head = network.class_layers.out
    network.class_layers.out = nn.Identity()
    assert saved_shapes(tmp_path / "run") == classifier_shapes(network, head)


def test_an_installed_model_package_is_found_by_its_entry_point(tmp_path: Path) -> None:
    source = shutil.copytree(EXAMPLES / "own_model" / "my_models", tmp_path / "my_models-src")
    site_packages = tmp_path / "site-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site_packages), str(source)], check=True, capture_output=True)
    refused = medflare(["run", "fedavg", "--model", "tiny_net", *SMOKE], out=tmp_path / "refused", expect=2)
    assert "unknown model 'tiny_net'" in refused.stderr  # without the package, nothing stands in for it
    assert "tiny_net" in medflare(["models"], python_path=site_packages).stdout
    medflare(["run", "fedavg", "--model", "tiny_net", "--data", "synthetic:n=80,classes=2,channels=1", *SMOKE],
             out=tmp_path / "run", python_path=site_packages)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["model"] == "tiny_net" and summary["rounds_completed"] == 1
    sys.path.insert(0, str(site_packages))
    try:
        tiny_net = importlib.import_module("my_models.tiny_net")
    finally:
        sys.path.remove(str(site_packages))
    assert saved_shapes(tmp_path / "run") == classifier_shapes(tiny_net.TinyNet(in_channels=1), nn.Linear(32, 2))
