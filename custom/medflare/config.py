"""Typed configuration: dataclasses built from plain dicts, every field checked against its annotation (one
checker for every config dataclass). Text (``--set key=value``) is parsed by the annotation, so ``--set
train.lr=abc`` fails here, with one line naming the option, and never reaches a site.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from medflare.errors import ConfigError

T = TypeVar("T")
TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
NONE_WORDS = ("none", "null")
MAX_WHOLE = 2**53  # whole numbers at or beyond it are refused: a float holds no larger integer exactly
SHOWN_CHARACTERS = 80  # of a refused value in a message
MAX_IMAGE_SIZE = 4096  # px: a task's or a data config's image size (every image is resized to it)


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
        raise ConfigError(f"{owner or where or 'run options'}: unknown option(s) {', '.join(unknown)}; {valid}")
    hints = get_type_hints(cls)
    examples = {key: None if f.default is dataclasses.MISSING else f.default for key, f in fields.items()}
    return {key: check_value(value, hints[key], f"{where}.{key}" if where else key, examples[key])
            for key, value in values.items()}


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
