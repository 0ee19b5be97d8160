"""Paths derived from validated ids, and checks that a path stays inside its root.

Clients name a task; they never name a path. Every path the launcher touches is
derived here from the task id and checked to resolve inside the data dir.
"""

from __future__ import annotations

import contextlib
import grp
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from agentbox.errors import PathRefused, TaskIdRefused

__all__ = [
    "DATA_DIR_GROUP",
    "TASK_ID_RE",
    "TaskPaths",
    "check_inside",
    "new_task_id",
    "private_data_dir",
    "validate_task_id",
]

#: The group whose members (the users who delegate, the MCP server) may search the data
#: dir: to the launcher's socket directory (``run/``, ``root:agentbox 0750``) and the
#: shadow git dirs of their tasks; nothing in it is listed or read through that alone.
DATA_DIR_GROUP = "agentbox"

TASK_ID_RE = re.compile(r"[0-9a-z-]{1,64}")


def validate_task_id(task_id: object) -> str:
    """Return ``task_id`` if it matches ``^[0-9a-z-]{1,64}$``, else raise TaskIdRefused."""
    if not isinstance(task_id, str) or not TASK_ID_RE.fullmatch(task_id):
        raise TaskIdRefused(f"task id must match ^[0-9a-z-]{{1,64}}$, got {task_id!r:.80}")
    return task_id


def private_data_dir(data_dir: Path) -> Path:
    """Make ``data_dir`` (if missing) and close it: ``root:agentbox 0710`` when run as
    root and the group exists, else ``0700``; return it.

    Every task's text, repo path, token and workspace lives below it (the state db and
    its log, the warm pool's slots, the task dirs): a local user outside the group
    reaches none of it, whatever mode a file below was born with. A data
    dir that is not ours (another user's, or root's for a non-root caller) is left as it
    is; a link in its place is not followed.
    """
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = data_dir.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return data_dir
    gid = None
    if os.geteuid() == 0:
        with contextlib.suppress(KeyError):
            gid = grp.getgrnam(DATA_DIR_GROUP).gr_gid
    if gid is not None and st.st_gid != gid:
        os.chown(data_dir, -1, gid, follow_symlinks=False)
    want = 0o710 if gid is not None else 0o700
    # Bits granted on purpose (an ACL's mask, runsc's gofer) live in the ACL, not here.
    if stat.S_IMODE(st.st_mode) & 0o7777 != want:
        data_dir.chmod(want)
    return data_dir


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
