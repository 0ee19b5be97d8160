"""Every exception class agentbox defines is rooted in errors.py and drawn in its docstring.

The walk imports *every* module of the package (``pkgutil.walk_packages``), not
only what ``errors.__all__`` lists, so an exception class added anywhere outside
the tree fails here. Exempt: private control-flow classes (``_Name``) that never
leave their module, and :mod:`agentbox.guest`, which runs inside the sandbox on
the bare standard library, the front end's client and wire (:mod:`agentbox.front`),
which every ``agentbox`` command imports first on the bare standard library
(``errors.py`` and its pathlib would cost each command 26 ms), and
:class:`agentbox.cli.reap.Terminated`, a ``KeyboardInterrupt`` (a signal, not an error).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import agentbox
from agentbox import errors
from agentbox.errors import (
    AgentboxError,
    AgentboxTimeout,
    CollectError,
    ConfigError,
    SandboxError,
    map_exceptions,
)


def _modules() -> list[str]:
    names = [agentbox.__name__]
    for info in pkgutil.walk_packages(agentbox.__path__, prefix="agentbox."):
        if info.name.endswith("__main__"):
            continue  # running it is its import
        names.append(info.name)
    return names


def _exception_classes() -> list[tuple[str, type[BaseException]]]:
    found = []
    for name in _modules():
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == name
                and attr == obj.__name__
            ):
                found.append((name, obj))
    return found


def test_the_walk_reaches_every_package() -> None:
    mods = _modules()
    for pkg in ("backends", "gateway", "launcher", "collect", "backends.microvm", "mcp", "escape"):
        assert any(m.startswith(f"agentbox.{pkg}.") for m in mods), pkg
    assert len(mods) > 100


def test_every_exception_is_rooted_in_agentbox_error() -> None:
    unrooted = [
        f"{mod}.{cls.__name__}"
        for mod, cls in _exception_classes()
        if issubclass(cls, Exception)  # Terminated is a KeyboardInterrupt: a signal
        and not issubclass(cls, AgentboxError)
        and not cls.__name__.startswith("_")
        and not mod.startswith("agentbox.guest")
        and mod not in ("agentbox.front.client", "agentbox.front._wire")
    ]
    assert not unrooted, f"exceptions outside the tree: {unrooted}"


def test_every_public_error_is_defined_in_errors_and_drawn() -> None:
    drawing = errors.__doc__ or ""
    for mod, cls in _exception_classes():
        if not issubclass(cls, AgentboxError) or cls.__name__.startswith("_"):
            continue
        assert mod == "agentbox.errors", f"{mod}.{cls.__name__}: define it in errors.py"
        assert re.search(rf"\b{cls.__name__}\b", drawing), f"{cls.__name__} not drawn"
    for name in errors.__all__:
        assert re.search(rf"\b{name}\b", drawing), f"{name} not drawn"


def test_timeouts_share_one_base() -> None:
    for name in ("CommandTimeout", "GuestTimeout", "UpstreamTimeout"):
        assert issubclass(getattr(errors, name), AgentboxTimeout), name


def test_component_errors_carry_their_fields() -> None:
    assert SandboxError("gone", sandbox="sb").sandbox == "sb"
    assert errors.BoxfileError("bad", key="k").key == "k"


def test_every_error_field_is_set_by_a_caller() -> None:
    """A context field (a keyword-only ``__init__`` argument) that no raise in the source
    sets is always None: it promises context no handler gets. Set it or remove it."""
    import ast

    classes = {
        n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, Exception)
    }
    set_by: dict[str, set[str]] = {n: set() for n in classes}
    called = re.compile(r"\b(" + "|".join(classes) + r")\(")
    for path in Path(errors.__file__).parent.rglob("*.py"):
        text = path.read_text()
        if not called.search(text):
            continue  # makes none of them (parsing every module takes seconds)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if name in set_by:
                    set_by[name] |= {k.arg for k in node.keywords if k.arg}
    unset = []
    for name, cls in classes.items():
        params = inspect.signature(cls.__init__).parameters.values()
        fields = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
        subs = [n for n, c in classes.items() if issubclass(c, cls)]
        used = set().union(*(set_by[n] for n in subs))
        unset += [f"{name}.{f}" for f in sorted(fields - used)]
    assert unset == [], f"error fields no caller sets: {unset}"


def test_gateway_errors_live_in_the_error_tree_and_keep_their_behaviour() -> None:
    """The gateway's failures are classes of :mod:`agentbox.errors`, imported from there
    (no gateway module passes them on)."""
    for cls in (errors.UpstreamTimeout, errors.Refusal, errors.BodyTooLarge):
        assert cls.__module__ == "agentbox.errors"
    assert errors.Refusal("budget_exhausted", "no").reason == "budget_exhausted"
    assert issubclass(errors.PolicyViolation, ValueError)  # callers catch ValueError


def test_map_exceptions_translates_at_the_boundary() -> None:
    with (
        pytest.raises(SandboxError, match="reading x: boom") as info,
        map_exceptions({OSError: SandboxError}, what="reading x"),
    ):
        raise OSError("boom")
    assert isinstance(info.value.__cause__, OSError)


def test_map_exceptions_first_match_wins_and_ours_pass_through() -> None:
    table = {FileNotFoundError: ConfigError, OSError: SandboxError}
    with pytest.raises(ConfigError), map_exceptions(table):
        raise FileNotFoundError("nope")
    with pytest.raises(CollectError), map_exceptions(table):
        raise CollectError("already ours")
    with pytest.raises(KeyError), map_exceptions(table):
        raise KeyError("not mapped: unchanged")
