"""Host uid ranges of their own: one per live sandbox, so one that escapes reaches no other.

The pool of ranges (``settings.uid_slots`` slots of 65536 ids)::

    subid_base + 0      .. +65535       range 0: no slot (direct backend use, docker's remap)
    subid_base + 65536  .. +131071      range 1: service uids (gateways, a slot-less strict VMM)
    subid_base + (2+k)*65536 .. +65535  slot k, k in [0, uid_slots): one sandbox's ids

A sandbox with slot ``k`` maps its uid N to host uid ``subid_base + (2+k)*65536 + N``
(:attr:`~agentbox.config.Settings.sandbox_subid_base`). A slot is held by a file
``<data_dir>/uid-slots/<k>`` naming its owner (the sandbox's name) and the process
that holds it. The file is made complete elsewhere and *linked* into place: ``link``
fails if the name exists, so two processes (launchers, a CLI ``exec``) never hold one
slot, and nobody ever reads a half-written record. A slot is released when its
sandbox is removed (:func:`release`); a restarted launcher keeps a live sandbox's
slot (:func:`claim` of the same owner returns it) and frees only those whose holder
died and whose sandbox is gone (:func:`reap`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import psutil

from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.errors import SandboxError

log = get_logger(__name__)

#: Ids in one slot: a container's whole 65536-id user namespace.
SLOT_IDS = 65536
#: Ranges below the first slot: 0 (no slot) and 1 (service uids).
FIRST_SLOT = 2


def slot_base(settings: Settings, slot: int) -> int:
    """The first host id of ``slot``'s range."""
    return settings.subid_base + (FIRST_SLOT + slot) * SLOT_IDS


def slots_dir(settings: Settings) -> Path:
    """Where the slot records live (root-only)."""
    return settings.data_dir / "uid-slots"


def _dir(settings: Settings) -> Path:
    d = slots_dir(settings)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def _me() -> dict[str, Any]:
    pid = os.getpid()
    try:
        start = psutil.Process(pid).create_time()
    except psutil.Error:
        start = 0.0
    return {"pid": pid, "start": start}


def _holder_alive(rec: dict[str, Any]) -> bool:
    try:
        proc = psutil.Process(int(rec.get("pid", 0)))
        if abs(proc.create_time() - float(rec.get("start", 0.0))) > 0.01:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError, TypeError):
        return False


def _records(d: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for p in d.iterdir():
        if not p.name.isdigit():
            continue
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict):
            yield int(p.name), rec


def held(settings: Settings) -> dict[int, dict[str, Any]]:
    """Every held slot and its record (owner, pid, start)."""
    d = slots_dir(settings)
    return dict(_records(d)) if d.is_dir() else {}


def slot_of(settings: Settings, owner: str) -> int | None:
    """The slot ``owner`` holds, if any."""
    for k, rec in held(settings).items():
        if rec.get("owner") == owner:
            return k
    return None


def _write_tmp(d: Path, rec: dict[str, Any]) -> Path:
    tmp = d / f".tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f)
    return tmp


def claim(settings: Settings, owner: str) -> int:
    """The slot of sandbox ``owner``: the one it already holds (a restarted launcher
    re-adopting it; this process becomes the holder), else the lowest free one.

    Raises :class:`~agentbox.errors.SandboxError` when every slot is held.
    """
    d = _dir(settings)
    rec = {"owner": owner, **_me()}
    mine = slot_of(settings, owner)
    if mine is not None:
        _write_tmp(d, rec).replace(d / str(mine))
        return mine
    taken = set(held(settings))
    tmp = _write_tmp(d, rec)
    try:
        for k in range(settings.uid_slots):
            if k in taken:
                continue
            try:
                os.link(tmp, d / str(k))  # atomic: fails if another process holds k
            except FileExistsError:
                continue
            log.debug("uid slot claimed", slot=k, owner=owner, base=slot_base(settings, k))
            return k
    finally:
        tmp.unlink(missing_ok=True)
    raise SandboxError(
        f"every one of the {settings.uid_slots} sandbox uid ranges is held by a live "
        "sandbox (fix: wait for a task to end, or raise AGENTBOX_UID_SLOTS)",
        sandbox=owner,
    )


def transfer(settings: Settings, old: str, new: str) -> int | None:
    """Hand ``old``'s slot to ``new`` (a pooled sandbox renamed for the task it serves)."""
    k = slot_of(settings, old)
    if k is not None:
        d = _dir(settings)
        _write_tmp(d, {"owner": new, **_me()}).replace(d / str(k))
    return k


def release(settings: Settings, owner: str) -> int | None:
    """Free the slot ``owner`` holds (its sandbox is removed); the slot freed, if any."""
    d = slots_dir(settings)
    if not d.is_dir():
        return None
    for k, rec in _records(d):
        if rec.get("owner") == owner:
            with contextlib.suppress(FileNotFoundError):
                (d / str(k)).unlink()
            log.debug("uid slot released", slot=k, owner=owner)
            return k
    return None


def reap(settings: Settings, live: Collection[str]) -> list[int]:
    """Free every slot whose holder process is gone and whose owner is not in ``live``
    (the sandboxes that still exist); return the slots freed.

    A live holder keeps its slot (a launcher between its claim and its sandbox's
    start); a live sandbox keeps it (a detached task whose launcher died).
    """
    d = slots_dir(settings)
    if not d.is_dir():
        return []
    freed = []
    for k, rec in _records(d):
        if rec.get("owner") in live or _holder_alive(rec):
            continue
        with contextlib.suppress(FileNotFoundError):
            (d / str(k)).unlink()
        freed.append(k)
    return freed


def reown(top: Path, old: int, new: int) -> None:
    """Give every entry under ``top`` (itself included) owned by ``old`` to ``new``, uid
    and gid; links are changed themselves, never followed (``chown -R -h``)."""

    def one(path: Path) -> None:
        st = path.lstat()
        if st.st_uid == old:
            os.chown(path, new, new if st.st_gid == old else -1, follow_symlinks=False)

    one(top)
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in (*dirnames, *filenames):
            one(Path(dirpath) / name)
