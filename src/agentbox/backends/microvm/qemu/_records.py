"""What a detached microVM leaves on disk to be verified by, and how its monitor is born.

The **record** ``<data_dir>/microvm-detached/<name>.json`` (0600 in a 0700 dir)
names the sandbox, its labels, the data dir, the log, the deadline and the
monitor's and the VMM's pid and start time. It is sealed with an HMAC-SHA256
over all of that under ``<data_dir>/detach.key`` (0600; the key podman's seals
use): a record copied from another data dir, or edited, is refused by
:func:`read_record`; :meth:`Identity.process` refuses a pid now another
process's (start time), and :func:`monitor_of` one that is not our monitor
(command line). The record is bounded (:data:`_MAX_RECORD`) and parsed
defensively, though only root writes that dir.

:func:`born_outside` starts the monitor where a stop of the launcher does not
reach it: ``setsid -f`` (a new session; its parent is init, not the launcher),
after entering :data:`UNIT_FREE_CGROUP` in the hierarchies systemd kills a unit
by (``name=systemd``, unified), so QEMU, the monitor's child, is born there too.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from agentbox.backends._detached import detach_key
from agentbox.backends.base import SandboxSpec, data_dir_label
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.errors import SandboxGone
from agentbox.linux.cgroups import unit_hierarchies

logger = get_logger(__name__)

MONITOR_MODULE = "agentbox.backends.microvm.qemu._monitor"
#: Modules a monitor process never imports (it lives as long as its VM, one
#: per task). ``rich`` (~5 MiB private): a monitor renders
#: nothing in colour. Blocked the documented way
#: (``sys.modules[name] = None``) before any part of agentbox loads.
MONITOR_BLOCKED = ("rich",)
#: ``python -c``: block :data:`MONITOR_BLOCKED`, then run the module named in argv[1]
#: as ``__main__`` (``-m`` would import the package first).
_BOOT = (
    "import runpy, sys\n"
    "for name in {blocked!r}:\n"
    "    sys.modules[name] = None\n"
    "runpy.run_module(sys.argv[1], run_name='__main__', alter_sys=True)\n"
)
#: Records of detached VMs, under the data dir.
RECORD_DIR = "microvm-detached"
#: The cgroup, at the root of the hierarchies systemd tracks units by, monitors start in.
UNIT_FREE_CGROUP = "agentbox-vms"
_NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,127}")
_MAX_RECORD = 64 * 1024

#: ``sh -c``: enter each cgroup.procs named before ``--``, send output to the log named
#: first, then ``setsid -f`` the rest (a new session whose parent is init, not us).
_ENTER = (
    'out=$1; shift; while [ "$#" -gt 0 ] && [ "$1" != -- ]; do '
    '{ echo $$ > "$1"; } 2>/dev/null || echo "agentbox: could not enter $1" >&2; shift; '
    'done; shift; exec >>"$out" 2>&1; exec setsid -f "$@"'
)


@dataclass(frozen=True)
class Identity:
    """A process as recorded: its pid and its start time (seconds, psutil's)."""

    pid: int
    start: float

    @classmethod
    def of(cls, pid: int) -> Identity:
        return cls(pid, psutil.Process(pid).create_time())

    def process(self) -> psutil.Process | None:
        """The live process, if ``pid`` still is that very process (not a reused pid)."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.start) > 0.01:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
        except psutil.Error:
            return None
        return proc


def _seal(settings: Settings, body: Mapping[str, Any]) -> str:
    msg = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(detach_key(settings), msg, hashlib.sha256).hexdigest()


def record_path(settings: Settings, name: str) -> Path:
    if not _NAME.fullmatch(name):
        raise SandboxGone("not a sandbox name", sandbox=name[:80])
    return settings.data_dir / RECORD_DIR / f"{name}.json"


def write_record(
    settings: Settings,
    spec: SandboxSpec,
    *,
    log: Path,
    monitor: Identity,
    vm: tuple[str, Identity] | None,
) -> None:
    """Write (atomically, sealed) the record of detached sandbox ``spec.name``."""
    path = record_path(settings, spec.name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    body: dict[str, Any] = {
        "v": 1,
        "name": spec.name,
        "data": data_dir_label(settings.data_dir),
        "labels": dict(spec.labels),
        "log": str(log),
        "deadline": spec.deadline,
        "monitor": [monitor.pid, monitor.start],
        "vm": [vm[0], vm[1].pid, vm[1].start] if vm is not None else None,
        "started": time.time() if vm is not None else None,
    }
    body["seal"] = _seal(settings, body)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(body, fh)
    tmp.replace(path)


def read_record(settings: Settings, name: str) -> dict[str, Any] | None:
    """The record of ``name`` if there is one and its seal holds for this data dir; else
    None (no record, or one this data dir's key did not seal: another's, or forged)."""
    path = record_path(settings, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("unreadable detached record", sandbox=name, error=str(exc))
        return None
    with os.fdopen(fd, "rb") as fh:
        raw = fh.read(_MAX_RECORD + 1)
    try:
        rec = json.loads(raw) if len(raw) <= _MAX_RECORD else None
    except ValueError:
        rec = None
    if not isinstance(rec, dict):
        return None
    seal = rec.pop("seal", "")
    ok = (
        isinstance(seal, str)
        and hmac.compare_digest(seal, _seal(settings, rec))
        and rec.get("name") == name
        and rec.get("data") == data_dir_label(settings.data_dir)
        and isinstance(rec.get("labels"), dict)
        and _identity(rec.get("monitor")) is not None
    )
    if not ok:
        logger.warning("detached record refused: not sealed for this data dir", sandbox=name)
        return None
    return rec


def drop_record(settings: Settings, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        record_path(settings, name).unlink()


def _identity(value: object) -> Identity | None:
    if not isinstance(value, list) or len(value) != 2:
        return None
    pid, start = value
    if type(pid) is not int or pid <= 0 or not isinstance(start, float | int):
        return None
    return Identity(pid, float(start))


def monitor_of(rec: Mapping[str, Any]) -> psutil.Process | None:
    """The record's live monitor, checked to be that process and a monitor of ours."""
    ident = _identity(rec.get("monitor"))
    proc = ident.process() if ident is not None else None
    if proc is None:
        return None
    with contextlib.suppress(psutil.Error):
        if MONITOR_MODULE in proc.cmdline():
            return proc
    return None


def _unit_homes() -> list[Path]:
    """``cgroup.procs`` of :data:`UNIT_FREE_CGROUP` in each hierarchy systemd tracks a
    unit by (``name=systemd``, unified) where this process sits below the root."""
    mounts = unit_hierarchies()
    homes = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            num, ctrls, path = ([*line.split(":", 2), "", ""])[:3]
            key = "0" if num == "0" and not ctrls else ctrls
            if key not in mounts or path in ("", "/"):
                continue
            target = mounts[key] / UNIT_FREE_CGROUP
            with contextlib.suppress(OSError):
                target.mkdir(exist_ok=True)
                homes.append(target / "cgroup.procs")
    return homes


def monitor_argv() -> list[str]:
    """The command of a monitor process: :data:`MONITOR_MODULE` run as ``__main__`` with
    :data:`MONITOR_BLOCKED` kept out. The module's name is one word of the command line
    (:func:`monitor_of` looks for it there)."""
    return [sys.executable, "-c", _BOOT.format(blocked=MONITOR_BLOCKED), MONITOR_MODULE]


def born_outside(argv: Sequence[str], out: Path) -> list[str]:
    """``argv`` run in a new session, its parent init, outside this process's unit
    cgroups (entered *before* it starts: no window in which a unit kill reaches it),
    its stdout and stderr appended to ``out``."""
    homes = [str(h) for h in _unit_homes()]
    return ["sh", "-c", _ENTER, "sh", str(out), *homes, "--", *argv]
