"""The MCP server's identity: whom it drops to (:func:`resolve_identity`) and the drop itself,
which is :func:`agentbox.linux.privdrop.drop_to` (see there for what it removes and checks).

The MCP server parses requests written by a model that may be prompt-injected, so if it is
started as root (``agentbox serve``, or a root-owned Claude Code spawning ``agentbox mcp``) it
gives every privilege away before it reads a single request.
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from agentbox.core.log import get_logger
from agentbox.errors import PolicyRefused, PrivilegeDropError
from agentbox.linux.privdrop import drop_to

log = get_logger(__name__)


@dataclass(frozen=True)
class Identity:
    """Who the MCP server runs as after the drop."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def resolve_identity(user: str | None, repos_root: Path, socket_path: Path | None) -> Identity:
    """The uid/gid to drop to: ``user`` (a name or a number) or the repos root's owner.

    The launcher socket's group is kept as the only supplementary group when it
    is a dedicated group (not gid 0), so the server can still connect to it.
    Refuses uid 0: the point is to not be root.
    """
    if user:
        try:
            pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
            uid, gid = pw.pw_uid, pw.pw_gid
        except KeyError:
            if not user.isdigit():
                raise PolicyRefused(f"no such user for the MCP server: {user!r}") from None
            uid = gid = int(user)  # a bare uid without a passwd entry is fine
    else:
        st = repos_root.stat()
        uid, gid = st.st_uid, st.st_gid
    if uid == 0:
        raise PolicyRefused(
            f"the MCP server will not run as root, and the repos root {repos_root} is owned by "
            "root: pass --user NAME (the owner of the repos to delegate) or set "
            "AGENTBOX_MCP_USER, or make the repos root belong to an ordinary user"
        )
    groups: tuple[int, ...] = ()
    if socket_path is not None:
        try:
            sst = socket_path.stat()
        except OSError:
            sst = None
        if sst is not None and stat.S_ISSOCK(sst.st_mode) and sst.st_gid not in (0, gid):
            groups = (sst.st_gid,)
    return Identity(uid=uid, gid=gid, groups=groups)


def drop_privileges(identity: Identity | None) -> None:
    """Become ``identity`` with no capabilities and no-new-privs, then verify it
    (:func:`~agentbox.linux.privdrop.drop_to`).

    ``identity`` None (not started as root): only no-new-privs, and no capability held.
    Raises :class:`PrivilegeDropError` if anything survives the drop.
    """
    # The bounding set, capset and no-new-privs are per thread: drop while we are the only one,
    # so every thread started later inherits the dropped state.
    threads = [p.name for p in Path("/proc/self/task").iterdir()]
    if len(threads) != 1:
        raise PrivilegeDropError(f"privilege drop needs a single-threaded process, found {threads}")
    if identity is None:
        if os.geteuid() == 0:
            raise PrivilegeDropError("started as root without an identity to drop to")
        drop_to(os.getuid(), os.getgid())
    else:
        drop_to(identity.uid, identity.gid, identity.groups)
    log.info("privileges dropped", uid=os.geteuid(), gid=os.getegid(), groups=os.getgroups())
