"""Server-side federated evaluation: the sites' summable :class:`~medflare.metrics.EvalStats` as pooled metrics
(from the *sum*, so equal to those of the pooled predictions), per-site metrics and their unweighted mean."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Mapping, Sequence

import numpy as np

from medflare import contracts
from medflare.metrics import EvalStats, compute_metrics, stats_from_dict
from medflare.ops.influence import cap_shares, normalise_weights

SPLIT_KEYS = (("val", contracts.EVAL_VAL), ("test", contracts.EVAL_TEST))

SiteEvaluation = dict[str, Any]  # {"val": EvalStats, "test": EvalStats, "test_by_attribute": {...}, "extra": {...}}

# The one metric a task is judged by (best model, console, plots, report, compare): balanced accuracy, or for
# multi-label tasks the mean per-finding AUROC (their balanced accuracy at the fixed 0.5 threshold stays at 0.5
# while a model scores rare findings below it, however well it ranks them).
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
    """One site's statistics from its result meta, or None when it sent none (PayloadError when malformed)."""
    if not any(key in meta for key in (contracts.EVAL_TEST, contracts.EVAL_EXTRA)):
        return None
    parse = partial(stats_from_dict, num_classes=num_classes, multi_label=multi_label)
    evaluation: SiteEvaluation = {split: parse(meta[key]) for split, key in SPLIT_KEYS if key in meta}
    evaluation["test_by_attribute"] = {a: parse(d) for a, d in (meta.get(contracts.EVAL_TEST_BY_ATTRIBUTE) or {}).items()}
    evaluation["extra"] = {
        name: {split: parse(d) for split, d in splits.items()}
        for name, splits in (meta.get(contracts.EVAL_EXTRA) or {}).items()
    }
    return evaluation


def summarize(
    evaluations: Mapping[str, SiteEvaluation], shot_groups: Mapping[str, Sequence[int]] | None = None,
    share_cap: float = 0.0,
) -> dict[str, Any]:
    """Pooled (``val``/``test``, sums in ``*_stats``), per-site (``by_site``), ``site_mean``, per-attribute and
    ``extra`` (per declared evaluation) metrics of one model version. With ``share_cap`` (robust.max_share) no site's
    images weigh more than that in any pooled metric, per attribute and per declared evaluation too, as in the
    aggregate (capped shares: ``<split>_capped``, ``test_by_attribute_capped``)."""
    evaluations = dict(sorted(evaluations.items()))  # sum in site order, not arrival order: reproducible bits
    summary: dict[str, Any] = {"sites": list(evaluations)}
    summary.update(_split_block(evaluations, shot_groups, with_stats=True, share_cap=share_cap))
    by_attribute: dict[str, dict[str, EvalStats]] = {}
    for site, evaluation in evaluations.items():
        for attribute, stats in evaluation.get("test_by_attribute", {}).items():
            by_attribute.setdefault(attribute, {})[site] = stats
    if by_attribute:
        pooled = {a: capped_pool(parts, share_cap) for a, parts in sorted(by_attribute.items())}
        summary["test_by_attribute"] = {a: compute_metrics(stats) for a, (stats, _) in pooled.items()}
        capped = {a: shares for a, (_, shares) in pooled.items() if shares}
        if capped:
            summary["test_by_attribute_capped"] = capped
    names = sorted({name for e in evaluations.values() for name in e.get("extra", {})})
    if names:
        summary["extra"] = {name: _split_block({site: e["extra"][name] for site, e in evaluations.items()
                                                if name in e.get("extra", {})}, shot_groups, share_cap=share_cap)
                            for name in names}
    return summary


class DeclaredCounts:
    """Each site's evaluation counts per split as first reported: its splits do not change during a job, so a
    later report with other counts (or attribute groups larger than the test split) is refused."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}

    def refusal(self, site: str, evaluation: SiteEvaluation) -> str:
        """Why ``site``'s statistics are refused ("" when they are accepted; the first report declares)."""
        found = {split: evaluation[split].count for split, _ in SPLIT_KEYS if split in evaluation}
        for name, splits in (evaluation.get("extra") or {}).items():
            found.update({f"{name}/{split}": stats.count for split, stats in splits.items()})
        declared = self.counts.setdefault(site, {})
        for split, count in sorted(found.items()):
            if declared.setdefault(split, count) != count:
                return (f"its {split} statistics count {count} images, but it declared {declared[split]} the first "
                        "time: a site's evaluation splits do not change during a job")
        groups = sum(stats.count for stats in (evaluation.get("test_by_attribute") or {}).values())
        if "test" in found and groups > found["test"]:
            return f"its attribute groups count {groups} test images, more than its test split's {found['test']}"
        return ""


HISTOGRAM_KEYS = ("pos_hist", "neg_hist")  # the score histograms behind AUROC: K x 1000 counts per split


def without_histograms(summary: Mapping[str, Any]) -> dict[str, Any]:
    """``summary`` with its pooled ``*_stats`` cut to the confusion matrix, loss and count, for the per-round
    history (the histograms, ~160 KiB a round for K = 5, grew memory, results file and checkpoint every round)."""
    compact = dict(summary)
    for split in ("val", "test"):
        stats = summary.get(f"{split}_stats")
        if isinstance(stats, Mapping):
            compact[f"{split}_stats"] = {k: v for k, v in stats.items() if k not in HISTOGRAM_KEYS}
    return compact


def _split_block(
    per_site: Mapping[str, Mapping[str, EvalStats]], shot_groups: Mapping[str, Sequence[int]] | None,
    with_stats: bool = False, share_cap: float = 0.0,
) -> dict[str, Any]:
    block: dict[str, Any] = {}
    for split in ("val", "test"):
        parts = {site: stats[split] for site, stats in per_site.items() if split in stats}
        if parts:
            pooled, capped = capped_pool(parts, share_cap)
            block[split] = compute_metrics(pooled, shot_groups)
            if capped:
                block[f"{split}_capped"] = capped
            if with_stats:
                block[f"{split}_stats"] = _sum(list(parts.values())).to_dict()
    by_site = {site: compute_metrics(stats["test"], shot_groups) for site, stats in sorted(per_site.items()) if "test" in stats}
    if by_site:
        block["by_site"] = by_site
        block["site_mean"] = site_mean(by_site)
    return block


def site_mean(by_site: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """Unweighted mean over sites of every scalar metric (sites where it is undefined are left out)."""
    names = sorted({k for metrics in by_site.values() for k, v in metrics.items() if _is_number(v) or v is None})
    values = {name: [float(m[name]) for m in by_site.values() if _is_number(m.get(name))] for name in names}
    return {name: float(np.mean(scores)) if scores else None for name, scores in values.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _sum(parts: list[EvalStats]) -> EvalStats:
    return sum(parts[1:], parts[0])


CAP_RESOLUTION = 1000  # the capped pool weighs sites by whole multiples: shares kept to 0.1 % of the smallest


def capped_pool(parts: Mapping[str, EvalStats], cap: float) -> tuple[EvalStats, dict[str, float]]:
    """The sites' statistics pooled with no site's images above ``cap`` (each image counted a whole number of
    times in proportion to its capped share, as ``cap_shares`` gives), and the capped shares (empty: plain sum)."""
    counts = {site: float(stats.count) for site, stats in parts.items() if stats.count > 0}
    if cap <= 0 or len(counts) < 2:
        return _sum(list(parts.values())), {}
    shares = cap_shares(raw := normalise_weights(counts), cap)
    capped = {site: shares[site] for site in counts if shares[site] < raw[site] - 1e-9}
    if not capped:
        return _sum(list(parts.values())), {}
    per_image = {site: shares[site] / counts[site] for site in counts}
    base = min(per_image.values())
    return _sum([_repeated(parts[site], max(1, round(CAP_RESOLUTION * per_image[site] / base))) for site in counts]), capped


def _repeated(stats: EvalStats, times: int) -> EvalStats:
    """``stats`` as if every one of its samples had been seen ``times`` times."""
    return type(stats)(**{f.name: getattr(stats, f.name) * times for f in dataclasses.fields(stats)})


# ----- generalization and specialization (FCA's evaluation protocol) --------------------------------------------
SPECIALIZATION = "specialization"  # name of the method-declared evaluation of each site's own (personal) model
# name of the method-declared evaluation of each site's own model on the pooled test set (methods without a global
# classifier: FedRep, local-only); simulation only, where a site can build the pooled test set
GENERALIZATION = "generalization"
# FCA's protocol (paper §4.2, spec §6(d)): each client's test set follows its own class mix, so simulated sites
# use like_train slices. A plain dict, not a MappingProxyType: specs are deep-copied and a proxy cannot be.
FCA_PROTOCOL_DATA: Mapping[str, Any] = {"eval_split": "like_train"}
_FIGURES = (("balanced_accuracy", "bacc"), ("bauc", "bauc"))


def personalization_figures(
    final: Mapping[str, Any], *, global_classifier: bool, specialization: str | None = SPECIALIZATION,
    generalization: str | None = None,
) -> dict[str, Any]:
    """FCA's figures from :func:`summarize`'s final evaluation, in bACC and bAUC, with per-site ones.

    * Generalization: the global model on the pooled test splits; without a global classifier (local-only, FedRep)
      the mean of each site's own model on the pooled test set (declared evaluation ``generalization``, or None).
    * Specialization: the mean of each site's own model on its own test split (declared evaluation
      ``specialization``, or the main evaluation's ``site_mean`` when None: sites keep the global model).
    * ``gs_mean_*``: the mean of the two (the paper's "Average of G&S"), None if either is missing.

    Reference: Wicaksana, Yan and Cheng, FCA: Taming Long-tailed Federated Medical Image Classification by
    Classifier Anchoring, 2023, §4.2 (bAUC: spec §1.5).
    """
    general_block = {} if global_classifier or not generalization else final.get("extra", {}).get(generalization, {})
    general = final.get("test", {}) if global_classifier else general_block.get("site_mean", {})
    block = final.get("extra", {}).get(specialization, {}) if specialization else final
    special = block.get("site_mean", {})
    figures: dict[str, Any] = {}
    for metric, short in _FIGURES:
        g, s = general.get(metric), special.get(metric)
        figures.update({f"generalization_{short}": g, f"specialization_{short}": s,
                        f"gs_mean_{short}": (g + s) / 2 if g is not None and s is not None else None})

    def by_site(scored: Mapping[str, Any]) -> dict[str, Any]:
        return {site: {short: m.get(metric) for metric, short in _FIGURES} for site, m in scored.get("by_site", {}).items()}

    figures["specialization_by_site"] = by_site(block)
    if general_block:
        figures["generalization_by_site"] = by_site(general_block)
    return figures
