"""Host-side binds that carry ``nosuid,nodev`` (and ``ro``/``noexec``) into a container.

The Engine's bind mounts take no such options (only ``ro`` and propagation): a bind
keeps the flags of the mount its source lives on, and a workspace or gateway dir on
the host's root filesystem has neither ``nosuid`` nor ``nodev``. So each source is
first bound, non-recursively, to a private point under
``<data_dir>/docker-binds/<sandbox>/`` and remounted there with the flags; the
container binds *that* mount (``NonRecursive``), whose flags the kernel then locks
in the container's user namespace. The points are unmounted and removed after the
container; :func:`sweep` does it for sandboxes that no longer exist.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, SandboxError
from agentbox.linux.acl import grant_search

log = get_logger(__name__)


def binds_root(settings: Settings) -> Path:
    return settings.data_dir / "docker-binds"


def _umount(point: Path) -> None:
    try:
        _proc.run(["umount", str(point)], timeout=60)
    except AgentboxError:
        _proc.run(["umount", "--lazy", str(point)], timeout=60, check=False)


def _mounted(point: Path) -> bool:
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return False
    return any(line.split()[4] == str(point) for line in text.splitlines() if line.strip())


class HostBinds:
    """The hardened bind points of one sandbox; :meth:`release` is idempotent."""

    def __init__(self, settings: Settings, name: str) -> None:
        self.dir = binds_root(settings) / name
        self.points: list[Path] = []

    def let_through(self, uid: int) -> None:
        """Give host ``uid`` search on the data dir and the bind points' dirs above them
        (a named-user ACL entry: nobody else gains anything)."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        for d in (self.dir.parent.parent, self.dir.parent, self.dir):
            grant_search(d, uid)

    def add(self, source: Path, *, read_only: bool, noexec: bool = False) -> Path:
        """Bind ``source`` to a new private point with ``nosuid,nodev`` (+ ro/noexec)."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        point = self.dir / str(len(self.points))
        if source.is_dir():
            point.mkdir(mode=0o711)
        else:
            point.touch(mode=0o600)
        self.points.append(point)
        opts = ["remount", "bind", "nosuid", "nodev"]
        opts += ["ro"] if read_only else []
        opts += ["noexec"] if noexec else []
        try:
            _proc.run(["mount", "--bind", str(source), str(point)], timeout=60)
            _proc.run(["mount", "-o", ",".join(opts), str(point)], timeout=60)
        except AgentboxError as exc:
            raise SandboxError(f"cannot bind {source} with {','.join(opts[2:])}: {exc}") from exc
        return point

    def release(self) -> None:
        """Unmount every point (lazily if busy) and remove the sandbox's directory."""
        for point in reversed(self.points):
            if _mounted(point):
                with contextlib.suppress(AgentboxError):
                    _umount(point)
        self.points = []
        if self.dir.exists() and not any(_mounted(p) for p in self.dir.iterdir()):
            shutil.rmtree(self.dir, ignore_errors=True)

    def release_all(self) -> None:
        """:meth:`release` for every point on disk (from a process without the handle)."""
        if self.dir.is_dir():
            self.points = sorted(self.dir.iterdir())
        self.release()

    def leftovers(self) -> list[str]:
        return [f"bind {p}" for p in self.dir.glob("*") if _mounted(p)] + (
            [f"dir {self.dir}"] if self.dir.exists() else []
        )


def sweep(settings: Settings, keep: set[str]) -> list[str]:
    """Release the bind points of sandboxes not in ``keep``; return their names."""
    root = binds_root(settings)
    if not root.is_dir():
        return []
    gone = []
    for d in sorted(root.iterdir()):
        if d.name in keep or not d.is_dir():
            continue
        HostBinds(settings, d.name).release_all()
        gone.append(d.name)
        log.info("released the bind points of a gone sandbox", sandbox=d.name)
    return gone
