"""A Boxfile committed in the repo (``.agentbox/Boxfile.toml``), read from the base commit.

It is read as a git blob of ``HEAD`` (``git ls-tree`` then ``git cat-file``,
through the caller's trusted read-only git: no hooks, no fsmonitor, nothing
of the work tree), so an uncommitted edit or a link in the work tree changes
nothing. Only a regular file (mode 100644/100755) of at most
:data:`~agentbox.boxfile.MAX_BOXFILE_BYTES` counts; anything else there is
refused by name. It is then bounded by the host settings like any Boxfile:
mounts under the mount roots, ``[network]`` hosts within the egress cap.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agentbox import _proc
from agentbox.boxfile import MAX_BOXFILE_BYTES, Boxfile, loads_boxfile
from agentbox.config import Settings
from agentbox.errors import BoxfileError, CommandError

__all__ = ["COMMITTED_BOXFILE", "check_env_policy", "committed_boxfile"]

#: Where a repo commits its Boxfile.
COMMITTED_BOXFILE = ".agentbox/Boxfile.toml"

GitRunner = Callable[..., _proc.Result]


def committed_boxfile(
    repo: Path, settings: Settings, git: GitRunner, *, rev: str = "HEAD"
) -> Boxfile | None:
    """The Boxfile committed at ``rev`` of ``repo``, or None if it has none.

    ``git(repo, *args)`` runs git read-only in the repo (the launcher's
    ``git_readonly``). Raises :class:`BoxfileError` (naming ``rev:path``) for one
    that is not a regular file, too large, not UTF-8 or not valid.
    """
    where = Path(f"{rev}:{COMMITTED_BOXFILE}")
    try:
        listing = git(repo, "ls-tree", "-z", "--full-tree", rev, "--", COMMITTED_BOXFILE).stdout
    except CommandError as exc:
        raise BoxfileError(f"cannot list the base commit: {exc}", path=where) from exc
    if not listing:
        return None
    head, _, _name = listing.rstrip("\0").partition("\t")
    fields = head.split()
    if len(fields) != 3 or fields[1] != "blob" or fields[0] not in ("100644", "100755"):
        raise BoxfileError("not a regular file in the commit", path=where)
    sha = fields[2]
    try:
        size = int(git(repo, "cat-file", "-s", sha).stdout.strip())
        if size > MAX_BOXFILE_BYTES:
            raise BoxfileError(
                f"too large ({size} bytes; a Boxfile may hold {MAX_BOXFILE_BYTES})", path=where
            )
        text = git(repo, "cat-file", "blob", sha).stdout
    except (CommandError, ValueError) as exc:
        raise BoxfileError(f"cannot read the committed Boxfile: {exc}", path=where) from exc
    if "\ufffd" in text:
        raise BoxfileError("not UTF-8 text", path=where)
    return loads_boxfile(text, path=where, settings=settings)


#: Backends whose sandboxes take a frozen environment and a phase's egress socket:
#: podman (a host overlay bind-mounted) and qemu (a copy-on-write disk, the socket served
#: by the guest agent). docker keys images in its own store and firecracker's guest
#: mounts are read-only disks: refused at submit, not half-way through a task.
_ENV_BACKENDS = frozenset({"podman", "qemu"})


def check_env_policy(box: Boxfile, settings: Settings) -> None:
    """Refuse, before anything is created, a Boxfile whose ``[setup]`` or ``[network]``
    this host cannot honour: ``[network] allow`` hosts outside the host's
    ``egress_allow_cap`` (:class:`~agentbox.errors.PolicyRefused`), ``[setup]`` or
    ``[network] allow`` on a backend without environments (docker, firecracker:
    :class:`~agentbox.errors.UnsupportedError`)."""
    from agentbox.egress import EgressPolicy
    from agentbox.errors import UnsupportedError

    if box.egress_allow:
        EgressPolicy.for_phase(settings, allow=box.egress_allow)
    supported = ", ".join(sorted(_ENV_BACKENDS))
    if box.setup is not None and box.backend not in _ENV_BACKENDS:
        raise UnsupportedError(
            f"[setup] runs on the {supported} backends, not {box.backend}",
            fix=f"use one of backend = {' or '.join(repr(b) for b in sorted(_ENV_BACKENDS))} "
            "for a Boxfile with [setup]",
        )
    if box.egress_allow and box.backend not in _ENV_BACKENDS:
        raise UnsupportedError(
            f"[network] allow works on the {supported} backends, not {box.backend}",
            fix="remove [network] allow, or use one of those backends",
        )
