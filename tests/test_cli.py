"""The command line: listings, and bad input that fails early with a clear message and leaves nothing behind."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from medflare.cli import main


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_methods_lists_the_baselines(capsys) -> None:
    code, out = run_cli(["methods"], capsys)
    assert code == 0
    for name in ("fedavg", "bsm-fl", "fedprox"):
        assert name in out


def write_png_dataset(root: Path, labels: list[int], corrupt: int | None = None) -> Path:
    rows = ["path,label"]
    for i, label in enumerate(labels):
        path = root / f"img{i}.png"
        if i == corrupt:
            path.write_bytes(b"not a png")
        else:
            Image.fromarray(np.full((8, 8), min(255, 30 * label), np.uint8)).save(path)
        rows.append(f"{path.name},{label}")
    manifest = root / "manifest.csv"
    manifest.write_text("\n".join(rows) + "\n")
    return manifest


@pytest.mark.parametrize(
    "args, expected",
    [
        (["run", "no-such-method"], "unknown method 'no-such-method'"),
        (["run", "fedavg", "--model", "no-such-net"], "unknown model 'no-such-net'"),
        (["run", "fedavg", "--data", "medmnist:/does/not/exist.npz"], "/does/not/exist.npz"),
        (["run", "fedavg", "--data", "nonsense:x"], "synthetic"),
        (["run", "fedavg", "--set", "method.nope=1"], "nope"),
        (["run", "fedprox", "--set", "method.mu=-1"], "mu"),
        (["run", "fedavg", "--data", "synthetic:n=100", "--clients", "40", "--partition", "dirichlet:0.01"], "site"),
        (["run", "fedavg", "--set", "task.num_classes=3"], "class"),
    ],
)
def test_bad_input_fails_before_launch_with_a_clear_message(args, expected, tmp_path: Path, capsys) -> None:
    out_dir = tmp_path / "out"
    code, out = run_cli(args + ["--out", str(out_dir)], capsys)
    assert code == 2
    assert expected in out
    assert not out_dir.exists() and not out_dir.with_name("out.partial").exists()


def test_label_out_of_range_names_the_file(tmp_path: Path, capsys) -> None:
    manifest = write_png_dataset(tmp_path, [0, 1, 0, 1, 7, 0, 1, 0, 1, 0])
    code, out = run_cli(["run", "fedavg", "--data", f"csv:{manifest}", "--set", "task.num_classes=2", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "7" in out and "manifest.csv" in out


def test_corrupt_image_names_the_file(tmp_path: Path, capsys) -> None:
    manifest = write_png_dataset(tmp_path, [0, 1] * 10, corrupt=3)
    code, out = run_cli(["run", "fedavg", "--data", f"csv:{manifest}", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and "img3.png" in out


def test_export_defaults_to_site_local_data(tmp_path: Path, capsys) -> None:
    import json

    code, out = run_cli(["export", "fedavg", "-o", str(tmp_path), "--set", "task.num_classes=2",
                         "--set", "task.in_channels=1", "--set", "task.image_size=28"], capsys)
    assert code == 0 and "medflare_site.json" in out
    client = json.loads((tmp_path / "fedavg" / "app" / "config" / "config_fed_client.json").read_text())
    assert client["executors"][0]["executor"]["args"]["data"] == {"source": "site"}


def test_export_without_a_task_for_site_data_says_what_to_declare(tmp_path: Path, capsys) -> None:
    code, out = run_cli(["export", "fedavg", "-o", str(tmp_path)], capsys)
    assert code == 2 and "task.num_classes" in out
