"""Typed configuration: dataclasses built from plain dicts, every field checked against its annotation (one
checker for every config dataclass). Text (``--set key=value``) is parsed by the annotation, so ``--set
train.lr=abc`` fails here, with one line naming the option, and never reaches a site.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import types
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from medflare.errors import ConfigError, did_you_mean

T = TypeVar("T")
TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
NONE_WORDS = ("none", "null")
MAX_WHOLE = 2**53  # whole numbers at or beyond it are refused: a float holds no larger integer exactly
SHOWN_CHARACTERS = 80  # of a refused value in a message
MAX_IMAGE_SIZE = 4096  # px: a task's or a data config's image size (every image is resized to it)
# Bounds of a run's numbers: beyond them a job is a typo or an attack (a round plan of 10^20 rounds filled memory;
# a seed of 2^64 failed inside FLARE; site indices are added to the seed, and numpy takes seeds below 2^32).
MAX_ROUNDS = 100_000
MAX_CLIENTS = 1_000
MAX_SEED = 2**31 - 1
MAX_SECONDS = 7 * 24 * 3600  # a week: straggler and task limits
BOUND = "medflare_bound"  # the key of a field's :class:`Bound` in its dataclass field metadata


@dataclass(frozen=True)
class Bound:
    """What a config field's value may be beyond its type: the one schema of bounds. A field declares it in its
    metadata (:func:`bounded`); :func:`fields_typed` (every ``--set``, config file and ``medflare_plan.json`` read)
    and :func:`check_fields` (a dataclass built directly) apply it. Numbers inside lists and dict values are each
    held to ``low``/``high``; ``items`` caps a list's length.

    Attributes:
        low, high: the range of each number (None: that side open-ended); ``low_open``/``high_open`` exclude it.
        zero: what 0 means, shown beside a low of 0 (``"no limit"``).
        choices: the texts allowed. pattern: a regular expression the whole text matches.
        items: most elements of a list or tuple.
        checked_by: a text not bounded here, and the check that holds it (a registry look-up, a path check).
        words: the allowed values in words, instead of the range (a pattern's meaning).
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    zero: str = ""
    choices: tuple[str, ...] = ()
    pattern: str = ""
    items: int | None = None
    checked_by: str = ""
    words: str = ""

    def describe(self) -> str:
        """The allowed values in words, as a message says them (``between 0 (no limit) and 604800``)."""
        if self.words:
            return self.words
        if self.choices:
            return "one of " + ", ".join(self.choices)
        low = f"{_number(self.low)}{f' ({self.zero})' if self.zero and self.low == 0 else ''}"
        if self.low is not None and self.high is not None:
            marks = (" (excluded)" if self.low_open else "", " (excluded)" if self.high_open else "")
            return f"between {low}{marks[0]} and {_number(self.high)}{marks[1]}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {low}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_number(self.high)}"
        return f"text checked by {self.checked_by}" if self.checked_by else "any value"

    def fits(self, value: Any) -> bool:
        """Whether ``value`` (already typed) is inside the bound; None always is (a field's 'not set')."""
        if value is None or isinstance(value, bool):
            return True
        if isinstance(value, (list, tuple)):
            return (self.items is None or len(value) <= self.items) and all(self.fits(v) for v in value)
        if isinstance(value, Mapping):
            return all(self.fits(v) for v in value.values())
        if isinstance(value, str):
            return ((not self.choices or value in self.choices)
                    and (not self.pattern or re.fullmatch(self.pattern, value) is not None))
        if isinstance(value, (int, float)):
            return not ((self.low is not None and (value < self.low or (self.low_open and value == self.low)))
                        or (self.high is not None and (value > self.high or (self.high_open and value == self.high))))
        return True


def bounded(default: Any = dataclasses.MISSING, **bound: Any) -> Any:
    """A dataclass field with :class:`Bound` ``bound`` in its metadata; a list or dict ``default`` is copied for
    each instance."""
    metadata = {BOUND: Bound(**bound)}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def bound_of(cls: type, name: str) -> Bound | None:
    """The :class:`Bound` field ``name`` of dataclass ``cls`` declares (None: none), so another dataclass that
    carries the same value (the plan's copy of a run option) declares the same bound, not a second one."""
    field_ = {f.name: f for f in dataclasses.fields(cls)}[name]
    return field_.metadata.get(BOUND)


def same_bound(cls: type, name: str, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field bounded as ``cls.name`` is (:func:`bound_of`)."""
    bound = bound_of(cls, name)
    return bounded(default, **dataclasses.asdict(bound)) if bound else dataclasses.field(default=default)


def check_length(value: Any, bound: Bound | None, option: str) -> None:
    """ConfigError for a list longer than ``bound.items``, checked before its elements are (a 10^6-round plan is
    refused by its length, not by its millionth round)."""
    if bound is not None and bound.items is not None and isinstance(value, (list, tuple)) and len(value) > bound.items:
        raise ConfigError(f"{option} must be a list of at most {bound.items} entries, got {len(value)}")


def check_bound(value: Any, bound: Bound | None, option: str) -> None:
    """ConfigError ``"<option> must be <bound>, got <value>"`` (one line) for a typed value outside ``bound``."""
    check_length(value, bound, option)
    if bound is not None and not bound.fits(value):
        raise ConfigError(f"{option} must be {bound.describe()}, got {_render(value)}")


def check_fields(obj: Any, where: str = "") -> None:
    """Every field of dataclass instance ``obj`` against its :class:`Bound` (a dataclass built directly, not
    through :func:`from_dict`); ``where`` names its section in the message."""
    for field_ in dataclasses.fields(obj):
        check_bound(getattr(obj, field_.name), field_.metadata.get(BOUND),
                    f"{where}.{field_.name}" if where else field_.name)


def _number(value: float | None) -> str:
    return str(int(value)) if value is not None and float(value).is_integer() else str(value)


def from_dict(cls: type[T], values: dict[str, Any] | None, where: str) -> T:
    """Build dataclass ``cls`` from ``values`` (missing fields keep their defaults), each checked against its
    annotation; ``where`` names the section in messages. ConfigError: an unknown key or a misfit (one line)."""
    return cls(**fields_typed(cls, values, where))


def fields_typed(cls: type, values: dict[str, Any] | None, where: str, owner: str = "") -> dict[str, Any]:
    """``values`` checked and converted by ``cls``'s annotations, nothing constructed: a partial section whose
    dataclass is built later (at the site). ``owner`` names who the options belong to (default ``where``)."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        valid = f"valid options: {', '.join(sorted(fields))}" if fields else "it takes no options"
        hint = did_you_mean(unknown[0], fields)
        raise ConfigError(f"{owner or where or 'run options'}: unknown option(s) {', '.join(unknown)}{hint}; {valid}")
    hints = get_type_hints(cls)
    examples = {key: None if f.default is dataclasses.MISSING else f.default for key, f in fields.items()}
    typed = {}
    for key, value in values.items():
        option = f"{where}.{key}" if where else key
        check_length(value, fields[key].metadata.get(BOUND), option)
        typed[key] = check_value(value, hints[key], option, examples[key])
        check_bound(typed[key], fields[key].metadata.get(BOUND), option)
    return typed


def check_value(value: Any, hint: Any, option: str, example: Any = None) -> Any:
    """``value`` as the type ``hint`` describes, text parsed (``"0.1"`` -> 0.1); ``Any`` and unknown hints pass
    through. ConfigError: ``"<option> must be <kind>, got <value>; e.g. <option>=<example>"``."""
    try:
        return _convert(value, hint, option)
    except _Mismatch as exc:
        where, expected, given = exc.where or (option, hint, value)
        fix = f"; e.g. {option}={_render(example)}" if example is not None and where == option else ""
        raise ConfigError(f"{where} must be {describe_type(expected)}{exc.why}, got {_render(given)}{fix}") from None


class _Mismatch(Exception):
    """Internal: a value does not fit its hint; ``where`` = (option, hint, value) of the innermost misfit, ``why``
    what the type alone does not say (a bound)."""

    def __init__(self, where: tuple[str, Any, Any] | None = None, why: str = "") -> None:
        super().__init__()
        self.where, self.why = where, why


def _convert(value: Any, hint: Any, option: str) -> Any:
    """``value`` converted to ``hint``; a misfit is located at the innermost element that does not fit."""
    try:
        return _convert_here(value, hint, option)
    except _Mismatch as exc:
        exc.where = exc.where or (option, hint, value)
        raise


def _convert_here(value: Any, hint: Any, option: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any or hint is object or isinstance(hint, TypeVar):
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(value, hint, args, option)
    if origin is Literal:
        if value in args:
            return value
        raise _Mismatch
    if hint is bool:
        return _to_bool(value)
    if hint is int:
        return _to_int(value)
    if hint is float:
        return _to_float(value)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    if hint in (list, tuple) or origin in (list, tuple):
        return _to_sequence(value, hint, origin or hint, args, option)
    if hint is dict or origin is dict:
        return _to_dict(value, args, option)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        return from_dict(hint, _parsed_text(value, dict), option)
    if isinstance(hint, type) and not isinstance(value, hint):
        raise _Mismatch
    return value


def _convert_union(value: Any, hint: Any, args: tuple, option: str) -> Any:
    optional = type(None) in args
    if value is None and optional:
        return None
    if optional and isinstance(value, str) and value.strip().lower() in NONE_WORDS and str not in args:
        return None
    # Text matches str trivially: try the typed members first so "0.5" becomes a number where one is allowed.
    members = sorted((a for a in args if a is not type(None)), key=lambda a: a is str)
    why = ""
    for member in members:
        try:
            return _convert(value, member, option)
        except _Mismatch as exc:
            why = why or exc.why
    raise _Mismatch((option, hint, value), why)  # no member fits: the union, not its last member, is what failed


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise _Mismatch


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise _Mismatch  # True is an int to Python, never to a user
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise _Mismatch from None
    if not isinstance(value, int):
        raise _Mismatch
    if abs(value) >= MAX_WHOLE:  # beyond a float's exact integers: no option means such a number
        raise _Mismatch(why=" of magnitude below 2**53")
    return value


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise _Mismatch
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (ValueError, TypeError):
        raise _Mismatch from None
    except OverflowError:  # an integer beyond float's range
        raise _Mismatch(why=" within a float's range") from None
    if not math.isfinite(number):
        raise _Mismatch  # nan/inf learning rates and weights train nothing and poison aggregates
    return number


def _to_sequence(value: Any, hint: Any, container: type, args: tuple, option: str) -> Any:
    value = _parsed_text(value, list)
    if not isinstance(value, (list, tuple)):
        raise _Mismatch
    if container is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(args) != len(value):
            raise _Mismatch
        return tuple(_convert(v, a, f"{option}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    item = args[0] if args else Any
    items = [_convert(v, item, f"{option}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if container is tuple else items


def _to_dict(value: Any, args: tuple, option: str) -> dict:
    value = _parsed_text(value, dict)
    if not isinstance(value, dict):
        raise _Mismatch
    key_hint, value_hint = args if args else (Any, Any)
    return {_convert(k, key_hint, option): _convert(v, value_hint, f"{option}.{k}") for k, v in value.items()}


def _parsed_text(value: Any, container: type) -> Any:
    """Command-line text for a list/dict field is JSON (``[10, 100]``, ``{"site-2": {"batch_size": 16}}``)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            raise _Mismatch from None
        if isinstance(parsed, container):
            return parsed
        raise _Mismatch
    return value


def describe_type(hint: Any) -> str:
    """A type annotation in words, for error messages (``int | None`` -> ``an integer or null``)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        words = [describe_type(a) for a in args if a is not type(None)]
        return " or ".join(words + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + ", ".join(_render(a) for a in args)
    names = {bool: "true or false", int: "an integer", float: "a finite number", str: "text"}
    if hint in names:
        return names[hint]
    if hint in (list, tuple) or origin in (list, tuple):
        return "a JSON list" + (f" of {describe_type(args[0])}" if args and args[-1] is not Ellipsis else "")
    if hint is dict or origin is dict:
        return "a JSON object"
    return getattr(hint, "__name__", str(hint))


def _render(value: Any) -> str:
    """``value`` as a message shows it, cut to :data:`SHOWN_CHARACTERS` (a message stays one readable line)."""
    if isinstance(value, str):
        text = repr(value)
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = repr(value)
    if len(text) <= SHOWN_CHARACTERS:
        return text
    return f"{text[:SHOWN_CHARACTERS // 2]}... ({len(text)} characters)"


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or TOML run configuration (``readback.load_json``: one line for a file that is unreadable, not
    JSON/TOML, or nested deeper than any run option is; a TOML nested 5,000 deep gave a 3,002-line traceback)."""
    from medflare.readback import load_json

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file not found: {file}")
    loaded = load_json(file, ConfigError, where="config file ")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{file} must hold an object of run options, got {type(loaded).__name__}")
    return loaded


# ----- where an option came from (``medflare config``) ----------------------------------------------------
def layer_options(layer: Mapping[str, Any], sections: Collection[str]) -> set[str]:
    """The options one layer sets, as dotted names, as layers merge: None is not given, a section table names each
    of its keys, any other value (a section given whole, as JSON text) names itself."""
    names: set[str] = set()
    for key, value in layer.items():
        if value is None:
            continue
        if key in sections and isinstance(value, Mapping):
            names |= {f"{key}.{sub}" for sub in value}
        else:
            names.add(key)
    return names


def override_options(overrides: Sequence[str], prefixes: Mapping[str, str]) -> set[str]:
    """The options ``--set key=value`` items set, as dotted names; ``prefixes`` maps a --set prefix to its
    section (``method`` -> ``method_args``). Malformed items are left to the code that applies them."""
    names: set[str] = set()
    for item in overrides:
        section, dot, sub = item.partition("=")[0].partition(".")
        names.add(f"{prefixes.get(section, section)}.{sub}" if dot else section)
    return names


def option_source(option: str, layers: Sequence[tuple[str, set[str]]]) -> str | None:
    """The name of the last layer (lowest first) that set ``option`` or its whole section; None if none did."""
    section = option.partition(".")[0]
    for name, options in reversed(layers):
        if option in options or (section != option and section in options):
            return name
    return None


def parse_value(text: str) -> Any:
    """Untyped override text: JSON when it parses, else the text itself (typed fields: :func:`check_value`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
