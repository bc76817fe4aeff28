"""``medflare config``: a run's effective configuration as TOML, every option with its type, default and source.

The run is the one ``run`` builds and validates (nothing here merges layers again); the text is a ``--config`` file
that runs the same configuration, with options left at their defaults as comments.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, get_type_hints

from medflare.config import describe_type, option_source
from medflare.plan import method_of
from medflare.run_config import SECTIONS, RunConfig
from medflare.server_setup import DEPLOY_ROBUST, ROBUST_OFF_KEY

DEFAULT_SOURCE = "default"
METHOD_DEFAULT_SOURCE = "method default"  # MethodSpec.train_defaults / data_defaults / default_model
BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
UNSET = object()  # a default a run reads elsewhere (the task's shape: from the data)


class Option(NamedTuple):
    """One option as printed: its value (UNSET: read from the data), type, default and the layer that set it."""

    key: str
    value: Any
    hint: Any
    default: Any
    source: str
    written: bool  # a value line; False: a comment showing the value the run uses


def config_toml(run: RunConfig, layers: Sequence[tuple[str, set[str]]]) -> str:
    """The annotated TOML of a validated ``run``; ``layers``: ``run_options.option_layers``."""
    sections = set(SECTIONS.values())
    top = [_top_option(run, f, layers) for f in dataclasses.fields(RunConfig) if f.name not in sections]
    lines = [*_header(run), *(_line(option) for option in top)]
    for section, options in _section_options(run, layers).items():
        lines += ["", f"[{section}]", *_section_note(section), *(_line(option) for option in options)]
    return "\n".join(lines) + "\n"


def _header(run: RunConfig) -> list[str]:
    return [
        f"# medflare config {run.method}: the configuration 'medflare run' builds from these options, validated.",
        f"# Run it again: medflare run {run.method} --config FILE. Each option says its type, its default and the",
        "# layer its value came from: default < --preset < --scenario < --config < flags < --set. Options left at",
        "# their defaults are comments; set any here or with --set section.option=value ([method_args]: method.X).",
        "",
    ]


def _section_note(section: str) -> list[str]:
    if section == "robust":
        deploy = ", ".join(f"{key}={value:g}" for key, value in DEPLOY_ROBUST.items())
        return [f"# a POC, production or pre-installed job adds {deploy} under these (docs/deploy-lead.md)"]
    if section == "task":
        return ["# read from the data unless all of num_classes, in_channels and image_size are given"]
    if section == "dp_sgd":
        return ["# DP-SGD at every site: off unless an option is set here (medflare[dp]; docs/privacy.md)"]
    if section == "server_optimizer":
        return ["# the server's step on the aggregate: none unless name is set (docs/server-optimizers.md)"]
    return []


def _top_option(run: RunConfig, field: dataclasses.Field, layers: Sequence[tuple[str, set[str]]]) -> Option:
    default = _field_defaults(RunConfig)[field.name]
    source = option_source(field.name, layers)
    if field.name == "model":  # "" stands for the method's default network
        default, source = method_of(run).default_model, source or METHOD_DEFAULT_SOURCE
    value = getattr(run, field.name)
    hint = _field_hints(RunConfig)[field.name]
    return Option(field.name, value, hint, default, source or DEFAULT_SOURCE, written=value is not None)


class Section(NamedTuple):
    """A section's options: their hints, and the defaults and the options the run's method gives itself."""

    hints: dict[str, Any]
    defaults: dict[str, Any]
    method_keys: frozenset[str] = frozenset()


def _sections(run: RunConfig) -> dict[str, Section]:
    """Every section's dataclass fields (robust: and ``off``), with the defaults this run's method gives them."""
    from medflare.data import DataConfig
    from medflare.dp_sgd import DPSGDConfig
    from medflare.methods.base import TrainConfig
    from medflare.ops.server_opt import ServerOptConfig
    from medflare.server_setup import RobustConfig
    from medflare.site_config import TaskSpec, resolve_train_config

    spec = method_of(run)
    return {
        "train": Section(_field_hints(TrainConfig), dataclasses.asdict(resolve_train_config(spec, {})),
                         frozenset(spec.train_defaults)),
        "data": Section(_field_hints(DataConfig),
                        {**_field_defaults(DataConfig), **spec.data_defaults, **_filled_by_the_run(run)},
                        frozenset(spec.data_defaults)),
        "method_args": Section(_field_hints(spec.config_cls), _field_defaults(spec.config_cls)),
        "task": Section(_field_hints(TaskSpec), _field_defaults(TaskSpec)),
        "robust": Section({**_field_hints(RobustConfig), ROBUST_OFF_KEY: bool},
                          {**_field_defaults(RobustConfig), ROBUST_OFF_KEY: False}),
        "dp_sgd": Section(_field_hints(DPSGDConfig), _field_defaults(DPSGDConfig)),
        "server_optimizer": Section(_field_hints(ServerOptConfig), _field_defaults(ServerOptConfig)),
    }


def _section_options(run: RunConfig, layers: Sequence[tuple[str, set[str]]]) -> dict[str, list[Option]]:
    """Every option of every section in field order: a value where the run holds it, else the default (comment)."""
    options: dict[str, list[Option]] = {}
    for name, section in _sections(run).items():
        given = getattr(run, name)
        options[name] = []
        for key, hint in section.hints.items():
            fallback = METHOD_DEFAULT_SOURCE if key in section.method_keys else DEFAULT_SOURCE
            source = option_source(f"{name}.{key}", layers) or fallback
            default = section.defaults.get(key, UNSET)
            value = given[key] if key in given else default
            # an option at its built-in default stays a comment, so the file read back as --config chooses only
            # what a layer chose (export treats a written data.source as the user's choice of data)
            written = key in given and source != DEFAULT_SOURCE
            options[name].append(Option(key, value, hint, default, source, written=written))
    return options


def _filled_by_the_run(run: RunConfig) -> dict[str, Any]:
    """The data options a simulated run fills in itself when the job leaves them open (its seed, its clients)."""
    return {key: value for key, value in run.site_data().items() if key not in run.data}


def _field_hints(cls: type) -> dict[str, Any]:
    """A dataclass's fields and their type hints, in field order."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _field_defaults(cls: type) -> dict[str, Any]:
    """A dataclass's field defaults (fields without one are left out)."""
    missing = dataclasses.MISSING
    given = [f for f in dataclasses.fields(cls) if f.default is not missing or f.default_factory is not missing]
    return {f.name: f.default if f.default_factory is missing else f.default_factory() for f in given}


def _line(option: Option) -> str:
    default = "from the data" if option.default is UNSET else toml_value(option.default, none="none")
    note = f"{describe_type(option.hint)}; default {default}; from {option.source}"
    if option.value is UNSET:
        return f"# {option.key} =  # {note}"
    assignment = f"{_toml_key(option.key)} = {toml_value(option.value, none='none')}"
    return f"{assignment}  # {note}" if option.written and option.value is not None else f"# {assignment}  # {note}"


def toml_value(value: Any, none: str | None = None) -> str:
    """``value`` as a TOML value; ``none`` stands for None, which TOML cannot hold (comments only); else
    ValueError, as for a value TOML has no form for."""
    if value is None:
        if none is None:
            raise ValueError("TOML has no null")
        return none
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's escapes are TOML basic-string escapes
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {toml_value(v, none)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item, none) for item in value) + "]"
    raise ValueError(f"no TOML form for {type(value).__name__} {value!r}")


def _toml_key(key: str) -> str:
    return key if BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)
