"""Server-side federated evaluation: turn the sites' summable statistics into pooled and per-site metrics.

Each site sends :class:`~medflare.metrics.EvalStats` of the model it evaluates (the received global model, and
any method-declared evaluation of its own local model). Pooled metrics come from the *sum* of the statistics,
so they equal the metrics of the pooled predictions; per-site metrics and their unweighted mean over sites
(``site_mean``) are what personalized FL reports (e.g. FCA's specialization).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from medflare import contracts
from medflare.metrics import EvalStats, compute_metrics, stats_from_dict

SPLIT_KEYS = (("val", contracts.EVAL_VAL), ("test", contracts.EVAL_TEST))

SiteEvaluation = dict[str, Any]  # {"val": EvalStats, "test": EvalStats, "test_by_attribute": {...}, "extra": {...}}

# The one metric a task is judged by: the controller selects the best model by its validation value, the console's
# progress lines and the plots show it, report.md names it and compare judges methods by it. Balanced accuracy for
# single-label tasks (the class imbalance of medical data); for multi-label tasks the mean per-finding AUROC,
# because their balanced accuracy at the fixed 0.5 threshold stays at 0.5 while a model scores rare findings below
# it, however well it ranks them.
HEADLINE_METRICS = {False: "balanced_accuracy", True: "auc_macro_ovr"}
METRIC_NAMES = {"balanced_accuracy": "balanced accuracy", "auc_macro_ovr": "macro AUROC"}  # as the console says it


def headline_metric(multi_label: bool) -> str:
    """The metric that judges a task and selects its best model (:data:`HEADLINE_METRICS`)."""
    return HEADLINE_METRICS[bool(multi_label)]


def selection_metric(results: Mapping[str, Any], multi_label: bool = False) -> str:
    """The metric a controller's results file selected its best model by: the one it recorded (``key_metric``),
    else the key of its best score (files of earlier versions), else the headline metric of the task."""
    recorded = results.get("key_metric") or next(iter(set(results.get("best") or {}) - {"model_version"}), None)
    return str(recorded) if recorded else headline_metric(multi_label)


def metric_name(metric: str) -> str:
    """How the console names a metric key ("macro AUROC" for ``auc_macro_ovr``)."""
    return METRIC_NAMES.get(metric, metric.replace("_", " "))


def site_evaluation(meta: Mapping[str, Any], num_classes: int, multi_label: bool = False) -> SiteEvaluation | None:
    """One site's statistics from its result meta, or None when it sent none.

    Raises:
        PayloadError: when a statistics dictionary is malformed or not of the task's kind (multi-label or not).
    """
    if not any(key in meta for key in (contracts.EVAL_TEST, contracts.EVAL_EXTRA)):
        return None

    def parse(value: Any) -> EvalStats:
        return stats_from_dict(value, num_classes, multi_label)

    evaluation: SiteEvaluation = {split: parse(meta[key]) for split, key in SPLIT_KEYS if key in meta}
    evaluation["test_by_attribute"] = {
        a: parse(d) for a, d in (meta.get(contracts.EVAL_TEST_BY_ATTRIBUTE) or {}).items()
    }
    evaluation["extra"] = {
        name: {split: parse(d) for split, d in splits.items()}
        for name, splits in (meta.get(contracts.EVAL_EXTRA) or {}).items()
    }
    return evaluation


def summarize(
    evaluations: Mapping[str, SiteEvaluation], shot_groups: Mapping[str, Sequence[int]] | None = None
) -> dict[str, Any]:
    """Pooled, per-site and site-mean metrics of one model version from every site's statistics.

    Returns a dict with ``sites``; ``val``/``test`` (pooled metrics) and ``val_stats``/``test_stats``;
    ``test_by_attribute``; ``by_site`` (site -> test metrics) and ``site_mean`` (unweighted mean over sites of
    each scalar test metric); and ``extra`` (evaluation name -> the same pooled/by_site/site_mean block).
    """
    evaluations = dict(sorted(evaluations.items()))  # sum in site order, not arrival order: reproducible bits
    summary: dict[str, Any] = {"sites": list(evaluations)}
    summary.update(_split_block(evaluations, shot_groups, with_stats=True))
    by_attribute: dict[str, list[EvalStats]] = {}
    for evaluation in evaluations.values():
        for attribute, stats in evaluation.get("test_by_attribute", {}).items():
            by_attribute.setdefault(attribute, []).append(stats)
    if by_attribute:
        summary["test_by_attribute"] = {a: compute_metrics(_sum(parts)) for a, parts in sorted(by_attribute.items())}
    names = sorted({name for e in evaluations.values() for name in e.get("extra", {})})
    if names:
        summary["extra"] = {
            name: _split_block(
                {site: e["extra"][name] for site, e in evaluations.items() if name in e.get("extra", {})}, shot_groups
            )
            for name in names
        }
    return summary


HISTOGRAM_KEYS = ("pos_hist", "neg_hist")  # the score histograms behind AUROC: K x 1000 counts per split


def without_histograms(summary: Mapping[str, Any]) -> dict[str, Any]:
    """``summary`` with its pooled ``*_stats`` cut to the confusion matrix, loss and count.

    The per-round history keeps this: the full histograms (2 x K x 1000 counts per split, about 160 KiB of
    Python lists a round for K = 5) grew the server's memory and its per-round results file and checkpoint
    with every round, and their metrics are already computed. The final evaluation keeps them whole.
    """
    compact = dict(summary)
    for split in ("val", "test"):
        stats = summary.get(f"{split}_stats")
        if isinstance(stats, Mapping):
            compact[f"{split}_stats"] = {k: v for k, v in stats.items() if k not in HISTOGRAM_KEYS}
    return compact


def _split_block(
    per_site: Mapping[str, Mapping[str, EvalStats]], shot_groups: Mapping[str, Sequence[int]] | None, with_stats: bool = False
) -> dict[str, Any]:
    block: dict[str, Any] = {}
    for split in ("val", "test"):
        parts = [stats[split] for stats in per_site.values() if split in stats]
        if parts:
            pooled = _sum(parts)
            block[split] = compute_metrics(pooled, shot_groups)
            if with_stats:
                block[f"{split}_stats"] = pooled.to_dict()
    by_site = {site: compute_metrics(stats["test"], shot_groups) for site, stats in sorted(per_site.items()) if "test" in stats}
    if by_site:
        block["by_site"] = by_site
        block["site_mean"] = site_mean(by_site)
    return block


def site_mean(by_site: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Unweighted mean over sites of every scalar metric (sites where it is undefined are left out)."""
    names = sorted({k for metrics in by_site.values() for k, v in metrics.items() if _is_number(v) or v is None})
    mean: dict[str, float | None] = {}
    for name in names:
        values = [float(m[name]) for m in by_site.values() if _is_number(m.get(name))]
        mean[name] = float(np.mean(values)) if values else None
    return mean


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _sum(parts: list[EvalStats]) -> EvalStats:
    return sum(parts[1:], parts[0])


# ----- generalization and specialization (FCA's evaluation protocol) --------------------------------------------
SPECIALIZATION = "specialization"  # name of the method-declared evaluation of each site's own (personal) model
# name of the method-declared evaluation of each site's own model on the pooled test set (methods without a global
# classifier: FedRep, local-only); simulation only, where a site can build the pooled test set
GENERALIZATION = "generalization"
# The data of FCA's protocol (paper §4.2, spec §6(d)): each client's test set D_test^k follows its own class mix
# (FLamby's per-centre test split, the ICH split files' per-client test lists); specialization is 1/K Σ_k
# bACC(D_test^k) and generalization scores their union. Simulated sites get it with like_train slices (which still
# tile the pooled test set); the methods FCA's paper evaluates this way declare it (``MethodSpec.data_defaults``).
# A plain dict, not a MappingProxyType: specs are deep-copied (simulator job configs) and a proxy cannot be; the
# run config copies it into its own data options, so nothing writes through it.
FCA_PROTOCOL_DATA: Mapping[str, Any] = {"eval_split": "like_train"}
_FIGURES = (("balanced_accuracy", "bacc"), ("bauc", "bauc"))


def personalization_figures(
    final: Mapping[str, Any], *, global_classifier: bool, specialization: str | None = SPECIALIZATION,
    generalization: str | None = None,
) -> dict[str, Any]:
    """FCA's figures from a run's final evaluation: generalization, specialization and their mean, in bACC and bAUC.

    * Generalization: the global model on the pooled test splits of all sites (``final["test"]``, from summed
      statistics). A method without a global classifier (local-only, FedRep's private heads) has no such model:
      its generalization is each site's own model on the pooled test set, averaged over sites (the site mean of
      the method-declared evaluation ``generalization``; ``generalization_by_site`` lists each site's), and None
      where no site could score the pooled test set (a site reading its own data holds only its own split).
    * Specialization: each site's own model on its own test split, averaged over sites (1/K Σ_k): the site mean
      of the method-declared evaluation ``specialization``, or of the main evaluation (``final["site_mean"]``)
      when ``specialization`` is None (single-model methods, whose sites keep the global model; local-only,
      whose main evaluation already scores each site's own model).
    * ``gs_mean_*``: the mean of the two (the paper's "Average of G&S"), None if either is missing.
    * ``specialization_by_site``: each site's specialization bACC and bAUC.

    Args:
        final: the final evaluation as :func:`summarize` builds it.
        global_classifier: whether ``final["test"]`` scores one global classifier.
        specialization: the evaluation holding each site's own model, or None (see above).
        generalization: without a global classifier, the evaluation holding each site's own model on the pooled
            test set, or None (then there is no generalization figure).

    References:
        Wicaksana, Yan and Cheng, FCA: Taming Long-tailed Federated Medical Image Classification by Classifier
        Anchoring, 2023, §4.2 (bAUC: spec §1.5).
    """
    general_block = {} if global_classifier or not generalization else final.get("extra", {}).get(generalization, {})
    general = final.get("test", {}) if global_classifier else general_block.get("site_mean", {})
    block = final.get("extra", {}).get(specialization, {}) if specialization else final
    special = block.get("site_mean", {})
    figures: dict[str, Any] = {}
    for metric, short in _FIGURES:
        g, s = general.get(metric), special.get(metric)
        figures[f"generalization_{short}"] = g
        figures[f"specialization_{short}"] = s
        figures[f"gs_mean_{short}"] = (g + s) / 2 if g is not None and s is not None else None
    figures["specialization_by_site"] = {
        site: {short: metrics.get(metric) for metric, short in _FIGURES}
        for site, metrics in block.get("by_site", {}).items()
    }
    if general_block:
        figures["generalization_by_site"] = {
            site: {short: metrics.get(metric) for metric, short in _FIGURES}
            for site, metrics in general_block.get("by_site", {}).items()
        }
    return figures
