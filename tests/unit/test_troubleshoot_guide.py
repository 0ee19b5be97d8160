"""docs/how-to/troubleshoot.md has an entry (a ``### ClassName`` heading with text under
it) for every class of the error tree, and no entry for a class that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

from agentbox import errors

GUIDE = Path(__file__).parents[2] / "docs" / "how-to" / "troubleshoot.md"


def _tree() -> set[str]:
    return {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and (issubclass(obj, errors.AgentboxError) or obj is errors.AgentboxTimeout)
    }


def _entries(text: str) -> dict[str, str]:
    parts = re.split(r"^### (\w+)\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_every_error_class_has_an_entry() -> None:
    entries = _entries(GUIDE.read_text(encoding="utf-8"))
    missing = sorted(_tree() - set(entries))
    assert not missing, f"add an entry to {GUIDE.name} for: {', '.join(missing)}"
    thin = sorted(name for name in _tree() if len(entries[name].split()) < 12)
    assert not thin, f"entries with no cause or fix: {thin}"


def test_no_entry_for_a_class_that_is_gone() -> None:
    stale = sorted(set(_entries(GUIDE.read_text(encoding="utf-8"))) - _tree())
    assert not stale, f"{GUIDE.name} documents classes the tree no longer has: {stale}"


def test_the_tree_is_found() -> None:
    assert {"AgentboxError", "AgentboxTimeout", "PolicyRefused", "TaskNotFound"} <= _tree()
