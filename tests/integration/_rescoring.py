"""Scores a run's saved global model on the pooled test split in-process (not collected: no ``test_`` prefix).

Independent of the federated evaluation path: no EvalStats, no controller, no FLARE. It reloads
``FL_global_model.pt`` from the run folder, rebuilds every simulated site's test split from the run config,
and scores the pooled predictions with scikit-learn.
"""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, balanced_accuracy_score, f1_score, roc_auc_score
from torch.utils.data import DataLoader

from medflare.config import from_dict
from medflare.data import DataConfig, make_site_data
from medflare.plan import build_global_model, task_of
from medflare.registry import get_method
from medflare.run_config import RunConfig


def pooled_test_outputs(run_dir: Path, run: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, float64 logits) of the run's saved final global model on every simulated site's test split."""
    task = task_of(run)
    model = build_global_model(run.method, run.model, task.num_classes, task.in_channels, task.image_size,
                               method_args=run.method_args).network  # the full network; the server keeps no private keys
    missing, unexpected = model.load_state_dict(
        torch.load(run_dir / "FL_global_model.pt", map_location="cpu", weights_only=True)["model"], strict=False
    )
    payload = get_method(run.method).payload
    assert not unexpected and all(payload.is_private(k) for k in missing), (missing, unexpected)
    model.eval()
    data_cfg = from_dict(DataConfig, {**run.site_data(), "num_classes": task.num_classes}, "data")
    labels, logits = [], []
    with torch.no_grad():
        for index, site in enumerate(run.site_names):
            for images, batch_labels in DataLoader(make_site_data(data_cfg, index, site).test, batch_size=256):
                labels.append(batch_labels)
                logits.append(model(images).double())
    return torch.cat(labels), torch.cat(logits)


def run_of_summary(summary: dict) -> RunConfig:
    """The run a summary's configuration (its plan's) describes, as far as rescoring its model needs: method,
    model, seed, sites, rounds, the data the sites received, the method's and the job's training settings."""
    config = summary["config"]
    return RunConfig(method=config["method"], model=config["model"], seed=config["seed"], clients=config["clients"],
                     rounds=config["rounds"], data=dict(config["data"]), method_args=dict(config["method_args"]),
                     train=dict(config["train_resolved"]))


def rescore_global_model(run_dir: Path, run: RunConfig) -> dict[str, float]:
    """Balanced accuracy, accuracy and mean cross-entropy of the run's final global model (raw model outputs)."""
    y, z = pooled_test_outputs(run_dir, run)
    keep = y >= 0
    y, z = y[keep], z[keep]
    predicted = z.argmax(dim=1).numpy()
    return {
        "balanced_accuracy": float(balanced_accuracy_score(y.numpy(), predicted)),
        "accuracy": float(accuracy_score(y.numpy(), predicted)),
        "loss": float(F.cross_entropy(z, y).item()),
        "count": int(np.count_nonzero(keep.numpy())),
    }


def rescore_multi_label_model(run_dir: Path, run: RunConfig) -> dict[str, float]:
    """Mean per-class AUROC (exact, and binned with its error bound), macro F1 and subset accuracy (threshold 0.5)
    of a multi-label run's final model."""
    from medflare.metrics import MultiLabelEvalStats, binned_auc_error_bound, compute_metrics

    y, z = pooled_test_outputs(run_dir, run)
    y, scores = y.numpy(), torch.sigmoid(z).numpy()
    predicted = (scores >= 0.5).astype(int)
    stats = MultiLabelEvalStats.from_predictions(y, scores, y.shape[1])
    return {
        "auc_macro_ovr": float(roc_auc_score(y, scores, average="macro")),
        "binned_auc_macro_ovr": compute_metrics(stats)["auc_macro_ovr"],
        "auc_bound": max(binned_auc_error_bound(p, n) for p, n in zip(stats.pos_hist, stats.neg_hist)),
        "macro_f1": float(f1_score(y, predicted, average="macro", zero_division=0)),
        "accuracy": float(accuracy_score(y, predicted)),
    }
