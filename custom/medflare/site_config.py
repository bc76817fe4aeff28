"""What a site runs, decided before any image is read: the job's task, a site's settings, its own
``medflare_site.json`` (data, DP-SGD, architecture) and the checks a job's options get. The torch runtime that acts
on them is :mod:`medflare.site_runtime`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from medflare.config import MAX_IMAGE_SIZE, bounded, check_fields, fields_typed, from_dict
from medflare.errors import ConfigError, DataError, did_you_mean
from medflare.methods.base import MethodSpec, TrainConfig

if TYPE_CHECKING:
    from medflare.data import DataConfig
    from medflare.dp_sgd import DPSGDConfig

T = TypeVar("T")
SITE_CONFIG_FILE = "medflare_site.json"  # in a site's local/ folder (POC and production)
ALLOW_JOB_DATA = "allow_job_data"  # a site's opt-in (in that file): jobs may bring their own, e.g. simulated, data
# Every top-level key of that file medflare reads; a key beside them would be ignored (a misspelt "polcy" turned the
# site's policy off), so any other is refused. "_comment..." keys are notes (JSON has no comments).
SITE_FILE_KEYS = ("data", "model", "dp_sgd", "distributed", "policy", ALLOW_JOB_DATA)
COMMENT_PREFIX = "_comment"
EVALUATION_MODES = ("every_round", "final", "off")
MAX_CLASSES = 100_000  # a task's classes


@dataclass
class TaskSpec:
    """Facts about the task that site and server must agree on (no data, no paths). ``multi_label``: multi-hot
    labels, sigmoid scores, BCE (read off simulated data, declared for site data); ``class_names``: for reports."""

    num_classes: int = bounded(low=2, high=MAX_CLASSES)
    in_channels: int = bounded(low=1, high=16)
    image_size: int = bounded(low=8, high=MAX_IMAGE_SIZE)
    multi_label: bool = False
    class_names: list[str] | None = bounded(None, items=MAX_CLASSES, checked_by="one distinct name per class")

    def __post_init__(self) -> None:
        check_fields(self, "task")


@dataclass
class SiteSettings:
    """One site's full configuration, from the job and the site's own file (:meth:`medflare.plan.RunPlan.localise`)."""

    spec: MethodSpec
    task: TaskSpec
    data: dict[str, Any]
    model: str = "cnn"
    # typed by the plan (RunPlan.method_cfg, the site's TrainConfig); options given by hand are typed here, once
    method_args: Any = field(default_factory=dict)
    train: TrainConfig | Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    evaluation: str = "every_round"  # every_round | final | off: when the site sends evaluation counts
    dp_sgd: DPSGDConfig | None = None  # DP-SGD as this site trains it (resolve_site_dp); None = off
    min_class_samples: int = 0  # the site policy's floor: no statistics about a class with fewer samples leave

    def __post_init__(self) -> None:
        if self.evaluation not in EVALUATION_MODES:
            raise ConfigError(f"evaluation must be one of {EVALUATION_MODES}, got '{self.evaluation}'")
        check_multi_label_support(self.spec, self.task)
        self.method_args = self.spec.config_of(self.method_args)
        if not isinstance(self.train, TrainConfig):
            self.train = resolve_train_config(self.spec, self.train)

    @property
    def method(self) -> str:
        return self.spec.name


def check_multi_label_support(spec: MethodSpec, task: TaskSpec, able: list[str] | None = None) -> None:
    """A multi-label task needs a ``MethodSpec.multi_label`` method; ``able``: those to name in the message."""
    if task.multi_label and not spec.multi_label:
        offer = f"use one of {', '.join(able)}" if able else "use a method that trains multi-label tasks"
        raise ConfigError(f"method '{spec.name}' trains single-label classifiers (softmax over classes) and cannot run "
                          f"this multi-label task; {offer}")


def typed_data_config(data: Mapping[str, Any], where: str = "data") -> DataConfig:
    """A data section as :class:`medflare.data.DataConfig`, every value typed and range-checked."""
    from medflare.data import DataConfig

    return from_dict(DataConfig, dict(data), where)


# The arguments of the FLARE filters :class:`medflare.flare.privacy.UpdatePrivacy` applies, by its filter names
DP_FILTER_ARGS = {
    "percentile": ("percentile", "gamma"),
    "svt": ("fraction", "epsilon", "noise_var", "gamma", "tau", "replace", "epsilon_threshold", "epsilon_query",
            "epsilon_release"),
}


@dataclass(frozen=True)
class DPFilter:
    """A job's dp result filter, typed: FLARE's filter name (:data:`DP_FILTER_ARGS`) and its own arguments."""

    filter: str
    args: Mapping[str, Any]


def check_dp_filter(dp: Mapping[str, Any]) -> DPFilter:
    """A job's dp result filter (``{"filter": ..., "args": {...}}``), checked without FLARE, and typed."""
    unknown = sorted(set(dp) - {"filter", "args"})
    name, args = dp.get("filter", "percentile"), dp.get("args") or {}
    if unknown:
        raise ConfigError(f"dp: unknown option(s) {', '.join(unknown)}; valid options: filter, args")
    if name not in DP_FILTER_ARGS:
        raise ConfigError(f"dp: UpdatePrivacy filter must be one of {sorted(DP_FILTER_ARGS)}, got '{name}'")
    wrong = sorted(set(args) - set(DP_FILTER_ARGS[name])) if isinstance(args, Mapping) else [repr(args)]
    if wrong:
        raise ConfigError(f"dp: args {', '.join(wrong)} not taken by FLARE's '{name}' filter; it takes "
                          f"{', '.join(DP_FILTER_ARGS[name])}")
    return DPFilter(name, dict(args))


def resolve_train_config(spec: MethodSpec, overrides: Mapping[str, Any] | None) -> TrainConfig:
    """TrainConfig = shared defaults <- the method's paper defaults <- the job's overrides; ``stages`` merge stage
    by stage and option by option, so a job can change one option of one stage."""
    defaults, job = dict(spec.train_defaults), dict(overrides or {})
    merged = {**defaults, **job}
    if isinstance(defaults.get("stages"), Mapping) and isinstance(job.get("stages"), Mapping):
        names = {**defaults["stages"], **job["stages"]}
        merged["stages"] = {n: {**defaults["stages"].get(n, {}), **job["stages"].get(n, {})} for n in names}
    return from_dict(TrainConfig, merged, "train")


# Data options a job may set at a site that reads its own data (``{"source": "site"}``). None of them names a file
# or folder: each only reshuffles, resizes, relabels or subsets, in memory, the images the site's own
# ``medflare_site.json`` names, so a job cannot make the site read (or send results about) anything else.
JOB_SETTABLE_DATA_KEYS = frozenset({
    "augment",  # training augmentation of the same images
    "image_size",  # the size the same images are resized to
    "seed",  # reseeds the site's own splits and label draws; job templates send it
    "partition",  # simulation only (ignored when local); job templates send it
    "eval_split",  # simulation only (ignored when local)
    "min_size",  # a size check of simulated training slices
    "num_classes",  # a check; the runtime replaces it with the job's task.num_classes anyway
    "label_noise",  # flips some of the site's own training labels (robustness studies)
    "noise_kind",  # how label_noise flips them
    "label_fraction",  # hides some of the site's own training labels
    "imbalance",  # long-tail cut: trains on a subset of the same training images
    "window",  # intensity window of the same DICOM/NIfTI files: numbers, a preset or the files' own header
    "site_shift",  # pixel shift of in-memory demo sources (a file source refuses it)
})
# Only the site's own file sets these: they name what is read (source, public_source), carve the site's images
# into a set whose predictions go to the server (public_fraction), or state what its labels mean (identified,
# class_map: its own class names -> the job's; patient_column: which of its CSV's columns names the patient).
# The refusal covers every key outside JOB_SETTABLE_DATA_KEYS; this set records the review of DataConfig's fields.
SITE_ONLY_DATA_KEYS = frozenset({"source", "public_source", "public_fraction", "identified", "class_map",
                                 "patient_column"})
# Fixed by medflare at a site that reads its own data: a job's (or the file's) value is replaced.
SITE_FIXED_DATA = {"local": True, "num_sites": 1}


def read_site_data_config(
    site_config_dir: str | Path | SiteFile, job_data: Mapping[str, Any] | None, simulated: bool = False
) -> dict[str, Any]:
    """The data config a site uses: the hospital, not the job, decides.

    A site with a ``local/medflare_site.json`` always follows it: the job's ``{"source": "site"}`` (or nothing)
    reads the file's ``data``, plus the job's options in :data:`JOB_SETTABLE_DATA_KEYS` the file does not set; a
    job that names its own source, or sets any other data key the file does not set (e.g. ``public_source``), is
    refused unless the file opts in with ``"allow_job_data": true`` (a test or POC site). Only FLARE's
    simulator, whose sites have no such file, takes the job's data without an opt-in: ``simulated`` comes from
    its engine's ``FLContextKey.SIMULATE_MODE``, which a job's configuration cannot set.

    Raises:
        DataError: the job's data is refused, or the site's file is missing, not JSON or has no ``data`` object.
    """
    site_file = SiteFile.of(site_config_dir)
    path, opted_in = site_file.path, site_file.get(ALLOW_JOB_DATA) is True
    job_source = (job_data or {}).get("source", "site")
    if job_source != "site":
        if (site_file.content is None and simulated) or opted_in:
            return dict(job_data or {})
        raise DataError(
            f"refused: the job names its own data (source '{job_source}'), but this site reads only the data in "
            f"its {path}. Submit the job with {{\"source\": \"site\"}}, or (test sites only) add "
            f'"{ALLOW_JOB_DATA}": true to that file'
        )
    site_data = _site_data_block(path, site_file.content)
    job_options = {k: v for k, v in (job_data or {}).items() if k != "source"}
    if not opted_in:
        _refuse_site_only_keys(job_options, site_data, path)
    return {**job_options, **site_data, **SITE_FIXED_DATA}


def _site_data_block(path: Path, site_file: dict[str, Any] | None) -> dict[str, Any]:
    """The ``data`` object of the site's file, which must name its source (without one the data would default to
    medflare's synthetic images, and a hospital would train on them without a word)."""
    if site_file is None:
        raise DataError(
            f"this site has no data configured: {path} is missing. Create it with "
            '{"data": {"source": "folder:/path/to/images"}} (or csv:/path/manifest.csv, medmnist:/path/file.npz)'
        )
    site_data = site_file.get("data")
    if not isinstance(site_data, dict):
        raise DataError(f"{path} has no 'data' object; add e.g. {{\"data\": {{\"source\": \"folder:/path\"}}}}")
    source = site_data.get("source")
    if not isinstance(source, str) or not source.strip():
        raise DataError(f"{path}: its 'data' object names no source, so this site has no images to train on; add "
                        '"source", e.g. {"data": {"source": "folder:/path/to/images"}} (or csv:/path/manifest.csv, '
                        "medmnist:/path/file.npz)")
    from medflare.data import DataConfig  # local, as in typed_data_config

    fields_typed(DataConfig, site_data, f"{SITE_CONFIG_FILE} data")  # a misspelt key is refused here, naming the file
    return site_data


def _refuse_site_only_keys(job_options: Mapping[str, Any], site_data: Mapping[str, Any], path: Path) -> None:
    """Refuse (not drop, so the job's author learns it had no effect) the job's data keys only the site may set."""
    refused = sorted(set(job_options) - JOB_SETTABLE_DATA_KEYS - set(SITE_FIXED_DATA) - set(site_data))
    if refused:
        raise DataError(
            f"refused: the job sets data key(s) {', '.join(refused)}, which this site sets only in its own {path}; "
            f"remove them from the job (a job may set only {', '.join(sorted(JOB_SETTABLE_DATA_KEYS))})"
        )


def resolve_site_model(
    spec: MethodSpec, job_model: str, site_models: Mapping[str, str] | None, site: str,
    site_config_dir: str | Path | SiteFile | None,
) -> str:
    """The architecture this site trains: its file's "model", else the job's ``site_model``, else the job's model.
    Only methods whose server holds no model may mix architectures (the server averages weights key by key)."""
    local = SiteFile.of(site_config_dir).get("model")
    chosen = local or (site_models or {}).get(site) or job_model
    if chosen != job_model and spec.server_model:
        where = "its local medflare_site.json" if local else "the job's site_model"
        raise ConfigError(
            f"{site}: {where} asks for model '{chosen}', but '{spec.name}' averages weights, so every site must train "
            f"the job's model '{job_model}'; per-site architectures need a method that sends no weights (e.g. mdhfl)"
        )
    return str(chosen)


def resolve_site_dp(
    job_dp: DPSGDConfig | None, site: str, site_config_dir: str | Path | SiteFile | None
) -> DPSGDConfig | None:
    """The DP-SGD settings this site trains with (None = off): the job's ``dp_sgd`` (typed once with the plan,
    ``RunPlan.dp_sgd_cfg``) against its file's ``dp_sgd`` policy (DP-SGD required, a σ floor, clipping/δ ceilings,
    a budget). Raises SiteDeclined (one line, sent to the server) when the job asks for less than the site demands."""
    site_file = SiteFile.of(site_config_dir)
    if job_dp is None and not site_file.get("dp_sgd"):
        return None
    from medflare.dp_sgd import SiteDPPolicy, site_dp_settings  # local: needed only with DP-SGD

    return site_dp_settings(job_dp, site_file.section("dp_sgd", SiteDPPolicy), site)


@dataclass(frozen=True)
class SiteFile:
    """A site's ``local/medflare_site.json``, read once; ``content`` is None when there is none (the simulator)."""

    path: Path
    content: dict[str, Any] | None

    @classmethod
    def of(cls, site: str | Path | SiteFile | None) -> SiteFile:
        """``site`` itself, or the file in the ``local/`` folder ``site`` (None: no file). Raises DataError naming
        the file and the field that is not JSON, nested too deep, or of the wrong type."""
        if isinstance(site, SiteFile):
            return site
        path = Path(site or ".") / SITE_CONFIG_FILE
        if site is None or not path.is_file():
            return cls(path, None)
        from medflare import readback  # local: beside its one use in this module

        fix = 'fix it, e.g. {"data": {"source": "folder:/path"}}'
        # "data" and ALLOW_JOB_DATA are checked where they are used (a missing data object, only true opts in)
        schema = readback.obj(optional={"model": readback.STR, "dp_sgd": readback.OBJECT,
                                        "distributed": readback.OBJECT, "policy": readback.OBJECT})
        content = readback.check(readback.load_json(path, DataError, fix=fix), schema, str(path), DataError, fix)
        unknown_key_refusal(content, path)
        # notes are dropped here, once, so each section's typed reader refuses every other unknown key, at any level
        return cls(path, without_comments(content))

    def get(self, key: str, default: Any = None) -> Any:
        return (self.content or {}).get(key, default)

    def section(self, key: str, cls: type[T]) -> T:
        """The file's ``key`` object typed as ``cls`` (its defaults where the file sets none): the one place a site's
        own sections (``policy``, ``dp_sgd``) are typed. ConfigError names the file, the section and the field."""
        return from_dict(cls, dict(self.get(key) or {}), f"{SITE_CONFIG_FILE} {key}")


def unknown_key_refusal(content: Mapping[str, Any], path: Path) -> None:
    """DataError naming the first top-level key of a site file that medflare does not read (its likely spelling and
    the keys there are), so that a typo never turns a setting off unseen."""
    unknown = [key for key in content if key not in SITE_FILE_KEYS and not str(key).startswith(COMMENT_PREFIX)]
    if unknown:
        hint = did_you_mean(unknown[0], SITE_FILE_KEYS)
        raise DataError(f"{path}: unknown key {unknown[0]!r}{hint}, which medflare would ignore; a site file has "
                        f"{', '.join(sorted(SITE_FILE_KEYS))} and {COMMENT_PREFIX}... notes; rename or remove it")


def without_comments(value: Any) -> Any:
    """``value`` with every ``_comment...`` key of every object in it left out (a site file's notes, at any level)."""
    if isinstance(value, dict):
        return {k: without_comments(v) for k, v in value.items() if not str(k).startswith(COMMENT_PREFIX)}
    if isinstance(value, list):
        return [without_comments(v) for v in value]
    return value


def site_index_from_name(site_name: str, sites: list[str] | None) -> int:
    """Position of a site in the job's site list (used to pick its simulated partition)."""
    if sites:
        if site_name not in sites:
            raise ConfigError(f"site '{site_name}' is not in the job's site list {sites}")
        return sites.index(site_name)
    digits = "".join(ch for ch in site_name.rsplit("-", 1)[-1] if ch.isdigit())
    if not digits:
        raise ConfigError(f"cannot derive a partition index from site name '{site_name}'; list the sites in the job")
    return int(digits) - 1
