"""A best-of-N group's shared budget (``--budget-split shared``): one file, N gateways.

The launcher makes ``<data dir>/groups/<group>/budget.json`` (root, 0600) when the
group is submitted, gives every attempt the group's whole budget, and links the
file into each attempt's gateway state directory before the gateway starts; the
gateway opens it before it drops its privileges and charges it under ``flock``
(:class:`agentbox.gateway._budget.GroupShare`), so the attempts together never
spend more than the group's budget. Without the file, an attempt's budget is its
split share (``budget // N``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.errors import RefusedError
from agentbox.gateway import GROUP_BUDGET_FILE, gateway_identity
from agentbox.launcher._workspace import ensure_private_dir

BudgetSplit = Literal["split", "shared"]
BUDGET_SPLITS: tuple[str, ...] = ("split", "shared")


def budget_file(data_dir: Path, group: str) -> Path:
    """Where the shared budget file of ``group`` lives."""
    TaskPaths(data_dir, group)  # the same id rules as a task's
    return data_dir / "groups" / group / "budget.json"


def check_split(split: str) -> BudgetSplit:
    if split not in BUDGET_SPLITS:
        raise RefusedError(f"--budget-split must be split or shared, not {split!r}")
    return "shared" if split == "shared" else "split"


def make_budget_file(settings: Settings, group: str, budget: int, budget_usd: float | None) -> Path:
    """Create the group's shared budget file (a stale one of a group refused or pruned
    before is replaced: the store, not this file, says which group ids are taken)."""
    path = budget_file(settings.data_dir, group)
    ensure_private_dir(path.parent.parent, 0o700)
    ensure_private_dir(path.parent, 0o700)
    doc: dict[str, object] = {"budget": budget, "budget_usd": budget_usd, "slots": {}}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(doc).encode())
    finally:
        os.close(fd)
    return path


def is_shared(settings: Settings, group: str | None) -> bool:
    """Whether ``group`` (None: a lone task) shares one budget."""
    return group is not None and budget_file(settings.data_dir, group).is_file()


def link_for_gateway(settings: Settings, paths: TaskPaths, group: str | None) -> bool:
    """Link the group's shared budget file into the attempt's gateway state directory
    (before the gateway starts); False for a lone task or a split group."""
    if not is_shared(settings, group):
        return False
    assert group is not None
    if gateway_identity(settings) is not None:
        # spawn_gateway's state dir (``usage.json.d``): made here first, chowned there.
        state = paths.usage_file.with_name(paths.usage_file.name + ".d")
        ensure_private_dir(state, 0o700)
    else:
        state = paths.usage_file.parent
    os.link(budget_file(settings.data_dir, group), state / GROUP_BUDGET_FILE,
            follow_symlinks=False)  # fmt: skip
    return True


def group_spent(settings: Settings, group: str) -> float | None:
    """The tokens the group's attempts have charged together (None: not shared)."""
    try:
        doc = json.loads(budget_file(settings.data_dir, group).read_text())
    except (OSError, ValueError):
        return None
    slots = doc.get("slots") if isinstance(doc, dict) else None
    if not isinstance(slots, dict):
        return None
    return sum(float(v[0]) for v in slots.values() if isinstance(v, list) and v)
