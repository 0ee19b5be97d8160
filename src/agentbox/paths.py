"""Paths derived from validated ids, and checks that a path stays inside its root.

Clients name a task; they never name a path. Every path the launcher touches is
derived here from the task id and checked to resolve inside the data dir.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from agentbox.errors import PathRefused, TaskIdRefused

__all__ = ["TASK_ID_RE", "TaskPaths", "check_inside", "new_task_id", "validate_task_id"]

TASK_ID_RE = re.compile(r"[0-9a-z-]{1,64}")


def validate_task_id(task_id: object) -> str:
    """Return ``task_id`` if it matches ``^[0-9a-z-]{1,64}$``, else raise TaskIdRefused."""
    if not isinstance(task_id, str) or not TASK_ID_RE.fullmatch(task_id):
        raise TaskIdRefused(f"task id must match ^[0-9a-z-]{{1,64}}$, got {task_id!r:.80}")
    return task_id


def new_task_id() -> str:
    """A fresh random task id (``t-`` + 12 hex digits)."""
    return f"t-{secrets.token_hex(6)}"


def check_inside(root: Path, path: Path, *, what: str = "path") -> Path:
    """Resolve ``path`` (following links) and require it inside ``root``; return it.

    Resolving first means a symlink that points out of ``root`` is refused, not
    followed later.
    """
    real_root = root.resolve()
    real = path.resolve()
    if real != real_root and real_root not in real.parents:
        raise PathRefused(f"{what} resolves outside {real_root}", path=path)
    return real


@dataclass(frozen=True)
class TaskPaths:
    """Every path of one task, derived from its id under ``data_dir/tasks/<id>``."""

    data_dir: Path
    task_id: str

    def __post_init__(self) -> None:
        validate_task_id(self.task_id)

    @property
    def root(self) -> Path:
        return check_inside(self.data_dir, self.data_dir / "tasks" / self.task_id, what="task dir")

    @property
    def workspace(self) -> Path:
        """The agent's copy of the repo, owned by the sandbox identity."""
        return self.root / "workspace"

    @property
    def gateway_dir(self) -> Path:
        """Holds the gateway's unix socket; the only other mount of the sandbox."""
        return self.root / "gw"

    @property
    def gateway_socket(self) -> Path:
        return self.gateway_dir / "gateway.sock"

    @property
    def shadow_git(self) -> Path:
        """The trusted git dir collection uses; never the agent's ``.git``."""
        return self.root / "shadow.git"

    @property
    def base_index(self) -> Path:
        """The index saved when the workspace was made (a trusted moment)."""
        return self.root / "base.index"

    @property
    def usage_file(self) -> Path:
        return self.root / "usage.json"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    @property
    def report_file(self) -> Path:
        return self.root / "report.json"
