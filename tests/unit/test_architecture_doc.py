"""docs/explanation/architecture.md stays true: every package, module, name and file it
mentions exists.

Names are read from the page's code spans: ``agentbox.x``, ``x._y`` or ``x.name``
where ``x`` is a package or module of agentbox (resolved by import, then by
attribute), and paths under ``src/``, ``tests/`` and ``docs/``.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "explanation" / "architecture.md"
SRC = ROOT / "src" / "agentbox"
TOP = {p.stem for p in SRC.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}


def _spans() -> list[str]:
    return re.findall(r"`([^`\n]+)`", DOC.read_text())


def _dotted() -> list[str]:
    names = []
    for span in _spans():
        name = span.removeprefix("agentbox.")
        if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*", name):
            continue
        if name.rsplit(".", 1)[-1] in ("py", "sock", "md", "toml", "db"):
            continue  # a file name (errors.py, launcher.sock), checked as a path below
        if name.split(".")[0] in TOP:
            names.append("agentbox." + name)
    return names


def _resolves(dotted: str) -> bool:
    try:
        importlib.import_module(dotted)
        return True
    except ModuleNotFoundError:
        pass
    parent, _, attr = dotted.rpartition(".")
    try:
        return hasattr(importlib.import_module(parent), attr)
    except ModuleNotFoundError:
        return False


def test_the_page_names_many_things() -> None:
    """Positive control: the extraction finds the packages of the component table."""
    names = set(_dotted())
    pkgs = ("cli", "launcher", "backends", "gateway", "collect", "mcp", "backends.microvm", "guest")
    for pkg in pkgs:
        assert f"agentbox.{pkg}" in names, pkg
    assert len(names) > 30


@pytest.mark.parametrize("dotted", sorted(set(_dotted())))
def test_every_named_package_module_or_name_exists(dotted: str) -> None:
    assert _resolves(dotted), f"architecture.md names {dotted}, which does not exist"


def test_every_named_file_exists() -> None:
    text = DOC.read_text()
    paths = set(re.findall(r"(?<![\w/])((?:src|tests|docs)/[\w./<>-]+\.(?:py|md))", text))
    paths |= {
        str((DOC.parent / p).resolve().relative_to(ROOT))
        for p in re.findall(r"\]\((\.\./[^)#]+)\)", text)
    }
    missing = [p for p in sorted(paths) if "<" not in p and not (ROOT / p).exists()]
    assert not missing, missing
    assert any(p.startswith("src/agentbox/backends") for p in paths)


def test_every_verb_of_the_protocol_is_on_the_page() -> None:
    from agentbox.backends.base import Backend, Sandbox

    text = DOC.read_text()
    for proto in (Backend, Sandbox):
        for name in vars(proto):
            if not name.startswith("_") and callable(getattr(proto, name)):
                assert f"`{name}`" in text or f"{name}`" in text, f"{proto.__name__}.{name}"
