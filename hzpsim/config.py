"""Typed, frozen configuration objects built from plain mappings, with errors that name the key path.

Everything the user gives (YAML files, ``--set a.b=c`` overrides, notebook dictionaries) enters
through :func:`from_mapping`. It coerces by the declared field type (PyYAML reads ``450e9`` as a
string, so numbers given as strings are accepted for numeric fields), rejects unknown keys, and
calls the object's own ``validate()`` for cross-field rules. Deeper code trusts what it gets.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


_LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


class ScenarioError(ValueError):
    """Invalid user input. The message says what is wrong and where (a key path).

    The message is always one line (the CLI prints it as ``hzpsim: error: ...``): line breaks
    that arrive from user text (a key, a preset name, a ``--set`` string) are escaped.
    """

    def __init__(self, message: object = "") -> None:
        text = str(message)
        if any(ch in _LINE_BREAKS for ch in text):
            text = "".join(repr(ch)[1:-1] if ch in _LINE_BREAKS else ch for ch in text)
        super().__init__(text)


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


#: Largest whole number an int field accepts: every integer up to it is exact as a float, so
#: ``450e9`` and ``450000000000`` mean the same; larger counts describe no real training run.
_MAX_INT = 2**53


def _as_number(value: Any, path: str) -> float:
    if isinstance(value, bool):
        raise ScenarioError(f"{path}: expected a number, got {_describe(value)}")
    try:
        if isinstance(value, int | float):
            number = float(value)
        elif isinstance(value, str):
            number = float(value.strip().replace("_", ""))
        else:
            raise ScenarioError(f"{path}: expected a number, got {_describe(value)}")
    except ValueError:
        raise ScenarioError(f"{path}: expected a number, got {_describe(value)}") from None
    except OverflowError:  # an integer beyond float range
        raise ScenarioError(f"{path}: {_describe(value)} is out of range") from None
    if not math.isfinite(number):
        raise ScenarioError(f"{path}: expected a finite number, got {_describe(value)}")
    return number


def coerce(tp: Any, value: Any, path: str) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise ScenarioError naming ``path``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ScenarioError(f"{path}: a value is required")
        errors, shaped = [], []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(option, value, path)
            except ScenarioError as exc:
                errors.append(str(exc))
                if (isinstance(value, Mapping) and dataclasses.is_dataclass(option)) or (
                        isinstance(value, str) and get_origin(option) is Literal):
                    shaped.append(str(exc))  # the value's shape says which option was meant
        if len(errors) > 1 and len(shaped) == 1:
            raise ScenarioError(shaped[0])
        raise ScenarioError(errors[0] if len(errors) == 1 else f"{path}: invalid value {_describe(value)}")
    if origin is Literal:
        allowed = get_args(tp)
        for choice in allowed:
            if value == choice and type(value) is type(choice):
                return choice
        if isinstance(value, str):
            for choice in allowed:
                if isinstance(choice, str) and value.strip().lower() == choice:
                    return choice
        if not isinstance(value, bool) and any(
            isinstance(c, int) and not isinstance(c, bool) for c in allowed
        ):
            # numeric choices (``stage: 1 | 2 | 3``) accept "3", 3.0 and "3e0", as int fields do
            try:
                number = _as_number(value, path)
            except ScenarioError:
                number = None
            for choice in allowed:
                if isinstance(choice, int) and not isinstance(choice, bool) and number == choice:
                    return choice
        shown = ", ".join(str(a) for a in allowed)
        raise ScenarioError(f"{path}: {_describe(value)} is not one of: {shown}")
    if origin in (tuple, list):
        (item_type, *rest) = get_args(tp) or (Any,)
        if not isinstance(value, list | tuple):
            raise ScenarioError(f"{path}: expected a list, got {_describe(value)}")
        return tuple(coerce(item_type, v, _join(path, i)) for i, v in enumerate(value))
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ScenarioError(f"{path}: expected true or false, got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= _MAX_INT:
            return value
        number = _as_number(value, path)
        if abs(number) > _MAX_INT:
            raise ScenarioError(f"{path}: {_describe(value)} is out of range (at most 2**53)")
        if number != int(number):
            raise ScenarioError(f"{path}: expected a whole number, got {_describe(value)}")
        return int(number)
    if tp is float:
        return _as_number(value, path)
    if tp is str:
        if isinstance(value, str) and value.strip():
            return value.strip()
        raise ScenarioError(f"{path}: expected a non-empty string, got {_describe(value)}")
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, path)  # type: ignore[arg-type]
    raise TypeError(f"unsupported config field type {tp!r} at {path}")  # internal: a config class bug


def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of each dataclass field of ``cls``."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def key_of(f: dataclasses.Field) -> str:
    """The scenario key of a field: its name, or ``metadata["key"]`` when the key is not a
    Python identifier (AsyncHZP's ``async``)."""
    return f.metadata.get("key", f.name)


def from_mapping(cls: type[T], data: Any, path: str = "") -> T:
    """Build the frozen dataclass ``cls`` from a mapping, coercing and validating every field."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{path or 'scenario'}: expected a mapping, got {_describe(data)}")
    types_by_name = field_types(cls)
    keys = {key_of(f): f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # YAML key -> field
    unknown = [k for k in data if k not in keys]
    if unknown:
        known = ", ".join(sorted(keys))
        raise ScenarioError(f"{_join(path, str(unknown[0]))}: unknown key (allowed: {known})")
    kwargs: dict[str, Any] = {}
    for key, f in keys.items():
        if key in data:
            kwargs[f.name] = coerce(types_by_name[f.name], data[key], _join(path, key))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ScenarioError(f"{_join(path, key)}: required key is missing")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ScenarioError:
            raise
        except ValueError as exc:
            raise ScenarioError(f"{path}.{exc}" if path else str(exc)) from None
    return obj


def to_mapping(obj: Any) -> Any:
    """The plain-data form of a config object (for JSON output and ``strategy_resolved``)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # a field marked ``omit_if_none`` is left out while unset (an optional feature added
        # after the outputs that leave it off were recorded: strategy.grad_compression)
        return {key_of(f): to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("omit_if_none") and getattr(obj, f.name) is None)}
    if isinstance(obj, tuple | list):
        return [to_mapping(v) for v in obj]
    return obj
