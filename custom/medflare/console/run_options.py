"""A run's configuration from the command line's layers (defaults, preset, scenario, config file, flags, ``--set``),
parsed alike by every command that builds a run, and the smoke caps the runnable-docs test sets."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import TYPE_CHECKING, Any

from medflare.config import load_config_file

if TYPE_CHECKING:  # importing the run configuration pulls in torch: only the commands that build a run pay it
    from medflare.run_config import RunConfig

# MEDFLARE_SMOKE=1 (the runnable-docs test sets it) caps every run built here, so the docs' commands run as written
# in seconds instead of minutes. The data is not shrunk (evaluating the full splits is cheap next to FLARE's start-up).
SMOKE_ENV = "MEDFLARE_SMOKE"
SMOKE_CAPS = {"rounds": 2, "train.local_epochs": 1, "train.max_steps": 2}


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options every command that builds a job takes (``run``, ``compare``, ``export``, ``config``, POC
    ``submit``)."""
    from medflare.catalog import load_catalog  # not the partition module itself: that imports torch
    from medflare.console.scenarios import list_scenarios

    parser.add_argument("--data", help="synthetic[:k=v,...] | medmnist:PATH | folder:DIR | csv:FILE | site; "
                                       "--set data.imbalance=IR cuts a long-tailed training split from any source, "
                                       "--set data.window=40,80 (or brain, lung, bone, file) windows DICOM/NIfTI")
    parser.add_argument("--partition", help=" | ".join(load_catalog()["partitions"]))
    parser.add_argument("--clients", type=int, help="number of sites (default 2)")
    parser.add_argument("--rounds", type=int, help="federated rounds (default 3)")
    parser.add_argument("--local-epochs", type=int, help="local epochs per round (default 1)")
    parser.add_argument("--max-steps", type=int, help="cap on optimizer steps per site per round (0 = none)")
    parser.add_argument("--batch-size", type=int, help="local batch size (default 64)")
    parser.add_argument("--lr", type=float, help="local learning rate")
    parser.add_argument("--model", help="model name (see 'medflare models'; default: the method's, e.g. cnn, vit_tiny for "
                                          "fed-mae/fed-beit, efficientnet_lite0 for fca)")
    parser.add_argument("--pretrained", help="'imagenet' (efficientnet_lite0) or a local weights file")
    parser.add_argument("--seed", type=int, help="seed for data, partition and initial model (default 0)")
    parser.add_argument(
        "--shot-thresholds", type=int, nargs=2, metavar=("HEAD_MIN", "TAIL_MAX"),
        help="head/medium/tail accuracy by each class's total training images n: head if n > HEAD_MIN, tail if "
             "n < TAIL_MAX (both exclusive), medium if TAIL_MAX <= n <= HEAD_MIN (inclusive); e.g. 700 70 "
             "(HyperKvasir). Same as --set shot_thresholds=[700,70]",
    )
    parser.add_argument("--preset", help="named configuration of the method, e.g. 'paper': the paper's headline set-up "
                                         "(model, resolution, rounds, optimizer, ...); the lowest layer, so "
                                         "--scenario, --config, flags and --set override it ('medflare methods' "
                                         "lists the presets)")
    parser.add_argument("--scenario", help=f"named set-up: {' | '.join(list_scenarios())} (docs/scenarios.md)")
    parser.add_argument("--config", help="JSON or TOML file with run options (overrides the scenario; flags override it)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override any option: method.mu=0.1, train.weight_decay=1e-4, data.label_noise=0.2, min_clients=2",
    )


def build_run_config(args: argparse.Namespace, method: str | None = None) -> RunConfig:
    """RunConfig defaults <- --preset <- --scenario <- --config <- flags <- --set, for ``method`` (default
    ``args.method``), unchecked (:func:`medflare.plan.validated`); within :data:`SMOKE_CAPS` when
    ``$MEDFLARE_SMOKE`` asks, saying so on stderr (a smoke-size run must never pass for a result)."""
    from medflare.run_config import apply_overrides

    run = _layered_run(args, method)
    capped = smoke_caps(run)
    if capped:
        _note_once(f"medflare: note: {SMOKE_ENV}={os.environ[SMOKE_ENV]}: a smoke-size run, not a result "
                   f"({', '.join(capped)})")
    return apply_overrides(run, capped) if capped else run


def _layered_run(args: argparse.Namespace, method: str | None) -> RunConfig:
    from medflare.run_config import apply_overrides, merge_run_config

    return apply_overrides(merge_run_config(*(layer for _, layer in run_layers(args, method))), args.set)


def smoke_caps(run: RunConfig) -> list[str]:
    """The ``key=value`` overrides that bring ``run`` within :data:`SMOKE_CAPS` (none without ``$MEDFLARE_SMOKE``)."""
    if not smoke_requested():
        return []
    return [f"{key}={cap}" for key, cap in SMOKE_CAPS.items() if not _within(_option_value(run, key), cap)]


def smoke_requested() -> bool:
    """Whether ``MEDFLARE_SMOKE`` asks to cap every run at smoke size (the runnable-docs tests set it)."""
    return os.environ.get(SMOKE_ENV, "0") not in ("", "0")


def _option_value(run: RunConfig, key: str) -> Any:
    """A dotted option's value as set so far (``None`` when a section leaves it to the method's default)."""
    from medflare.run_config import SECTIONS

    section, _, sub = key.partition(".")
    return getattr(run, SECTIONS[section]).get(sub) if sub else getattr(run, key)


def _within(value: Any, cap: int) -> bool:
    """Whether a count option (text until validated) is set to 1..cap; a non-integer is left for validation."""
    try:
        return value is not None and 0 < int(str(value)) <= cap
    except ValueError:
        return True


@functools.cache  # compare builds each method's run twice: one note per distinct change is enough
def _note_once(text: str) -> None:
    print(text, file=sys.stderr)


def option_layers(args: argparse.Namespace, method: str | None = None) -> list[tuple[str, set[str]]]:
    """Which options each layer of :func:`build_run_config` sets (dotted names), lowest first: the sources
    ``medflare config`` reports."""
    from medflare.config import layer_options, override_options
    from medflare.run_config import SECTIONS

    sections = set(SECTIONS.values())
    named = [(name, layer_options(layer, sections)) for name, layer in run_layers(args, method)]
    named.append(("--set", override_options(args.set, SECTIONS)))
    if smoke_requested():  # a smoke-size run's caps are the top layer (build_run_config applies them last)
        named.append((SMOKE_ENV, override_options(smoke_caps(_layered_run(args, method)), SECTIONS)))
    return named


def run_layers(args: argparse.Namespace, method: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The layers under ``--set``, lowest first, named as the user gave them: --preset, --scenario, --config, flags."""
    from medflare.console.scenarios import load_scenario
    from medflare.plan import preset_layer

    # compare: a method without the preset takes the shared part of the first compared method's that has one
    preset = preset_layer(getattr(args, "preset", None), method or args.method, getattr(args, "preset_lead", None))
    scenario = load_scenario(args.scenario) if args.scenario else {}
    from_file = load_config_file(args.config) if args.config else {}
    data = {"source": args.data, "partition": args.partition}
    train = {"local_epochs": args.local_epochs, "max_steps": args.max_steps, "batch_size": args.batch_size,
             "lr": args.lr}
    flags = {
        "method": method or args.method, "clients": args.clients, "rounds": args.rounds, "model": args.model,
        "pretrained": args.pretrained, "seed": args.seed, "shot_thresholds": getattr(args, "shot_thresholds", None),
        "data": {k: v for k, v in data.items() if v is not None},
        "train": {k: v for k, v in train.items() if v is not None},
    }
    return [(f"--preset {args.preset}" if getattr(args, "preset", None) else "--preset", preset),
            (f"--scenario {args.scenario}" if args.scenario else "--scenario", scenario),
            (f"--config {args.config}" if args.config else "--config", from_file), ("flags", flags)]


def data_was_chosen(args: argparse.Namespace) -> bool:
    """True when --data, a scenario, a config file or --set data.source picked the data source."""
    from_file = bool(args.config) and "source" in load_config_file(args.config).get("data", {})
    from_set = any(item.partition("=")[0] == "data.source" for item in args.set)
    return args.data is not None or bool(args.scenario) or from_file or from_set
