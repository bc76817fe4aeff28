"""The listing commands (``methods``, ``models``, ``--help``) answer from ``catalog.jsonc`` without importing torch,
and that snapshot is what the registries and the real modules say (issue 30, items 6 and 11)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from medflare.catalog import CATALOG_FILE, COUNTED_SIZES, COUNTED_TASK, build_catalog, is_installed
from medflare.console.cli import main
from medflare.installed import forget_installed


def test_the_catalog_is_what_the_registries_say() -> None:
    written = json.loads(CATALOG_FILE.read_text())

    assert written == build_catalog(), "catalog.jsonc is stale: regenerate it with  python -m medflare.catalog"


@pytest.mark.parametrize("model", ["cnn", "resnet10", "efficientnet_lite0", "vit_micro"])
def test_parameter_counts_are_those_of_the_real_modules(model: str) -> None:
    from medflare.models import create_model

    listed = next(entry for entry in json.loads(CATALOG_FILE.read_text())["models"] if entry["name"] == model)
    for size in COUNTED_SIZES:
        network = create_model(model, COUNTED_TASK["num_classes"], COUNTED_TASK["in_channels"], image_size=size)
        assert listed["params"][str(size)] == sum(p.numel() for p in network.parameters()), (model, size)


NO_TORCH = """
import sys
from medflare.console.cli import main
for argv in {commands!r}:
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
heavy = sorted(name for name in ("torch", "torchvision", "timm", "numpy", "nvflare") if name in sys.modules)
assert not heavy, f"{{heavy}} imported"
"""


@pytest.mark.parametrize("commands", [[["methods"]], [["models"]], [["--help"]], [["run", "--help"]],
                                      [["compare", "--help"]], [["predict", "--help"]]], ids=str)
def test_the_static_commands_import_no_torch(commands: list[list[str]]) -> None:
    done = subprocess.run([sys.executable, "-c", NO_TORCH.format(commands=commands)], capture_output=True, text=True,
                          timeout=120)

    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()


def test_methods_lists_every_method_with_its_summary_and_presets(capsys) -> None:
    from medflare.registry import get_method, list_methods

    assert main(["methods"]) == 0

    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert list(rows) == list_methods()
    for name in list_methods():
        assert get_method(name).summary in rows[name]
        assert ("--preset paper" in rows[name]) == ("paper" in get_method(name).presets)


def test_models_shows_parameters_input_and_offline_weights(capsys) -> None:
    from medflare.models import get_model_info

    assert main(["models"]) == 0

    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert rows["cnn"].split()[1] == "93.7k" and "any side >= 28 px" in rows["cnn"]
    assert rows["resnet18"].split()[1] == "11.2M"
    assert "sized by task.image_size: 681k at 28, 764k at 224 px" in rows["vit_micro"]  # position embeddings
    package = get_model_info("efficientnet_lite0").imagenet_package
    assert package and rows["efficientnet_lite0"].endswith(
        "--pretrained imagenet (installed)" if is_installed(package) else f"({package} not installed)")
    assert all(row.endswith(" -") for name, row in rows.items() if name != "efficientnet_lite0")
    assert "--pretrained FILE" in lines[-1]


def test_help_lists_every_scenario_and_partition_from_their_registries(capsys, monkeypatch) -> None:
    from medflare.console.scenarios import list_scenarios
    from medflare.data.partition import SCHEME_FORMS

    monkeypatch.setenv("COLUMNS", "400")  # no line breaks inside a name
    with pytest.raises(SystemExit):
        main(["run", "--help"])

    text = capsys.readouterr().out
    assert len(list_scenarios()) >= 4 and len(SCHEME_FORMS) >= 7  # the issue found 2 and 6 listed
    for name in [*list_scenarios(), *SCHEME_FORMS]:
        assert name in text


def test_models_lists_an_installed_packages_models_without_importing_them(tmp_path, monkeypatch, capsys) -> None:
    dist = tmp_path / "my_models-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-models\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[medflare.models]\ntiny_net = my_models_not_importable:tiny_net\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forget_installed()  # entry points are scanned once per process
    try:
        assert main(["models"]) == 0
    finally:
        monkeypatch.undo()
        forget_installed()  # the other tests see the packages really installed

    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny_net "))
    assert "installed package's model, imported when a job names it" in row


def test_a_closed_pipe_ends_a_listing_quietly() -> None:
    """`medflare models | head -1`: no traceback when the reader stops early; the SIGPIPE exit status."""
    import os
    import subprocess
    import sys

    code = "import sys; from medflare.console.cli import main; sys.exit(main(['models']))"
    reader, writer = os.pipe()
    os.close(reader)  # the reader is gone before the table is printed: every write meets a closed pipe
    try:
        child = subprocess.run([sys.executable, "-c", code], stdout=writer, stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(writer)
    stderr = child.stderr.decode()
    assert child.returncode == 141
    assert "Traceback" not in stderr and stderr == ""
