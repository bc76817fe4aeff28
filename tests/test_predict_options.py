"""``medflare predict``: metrics when the input gives labels, ``--device``, and the trainer's thread count
(issue 30, item 11)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, balanced_accuracy_score, roc_auc_score

from medflare.console.cli import main
from medflare.console.predict import predict_file
from medflare.errors import ConfigError
from medflare.methods.base import TrainConfig
from medflare.metrics import EvalStats, MultiLabelEvalStats, binned_auc_error_bound
from medflare.run_config import RunConfig

from ._predicting import read_probabilities, save_global_model, ten_synthetic_images, write_images_npz

MULTI_LABEL = "synthetic:n=200,multilabel=1,classes=4"


def ties_bound(stats, classes) -> float:
    """How far the sites' binned macro AUROC may be from the exact one: scores tied inside a histogram bin (an
    untrained model's are all close), averaged over the classes scored (medflare.metrics.roc)."""
    bound = float(np.mean([binned_auc_error_bound(stats.pos_hist[k], stats.neg_hist[k]) for k in classes]))
    assert bound < 0.1  # scores spread over the bins: the comparison below means something
    return bound + 1e-12


def decisive(model_file: Path, factor: float = 200.0) -> Path:
    """The model file with its head scaled: an untrained model scores every class alike, all in one histogram bin,
    and its binned AUROC could then be anything within 0.4 of the exact one."""
    saved = torch.load(model_file, weights_only=True)
    for key in ("head.weight", "head.bias"):
        saved["model"][key] = saved["model"][key] * factor
    torch.save(saved, model_file)
    return model_file


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return decisive(save_global_model(tmp_path_factory.mktemp("model") / "m.pt",
                                      RunConfig(data={"source": "synthetic:n=200"})))


def test_labelled_input_gets_the_sites_metrics_of_the_written_probabilities(model_file, tmp_path) -> None:
    npz, labels = ten_synthetic_images(tmp_path)

    done = predict_file(model_file, npz, tmp_path / "p.csv")

    _, probabilities = read_probabilities(tmp_path / "p.csv")
    metrics = done["metrics"]
    assert done["labelled"] == 10 and list(metrics) == ["balanced_accuracy", "accuracy", "auc_macro_ovr"]
    predicted = probabilities.argmax(axis=1)
    assert metrics["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(labels, predicted))
    assert metrics["accuracy"] == pytest.approx(accuracy_score(labels, predicted))
    present = np.unique(labels)  # one-vs-rest over the classes the ten images hold
    exact = np.mean([roc_auc_score(labels == k, probabilities[:, k]) for k in present])
    assert abs(metrics["auc_macro_ovr"] - exact) <= ties_bound(EvalStats.from_predictions(labels, probabilities, 5),
                                                                present)


def test_multi_label_metrics_lead_with_the_macro_auroc(tmp_path) -> None:
    run = RunConfig(method="fedlsm", data={"source": MULTI_LABEL})
    model = decisive(save_global_model(tmp_path / "m.pt", run), factor=20.0)  # sigmoids: saturate less
    npz, labels = ten_synthetic_images(tmp_path, MULTI_LABEL)

    done = predict_file(model, npz, tmp_path / "p.csv")

    _, probabilities = read_probabilities(tmp_path / "p.csv")
    assert list(done["metrics"])[0] == "auc_macro_ovr"
    both = [k for k in range(labels.shape[1]) if len(np.unique(labels[:, k])) == 2]
    exact = np.mean([roc_auc_score(labels[:, k], probabilities[:, k]) for k in both])
    stats = MultiLabelEvalStats.from_predictions(labels, probabilities, labels.shape[1])
    assert abs(done["metrics"]["auc_macro_ovr"] - exact) <= ties_bound(stats, both)


def test_the_command_prints_the_metrics_only_when_labels_are_given(model_file, tmp_path, capsys) -> None:
    npz, _ = ten_synthetic_images(tmp_path)
    images = np.load(npz)["test_images"]
    unlabelled = tmp_path / "unlabelled.npz"
    np.savez(unlabelled, images=images)

    assert main(["predict", str(model_file), str(npz), "-o", str(tmp_path / "a.csv"), "--device", "cpu"]) == 0
    labelled_out = capsys.readouterr().out
    assert main(["predict", str(model_file), str(unlabelled), "-o", str(tmp_path / "b.csv")]) == 0
    unlabelled_out = capsys.readouterr().out

    assert ", on cpu) to " in labelled_out
    assert re.search(r"medflare: on 10 labelled images: balanced accuracy \d\.\d{4}, accuracy \d\.\d{4}, "
                     r"macro AUROC (\d\.\d{4}|n/a)\n", labelled_out)
    assert "labelled images" not in unlabelled_out and len(unlabelled_out.splitlines()) == 1


def test_a_missing_gpu_is_one_line(model_file, tmp_path, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    npz, _ = ten_synthetic_images(tmp_path)

    assert main(["predict", str(model_file), str(npz), "-o", str(tmp_path / "p.csv"), "--device", "cuda"]) == 2

    err = capsys.readouterr().err
    assert "--device cuda: torch sees no CUDA GPU here" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.csv").exists()


def test_scoring_runs_on_the_trainers_threads_and_restores_torchs(model_file, tmp_path, monkeypatch) -> None:
    import medflare.console.predict as predict

    npz, _ = ten_synthetic_images(tmp_path)
    seen: list[int] = []
    real_scorer = predict.scorer

    def recording_scorer(checkpoint, device):
        logits_of = real_scorer(checkpoint, device)
        return lambda images: (seen.append(torch.get_num_threads()), logits_of(images))[1]

    monkeypatch.setattr(predict, "scorer", recording_scorer)
    before = torch.get_num_threads()
    predict_file(model_file, npz, tmp_path / "a.csv")
    predict_file(model_file, npz, tmp_path / "b.csv", threads=2)

    assert seen == [TrainConfig.torch_threads, 2] and torch.get_num_threads() == before
    with pytest.raises(ConfigError, match="--threads must be >= 1, got 0"):
        predict_file(model_file, npz, tmp_path / "c.csv", threads=0)


def test_labels_that_mark_no_image_give_no_metrics(tmp_path, capsys) -> None:
    run = RunConfig(method="fedlsm", data={"source": MULTI_LABEL})
    model = save_global_model(tmp_path / "m.pt", run)
    npz, labels = ten_synthetic_images(tmp_path, MULTI_LABEL)
    unknown = write_images_npz(tmp_path / "unknown.npz", np.load(npz)["test_images"], np.full_like(labels, -1))

    assert main(["predict", str(model), str(unknown), "-o", str(tmp_path / "p.csv")]) == 0

    assert "medflare: the input's labels mark no image as labelled: no metrics" in capsys.readouterr().out
