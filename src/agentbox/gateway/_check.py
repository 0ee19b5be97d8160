"""Hand validation of plain data (TOML, YAML, JSON) for the gateway's own models.

The gateway process holds the model registry entry, the usage totals and the
replay script; validating them with pydantic cost ~7 MiB of private memory per
task, so they are frozen dataclasses checked here instead. The rules
are pydantic's lax mode where a value converts losslessly (an integral float or
a numeric string for an int, ``"yes"``/``1`` for a bool, a list for a tuple), and
the messages are the ones the registry printed before (``must be a string, not
5``, ``Input should be greater than or equal to 0``).

A checker takes ``(value, key, errors)``, appends ``(key, what)`` for each thing
wrong and returns the converted value (meaningless when it appended an error).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from agentbox.errors import InvalidValue

#: ``(key, what is wrong)`` pairs, in the order found.
Errors = list[tuple[str, str]]
Checker = Callable[[Any, str, Errors], Any]

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


#: What is wrong with a value, as ``key: what`` pairs (rooted in the error tree).
Invalid = InvalidValue


def _not_a(kind: str, value: Any) -> str:
    return f"must be a {kind}, not {value!r:.60}"


def text(value: Any, key: str, errors: Errors) -> Any:
    """A ``str``."""
    if not isinstance(value, str):
        errors.append((key, _not_a("string", value)))
    return value


def boolean(value: Any, key: str, errors: Errors) -> Any:
    """A ``bool``; also ``0``/``1`` and the words ``true``/``false``, ``yes``/``no`` …"""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    errors.append((key, _not_a("bool", value)))
    return value


def integer(value: Any, key: str, errors: Errors, *, ge: int | None = None) -> Any:
    """An ``int``; also an integral float or a decimal string. ``ge``: the least allowed."""
    out: Any = value
    if isinstance(value, bool):
        out = int(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            errors.append((key, "Input should be a finite number"))
            return value
        if not value.is_integer():
            errors.append(
                (key, "Input should be a valid integer, got a number with a fractional part")
            )
            return value
        out = int(value)
    elif isinstance(value, str):
        try:
            out = int(value.strip())
        except ValueError:
            errors.append((key, _not_a("int", value)))
            return value
    elif not isinstance(value, int):
        errors.append((key, _not_a("int", value)))
        return value
    if ge is not None and out < ge:
        errors.append((key, f"Input should be greater than or equal to {ge}"))
    return out


def number(
    value: Any, key: str, errors: Errors, *, ge: float | None = None, le: float | None = None
) -> Any:
    """A ``float``; also an int or a numeric string. ``ge``/``le``: the bounds (NaN fails them)."""
    out: Any
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            errors.append((key, _not_a("float", value)))
            return value
    else:
        errors.append((key, _not_a("float", value)))
        return value
    if ge is not None and not out >= ge:
        errors.append((key, f"Input should be greater than or equal to {ge:g}"))
    elif le is not None and not out <= le:
        errors.append((key, f"Input should be less than or equal to {le:g}"))
    return out


def choice(*allowed: str) -> Checker:
    """One of the strings ``allowed``."""
    names = [repr(a) for a in allowed]
    expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"

    def check(value: Any, key: str, errors: Errors) -> Any:
        if not isinstance(value, str) or value not in allowed:
            errors.append((key, f"must be one of {expected}, not {value!r:.60}"))
        return value

    return check


def optional(inner: Checker) -> Checker:
    """``None``, or what ``inner`` accepts."""

    def check(value: Any, key: str, errors: Errors) -> Any:
        return None if value is None else inner(value, key, errors)

    return check


def _items(value: Any, key: str, errors: Errors, kind: str, item: Checker) -> list[Any] | None:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(
        value, (list, tuple, set, frozenset)
    ):
        errors.append((key, _not_a(kind, value)))
        return None
    return [item(v, f"{key}.{i}", errors) for i, v in enumerate(value)]


def tuple_of(item: Checker) -> Checker:
    """A list or tuple (converted to a tuple) of what ``item`` accepts."""

    def check(value: Any, key: str, errors: Errors) -> Any:
        out = _items(value, key, errors, "tuple", item)
        return value if out is None else tuple(out)

    return check


def sequence_of(item: Checker) -> Checker:
    """A list or tuple (converted to a list) of what ``item`` accepts."""

    def check(value: Any, key: str, errors: Errors) -> Any:
        out = _items(value, key, errors, "list", item)
        return value if out is None else out

    return check


def mapping_of(item: Checker) -> Checker:
    """A mapping with string keys (converted to a dict) of what ``item`` accepts."""

    def check(value: Any, key: str, errors: Errors) -> Any:
        if not isinstance(value, Mapping):
            errors.append((key, _not_a("dictionary", value)))
            return value
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                errors.append((f"{key}.{k!r:.40}", "keys must be strings"))
                continue
            out[k] = item(v, f"{key}.{k}", errors)
        return out

    return check


def fields(
    raw: Any,
    spec: Iterable[tuple[str, Checker | None, Any]],
    errors: Errors,
    *,
    prefix: str = "",
    extra: str | None = "is not a key {what} has (check its spelling)",
    what: str = "an entry",
) -> dict[str, Any]:
    """Check a mapping against ``spec`` (``(key, checker, default)``; a default of ``...``:
    required; checker None: taken as is) and return the converted values, defaults filled.

    Errors are found in ``spec``'s order, then keys ``spec`` lacks (``extra``: their
    message, None to ignore them), each key prefixed with ``prefix``.
    """
    out: dict[str, Any] = {}
    if not isinstance(raw, Mapping):
        errors.append((prefix.rstrip(".") or "(entry)", _not_a("dictionary", raw)))
        return out
    known = set()
    for key, check, default in spec:
        known.add(key)
        if key not in raw:
            if default is ...:
                errors.append((prefix + key, "is required"))
            else:
                out[key] = default() if callable(default) else default
            continue
        value = raw[key]
        out[key] = value if check is None else check(value, prefix + key, errors)
    if extra is not None:
        for key in raw:
            if key not in known:
                errors.append((f"{prefix}{key}", extra.format(what=what)))
    return out
