"""pydantic's validation errors in the words of what the user typed.

A value given on the command line is checked by a pydantic model (``TaskRequest``
for ``agentbox run``), whose message names the model's field and speaks pydantic
("deadline: Input should be greater than or equal to 10"). :func:`flag_message`
names the flag and the unit instead ("--deadline must be at least 10 seconds, got 5"),
for any field and any of pydantic's range, length, choice and type errors.

For a key a table does not know (a Boxfile's), :func:`nearest_key` finds the known
key it most likely meant ("did you mean").
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

__all__ = ["TASK_FLAGS", "described", "flag_message", "known_keys", "nearest_key"]

#: ``TaskRequest`` field → (the flag or argument that sets it, the unit of its number).
TASK_FLAGS: dict[str, tuple[str, str]] = {
    "repo": ("--repo", ""),
    "task": ("TASK", ""),
    "model": ("--model", ""),
    "budget": ("--budget", "tokens"),
    "deadline": ("--deadline", "seconds"),
    "task_id": ("--id", ""),
    "continue_from": ("the previous task's id", ""),
}

_BOUNDS = {
    "greater_than_equal": ("ge", "at least"),
    "greater_than": ("gt", "more than"),
    "less_than_equal": ("le", "at most"),
    "less_than": ("lt", "less than"),
}
_TYPES = {
    "int_parsing": "a whole number",
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "text",
    "finite_number": "a finite number",
}


def _num(v: object) -> str:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _got(v: object) -> str:
    if isinstance(v, str):
        return f", got {v[:40]!r}" + ("…" if len(v) > 40 else "")
    if isinstance(v, bool | int | float):
        return f", got {_num(v)}"
    return ""


def described(name: str, err: Mapping[str, Any], unit: str = "") -> str:
    """One pydantic error about ``name`` as a sentence: ``--deadline must be at least
    10 seconds, got 5``; an error type without words of its own keeps pydantic's message."""
    kind = str(err.get("type", ""))
    ctx: Mapping[str, Any] = err.get("ctx") or {}
    value = err.get("input")
    if kind in _BOUNDS and _BOUNDS[kind][0] in ctx:
        key, words = _BOUNDS[kind]
        bound = ctx[key]
        units = f" {unit.removesuffix('s') if bound == 1 else unit}" if unit else ""
        return f"{name} must be {words} {_num(bound)}{units}{_got(value)}"
    if kind in ("string_too_short", "too_short") and ctx.get("min_length") == 1:
        return f"{name} must not be empty"
    if kind in ("string_too_short", "string_too_long", "too_short", "too_long"):
        words = "at least" if kind.endswith("short") else "at most"
        n = ctx.get("min_length" if kind.endswith("short") else "max_length")
        what = "characters" if kind.startswith("string") else "items"
        return f"{name} must be {words} {_num(n)} {what}"
    if kind == "string_pattern_mismatch":
        return f"{name} must match {ctx.get('pattern')}{_got(value)}"
    if kind in ("literal_error", "enum"):
        return f"{name} must be {ctx.get('expected')}{_got(value)}"
    if kind in _TYPES:
        return f"{name} must be {_TYPES[kind]}{_got(value)}"
    if kind == "missing":
        return f"{name} is required"
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{name}: {msg}"


def flag_message(exc: ValidationError, flags: Mapping[str, tuple[str, str]] = TASK_FLAGS) -> str:
    """Every error of ``exc`` in the words of the flags that set its fields ("; " between)."""
    out = []
    for err in exc.errors():
        loc = err["loc"]
        field = str(loc[0]) if loc else ""
        flag, unit = flags.get(field, (field.replace("_", "-") or "the value", ""))
        out.append(described(flag, err, unit))
    return "; ".join(out)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (``X | None``, ``tuple[X, ...]`` …)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is not None:
        for arg in typing.get_args(annotation):
            found += _models_in(arg)
    return found


def known_keys(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """The keys the table at ``loc`` (the path of a key in it, without the key) knows."""
    models = [model]
    for part in loc:
        if isinstance(part, int):
            continue  # an item of an array of tables: the same model
        nxt: list[type[BaseModel]] = []
        for m in models:
            info = m.model_fields.get(part)
            if info is not None:
                nxt += _models_in(info.annotation)
        models = nxt
    return sorted({k for m in models for k in m.model_fields})


def nearest_key(
    model: type[BaseModel], loc: Sequence[int | str], *, hidden: frozenset[str] = frozenset()
) -> str | None:
    """The key its table knows that the unknown key at ``loc`` (its path) most likely
    meant (``netwrok`` → ``network``), by :func:`difflib.get_close_matches`; None when
    none is near. ``hidden``: keys never suggested."""
    if not loc or isinstance(loc[-1], int):
        return None
    known = [k for k in known_keys(model, loc[:-1]) if k not in hidden]
    near = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    return near[0] if near else None
