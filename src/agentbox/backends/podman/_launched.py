"""What ``podman run -d`` itself tells us, so no ``podman inspect`` runs before the output.

Each ``podman`` command is a client start (the Go runtime, containers.conf, the
libpod database and c/storage opened, a ``conmon --version``): 0.1 s on a quiet
2-core host, 0.2-0.4 s on a busy one. ``launch`` runs none after its ``podman run
-d``'s own (not one to refuse a name in use, one for conmon's pid, nor the follower's
first, for the labels and start time it had just given podman):

* conmon's pid comes from ``--conmon-pidfile`` (:func:`with_pidfile`): conmon, root,
  writes it into our private directory (:func:`~agentbox.backends.oci._cli.conmon_cwd`)
  before ``podman run -d`` returns. :func:`started_conmon` trusts it only as a
  regular root-owned file holding a pid whose process is a ``conmon`` monitoring that
  very container id (its ``-c`` argument); anything else falls back to ``inspect``;
* the container id is ``podman run -d``'s own output (64 hex digits, checked);
* :func:`launched_view` is what ``inspect`` would say of the sandbox just launched (its
  name, id, labels, conmon and start), handed to ``follow`` as a pool claim's view is
  (``PodmanBackend.claimed``), so the follower reads the log at once. A follower in
  another process (a new launcher adopting the task) still asks podman.

The start time in the view is taken *before* ``podman run -d``: the follower's
deadline then counts from a moment no later than podman's own ``StartedAt``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from agentbox.backends.base import SandboxSpec
from agentbox.backends.oci._cli import conmon_cwd
from agentbox.backends.podman._exitfile import read_owned_note
from agentbox.core.log import get_logger

log = get_logger(__name__)

_ID = re.compile(r"[0-9a-f]{64}")


def with_pidfile(args: list[str], name: str) -> tuple[list[str], Path]:
    """``args`` (a ``podman … run …`` argv) with ``--conmon-pidfile`` after ``run``, and
    that file: a fresh name in our private (0700, root) directory."""
    path = conmon_cwd() / f".{name}.{secrets.token_hex(6)}.conmon-pid"
    i = args.index("run") + 1
    return [*args[:i], "--conmon-pidfile", str(path), *args[i:]], path


def container_id(stdout: str) -> str | None:
    """The full container id ``podman run -d`` printed (its last line), or None."""
    lines = stdout.strip().splitlines()
    cid = lines[-1].strip() if lines else ""
    return cid if _ID.fullmatch(cid) else None


def started_conmon(pidfile: Path, cid: str | None) -> psutil.Process | None:
    """The conmon that monitors container ``cid``, from its pid file (then removed);
    None when the file or the process is not what it must be (the caller asks podman)."""
    try:
        note = read_owned_note(pidfile, uid=os.geteuid(), limit=32)
    finally:
        with contextlib.suppress(OSError):
            pidfile.unlink()
    if note is None or cid is None or not (text := note[0]).isdigit():
        return None
    try:
        proc = psutil.Process(int(text))
        argv = proc.cmdline()
        if proc.name() != "conmon" or "-c" not in argv or argv[argv.index("-c") + 1 :][:1] != [cid]:
            return None
    except (psutil.Error, ValueError):
        return None
    return proc


def launched_view(
    name: str, cid: str, conmon: psutil.Process, labels: Mapping[str, str], started: float
) -> dict[str, Any]:
    """What ``podman inspect`` says of a sandbox just launched, as ``follow`` reads it."""
    return {
        "Id": cid,
        "Name": name,
        "Config": {"Labels": dict(labels)},
        "State": {
            "Running": True,
            "ConmonPid": conmon.pid,
            "StartedAt": datetime.fromtimestamp(started, UTC).isoformat(),
        },
    }


def conmon_and_view(
    stdout: str, pidfile: Path, spec: SandboxSpec, started: float
) -> tuple[psutil.Process | None, dict[str, Any] | None]:
    """After ``podman run -d`` of ``spec`` (its ``stdout``): the sandbox's conmon and its
    view for ``follow``; (None, None) when either is not known for sure (ask podman)."""
    cid = container_id(stdout)
    conmon = started_conmon(pidfile, cid)
    if conmon is None or cid is None:
        log.debug("conmon not known from podman run's answer", sandbox=spec.name)
        return None, None
    return conmon, launched_view(spec.name, cid, conmon, spec.labels, started)
