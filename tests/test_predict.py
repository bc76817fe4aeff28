"""``medflare predict``: a global model file carries its facts, and predict scores images as a site does.

The model files here are written by medflare's own persistor (FLARE's format plus the ``"medflare"`` facts);
``tests/integration/test_predict_simulator.py`` runs the same against a model from a real simulator run.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from medflare.checkpoint import FACTS_KEY, read_checkpoint
from medflare.console.cli import main
from medflare.console.predict import predict_file
from medflare.errors import ConfigError
from medflare.run_config import RunConfig, load_plugin_files

from ._predicting import (
    read_probabilities,
    save_global_model,
    site_probabilities,
    ten_synthetic_images,
    write_images_npz,
)
from .test_files import disk_full_below

PLUGINS = Path(__file__).parent / "flare" / "plugins"


@pytest.mark.parametrize("method", ["fedavg", "ldam-drw"])  # ldam-drw scores with its own predict_logits
def test_predict_matches_the_sites_scoring_of_the_same_model(tmp_path: Path, method: str) -> None:
    run = RunConfig(method=method, data={"source": "synthetic:n=200"})
    model_file = save_global_model(tmp_path / "FL_global_model.pt", run)
    npz, labels = ten_synthetic_images(tmp_path)

    done = predict_file(model_file, npz, tmp_path / "predictions.csv")

    header, probabilities = read_probabilities(tmp_path / "predictions.csv")
    assert done["images"] == 10 and header[:3] == ["image", "label", "predicted"]
    assert header[3:] == [f"p_lesion_type_{k}" for k in range(5)]  # class names from the data, via the file
    np.testing.assert_allclose(probabilities, site_probabilities(run, npz, model_file), atol=1e-6)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-6)


MULTI_LABEL = "synthetic:n=200,multilabel=1,classes=4"


@pytest.mark.parametrize("method", ["fedlsm", "fedavg"])
def test_multi_label_predict_scores_a_sigmoid_per_finding_as_the_sites_do(tmp_path: Path, method: str) -> None:
    run = RunConfig(method=method, data={"source": MULTI_LABEL})
    model_file = save_global_model(tmp_path / "FL_global_model.pt", run)
    npz, labels = ten_synthetic_images(tmp_path, MULTI_LABEL)
    labels = labels.copy()
    labels[0, 1] = -1  # a finding not annotated: an empty cell

    done = predict_file(model_file, write_images_npz(npz, np.load(npz)["test_images"], labels), tmp_path / "p.csv")

    names = read_checkpoint(model_file).class_names
    header, probabilities = read_probabilities(tmp_path / "p.csv")
    assert done["multi_label"] and header == ["image", *(f"label_{n}" for n in names), "predicted",
                                              *(f"p_{n}" for n in names)]
    np.testing.assert_allclose(probabilities, site_probabilities(run, npz, model_file), atol=1e-6)
    assert not np.allclose(probabilities.sum(axis=1), 1.0)  # independent findings, not a softmax
    rows = list(csv.DictReader((tmp_path / "p.csv").open()))
    for row, scores, truth in zip(rows, probabilities, labels):
        found = row["predicted"].split(";") if row["predicted"] else []
        assert found == [n for n, p in zip(names, scores) if p >= 0.5]
        assert [row[f"label_{n}"] for n in names] == ["" if t == -1 else str(t) for t in truth]


def test_multi_label_predicted_lists_the_findings_at_or_above_one_half(tmp_path: Path) -> None:
    from medflare.console.predict import PredictInput, write_predictions
    from medflare.data.types import ImageSet

    inputs = PredictInput(ImageSet(labels=np.full((2, 3), -1), num_classes=3, channels=1,
                                   images=np.zeros((2, 4, 4, 1), np.uint8)), ["a", "b"], labelled=False)
    write_predictions(tmp_path / "p.csv", inputs, np.array([[0.5, 0.49, 0.9], [0.1, 0.2, 0.3]]), ["x", "y", "z"],
                      multi_label=True)

    assert [r["predicted"] for r in csv.DictReader((tmp_path / "p.csv").open())] == ["x;z", ""]


def test_multi_label_input_of_another_task_is_refused(tmp_path: Path) -> None:
    run = RunConfig(method="fedlsm", data={"source": MULTI_LABEL})
    model_file = save_global_model(tmp_path / "m.pt", run)
    names = read_checkpoint(model_file).class_names
    npz, labels = ten_synthetic_images(tmp_path, MULTI_LABEL)
    images = np.load(npz)["test_images"]
    five = write_images_npz(tmp_path / "five.npz", images, np.zeros((10, 5), np.int64))
    twos = write_images_npz(tmp_path / "twos.npz", images, np.full((10, 4), 2))
    Image.fromarray(images[0]).save(tmp_path / "a.png")
    (tmp_path / "other.csv").write_text(f"path,label_{names[0]},label_effusion\na.png,1,0\n")
    columns = ",".join(f"label_{n}" for n in names)
    (tmp_path / "three.csv").write_text(f"path,{columns}\na.png,1,,0,3\n")

    cases = [(five, r"is \(10, 5\), but the model scores 4 findings per image"),
             (twos, "entries other than 1, 0 and -1"),
             (tmp_path / "other.csv", r"the model's findings are .* \(mismatch: \['label_effusion'\]\)"),
             (tmp_path / "three.csv", "entries other than 1, 0 and -1")]
    for source, expected in cases:
        with pytest.raises(ConfigError, match=expected):
            predict_file(model_file, source, tmp_path / "out.csv")
    assert not (tmp_path / "out.csv").exists()


def test_the_file_carries_what_inference_needs(tmp_path: Path) -> None:
    run = RunConfig(method="fedprox", model="cnn", method_args={"mu": 0.1}, data={"source": "synthetic:n=200"},
                    task={"class_names": ["a", "b", "c", "d", "e"]})
    facts = read_checkpoint(save_global_model(tmp_path / "m.pt", run)).facts
    assert facts["method"] == "fedprox" and facts["model"] == "cnn" and facts["method_args"] == {"mu": 0.1}
    assert facts["task"] == {"num_classes": 5, "in_channels": 3, "image_size": 28, "class_names": list("abcde"),
                             "multi_label": False}
    assert facts["normalization"]["mean"] == 0.5 and facts["medflare_version"]
    raw = torch.load(tmp_path / "m.pt", weights_only=True)  # tensors and plain types only: safe to load
    assert set(raw) >= {"model", FACTS_KEY}


def test_folder_and_csv_inputs_carry_labels_by_class_name(tmp_path: Path) -> None:
    run = RunConfig(method="fedavg", data={"source": "synthetic:n=200,channels=1"})
    model_file = save_global_model(tmp_path / "m.pt", run)
    rng = np.random.default_rng(0)
    for name in ("lesion_type_1", "lesion_type_3"):
        (tmp_path / "new" / name).mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(tmp_path / "new" / name / "x.png")
    (tmp_path / "new" / "list.csv").write_text("path,class_name\nlesion_type_1/x.png,lesion_type_1\n")

    predict_file(model_file, tmp_path / "new", tmp_path / "folder.csv")
    predict_file(model_file, tmp_path / "new" / "list.csv", tmp_path / "manifest.csv")

    rows = list(csv.DictReader((tmp_path / "folder.csv").open()))
    assert [(r["image"], r["label"]) for r in rows] == [("lesion_type_1/x.png", "lesion_type_1"),
                                                        ("lesion_type_3/x.png", "lesion_type_3")]
    by_manifest = next(csv.DictReader((tmp_path / "manifest.csv").open()))
    assert by_manifest["p_lesion_type_2"] == rows[0]["p_lesion_type_2"]


def test_another_tasks_input_is_refused(tmp_path: Path) -> None:
    run = RunConfig(method="fedavg", data={"source": "synthetic:n=200,classes=3"})
    model_file = save_global_model(tmp_path / "m.pt", run)
    gray = write_images_npz(tmp_path / "gray.npz", np.zeros((4, 28, 28), np.uint8), np.zeros(4, np.int64))
    many = write_images_npz(tmp_path / "many.npz", np.zeros((4, 28, 28, 3), np.uint8), np.array([0, 1, 2, 7]))
    (tmp_path / "xray" / "lesion_type_0").mkdir(parents=True)
    (tmp_path / "xray" / "pneumonia").mkdir(parents=True)
    for folder in ("lesion_type_0", "pneumonia"):
        Image.fromarray(np.zeros((28, 28, 3), np.uint8)).save(tmp_path / "xray" / folder / "a.png")

    cases = [(gray, "has 1-channel images but the model was trained on 3-channel images: this input belongs to "
                    "another task"),
             (many, "has label 7, but the model knows 3 classes"),
             (tmp_path / "xray", r"class folders \['pneumonia'\] that the model does not know")]
    for source, expected in cases:
        with pytest.raises(ConfigError, match=expected):
            predict_file(model_file, source, tmp_path / "out.csv")
    assert not (tmp_path / "out.csv").exists()


def test_files_without_a_global_model_or_facts_are_refused(tmp_path: Path) -> None:
    load_plugin_files([str(PLUGINS / "staged.py")])
    npz, _ = ten_synthetic_images(tmp_path)
    local_only = save_global_model(tmp_path / "local.pt", RunConfig(method="local-only", data={"source": "synthetic:n=200"}))
    personal = save_global_model(tmp_path / "personal.pt", RunConfig(
        method="test-staged", rounds=3, data={"source": "synthetic:n=200"}, plugins=[str(PLUGINS / "staged.py")]))
    torch.save({"conv.weight": torch.zeros(1)}, tmp_path / "plain.pt")

    cases = [(local_only, "method 'local-only' keeps no global model"),
             (personal, "keeps head.weight and 1 more entries at the sites"),
             (tmp_path / "plain.pt", "carries no medflare facts"),
             (tmp_path / "absent.pt", "checkpoint not found")]
    for model_file, expected in cases:
        with pytest.raises(ConfigError, match=expected):
            predict_file(model_file, npz, tmp_path / "out.csv")


def test_cli_predict_never_replaces_a_file(tmp_path: Path, capsys) -> None:
    model_file = save_global_model(tmp_path / "best_FL_global_model.pt", RunConfig(data={"source": "synthetic:n=200"}))
    npz, _ = ten_synthetic_images(tmp_path)
    (tmp_path / "mine.csv").write_text("my notes")

    assert main(["predict", str(model_file), str(npz), "-o", str(tmp_path / "p.csv")]) == 0
    assert main(["predict", str(model_file), str(npz), "-o", str(tmp_path / "mine.csv")]) == 2

    out, err = capsys.readouterr()
    assert "wrote 10 predictions of fedavg (cnn, classes lesion_type_0, " in out
    assert "mine.csv exists; medflare does not replace files" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "mine.csv").read_text() == "my notes"


# ----- issue 27: the CSV is medflare's own file, complete, and safe to open in a spreadsheet -----------------
def test_predict_never_writes_through_a_symlink_or_over_a_users_partial_file(tmp_path: Path, capsys) -> None:
    model_file = save_global_model(tmp_path / "m.pt", RunConfig(data={"source": "synthetic:n=200"}))
    npz, _ = ten_synthetic_images(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "victim.txt").write_text("mine")
    (out / "o.csv.partial").symlink_to(out / "victim.txt")
    (out / "o5.csv.partial").write_text("my half-done table")

    for name in ("o.csv", "o5.csv"):
        assert main(["predict", str(model_file), str(npz), "-o", str(out / name)]) == 0, capsys.readouterr().err

    assert (out / "victim.txt").read_text() == "mine" and (out / "o5.csv.partial").read_text() == "my half-done table"
    assert sorted(p.name for p in out.iterdir()) == ["o.csv", "o.csv.partial", "o5.csv", "o5.csv.partial",
                                                     "victim.txt"]
    assert read_probabilities(out / "o.csv")[1].shape == (10, 5)


@pytest.mark.parametrize("multi_label", [False, True])
def test_names_that_a_spreadsheet_would_run_as_formulas_are_escaped(multi_label: bool, tmp_path: Path) -> None:
    from medflare.console.predict import PredictInput, write_predictions
    from medflare.data.types import ImageSet

    names = ['=HYPERLINK("http://x")', "-1", "ok"]
    ids = ["=cmd()|x.png", "+1.png", "@SUM(A1).png", "\tx.png", "\rx.png", "plain-name.png"]
    labels = np.zeros((6, 3), np.int64) if multi_label else np.zeros(6, np.int64)
    inputs = PredictInput(ImageSet(labels=labels, num_classes=3, channels=1, images=np.zeros((6, 4, 4, 1), np.uint8)),
                          ids, labelled=True)
    scores = np.tile([0.6, 0.7, 1e-12], (6, 1))
    write_predictions(tmp_path / "p.csv", inputs, scores, names, multi_label=multi_label)

    header, *rows = list(csv.reader((tmp_path / "p.csv").open(newline="")))
    assert header[-3:] == ["p_'=HYPERLINK(\"http://x\")", "p_'-1", "p_ok"]
    assert [row[0] for row in rows] == ["'=cmd()|x.png", "'+1.png", "'@SUM(A1).png", "'\tx.png", "'\rx.png",
                                        "plain-name.png"]
    assert rows[0][-4] == ("'=HYPERLINK(\"http://x\");'-1" if multi_label else "'-1")  # predicted
    assert rows[0][-3:] == ["0.6", "0.7", "1e-12"]  # numbers stay numbers


def test_a_full_disk_while_predicting_is_one_line_and_leaves_nothing(tmp_path: Path, capsys, monkeypatch) -> None:
    model_file = save_global_model(tmp_path / "m.pt", RunConfig(data={"source": "synthetic:n=200"}))
    npz, _ = ten_synthetic_images(tmp_path)
    (tmp_path / "out").mkdir()
    disk_full_below(tmp_path / "out", monkeypatch)

    code = main(["predict", str(model_file), str(npz), "-o", str(tmp_path / "out" / "pred.csv")])

    err = capsys.readouterr().err
    assert code == 2 and "no space left to write" in err and len(err.strip().splitlines()) == 1, err
    assert list((tmp_path / "out").iterdir()) == []


def test_a_really_full_disk_while_predicting_leaves_nothing(tmp_path: Path, tiny_disk: Path, capsys) -> None:
    model_file = save_global_model(tmp_path / "m.pt", RunConfig(data={"source": "synthetic:n=200"}))
    npz, _ = ten_synthetic_images(tmp_path)
    with (tiny_disk / "filler").open("wb") as filler, pytest.raises(OSError):
        while True:
            filler.write(b"x" * 65536)
            filler.flush()

    assert main(["predict", str(model_file), str(npz), "-o", str(tiny_disk / "pred.csv")]) == 2
    assert "no space left to write" in capsys.readouterr().err
    assert [p.name for p in tiny_disk.iterdir()] == ["filler"]


class _Whole(torch.nn.Module):
    """A model saved whole, in torch's legacy (non-zip) format."""


@pytest.mark.parametrize("old_file", ["pickle_protocol_4", "legacy_torch_format"])
def test_an_old_pickle_gets_medflares_one_line_and_no_torch_warning(tmp_path: Path, capsys, old_file: str) -> None:
    """Issue 60, item 8: ``predict`` printed torch's two-line UserWarning ("Detected pickle protocol 4 ... please
    file an issue") before its own error; the hospital sees only medflare's line."""
    import pickle
    import warnings

    path = tmp_path / "old_model.pt"
    if old_file == "pickle_protocol_4":
        path.write_bytes(pickle.dumps({"model": {"w": [1.0, 2.0]}}, protocol=4))
    else:
        torch.save(_Whole(), path, _use_new_zipfile_serialization=False)
    npz, _ = ten_synthetic_images(tmp_path)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["predict", str(path), str(npz), "-o", str(tmp_path / "p.csv")])

    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{path} " in err, err
    assert [str(w.message) for w in caught] == []
    assert not (tmp_path / "p.csv").exists()


def test_a_class_folder_in_another_unicode_form_labels_its_images(tmp_path: Path) -> None:
    """Issue 60, item 8: folder names are matched to the model's class names in NFC, as at the sites (a Mac writes
    "Ödem" decomposed), so a labelled folder is scored as labelled."""
    run = RunConfig(method="fedavg", data={"source": "synthetic:n=200,channels=1,classes=2"},
                    task={"class_names": ["\u00d6dem", "normal"]})
    model_file = save_global_model(tmp_path / "m.pt", run)
    for name in ("O\u0308dem", "normal"):
        (tmp_path / "new" / name).mkdir(parents=True)
        Image.fromarray(np.zeros((28, 28), np.uint8)).save(tmp_path / "new" / name / "x.png")

    predict_file(model_file, tmp_path / "new", tmp_path / "folder.csv")

    rows = list(csv.DictReader((tmp_path / "folder.csv").open(encoding="utf-8")))
    assert [r["label"] for r in rows] == ["\u00d6dem", "normal"]


def test_a_hu_window_on_8_bit_pngs_gets_one_note_and_none_without_it(tmp_path: Path, capsys) -> None:
    """Issue 61 minors: a HU window clipped 8-bit grey levels as if they were HU, without a word."""
    run = RunConfig(method="fedavg", data={"source": "synthetic:n=200,channels=1"})
    model_file = save_global_model(tmp_path / "m.pt", run)
    (tmp_path / "new" / "lesion_type_1").mkdir(parents=True)
    Image.fromarray(np.full((28, 28), 90, dtype=np.uint8)).save(tmp_path / "new" / "lesion_type_1" / "x.png")
    assert main(["predict", str(model_file), str(tmp_path / "new"), "-o", str(tmp_path / "a.csv"),
                 "--window", "lung"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("medflare: note:")]
    assert notes == ["medflare: note: data.window=-600,1500 is a window for DICOM/NIfTI values such as Hounsfield "
                     "units, but 1 of 1 images are PNG/JPEG/TIFF files, whose grey levels (0 to 255 for 8-bit) it "
                     "clips as if they were HU (images may come out blank); remove data.window unless these files "
                     "store HU"]
    assert main(["predict", str(model_file), str(tmp_path / "new"), "-o", str(tmp_path / "b.csv")]) == 0
    assert "note:" not in capsys.readouterr().err
