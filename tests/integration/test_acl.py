"""The named-user ACL that lets runsc's gofer (and only it) through private task dirs:
written as the kernel's xattr, checked by the kernel for real processes (setpriv)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.backends.oci._args import _searchable_by
from agentbox.linux.acl import acl_allows, grant_search

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other uids")

GOFER = 100000


@pytest.fixture
def top() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="agentbox-acl-", dir="/var/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path)


def _can_stat(uid: int, path: Path) -> bool:
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "stat", str(path)]
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


def test_only_the_named_uid_gets_through(top: Path) -> None:
    tasks = top / "tasks"
    root = tasks / "t-1"
    ws = root / "workspace"
    ws.mkdir(parents=True)
    tasks.chmod(0o710)
    root.chmod(0o700)
    os.chown(ws, GOFER + 64000, GOFER + 64000)
    # Control: nobody but root gets through before the grant.
    assert not _can_stat(GOFER, ws)
    assert _searchable_by(ws, GOFER) == tasks
    for d in (tasks, root):
        grant_search(d, GOFER)
    assert _can_stat(GOFER, ws) and _searchable_by(ws, GOFER) is None
    assert not _can_stat(GOFER + 1, ws) and not _can_stat(65534, ws)
    assert acl_allows(root, GOFER, 1) and not acl_allows(root, GOFER, 4)  # search, not list
    # The mode's bits for owner and others are unchanged; the group's get no more than x.
    assert tasks.stat().st_mode & 0o777 == 0o710 and root.stat().st_mode & 0o707 == 0o700
    grant_search(root, GOFER)  # idempotent
    assert _can_stat(GOFER, ws)
