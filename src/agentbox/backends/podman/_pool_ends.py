"""How pool entries end: a claimed one's slot released after its task, unclaimed
ones swept when expired or dead, all of them drained at ``launcher stop``.

See :mod:`agentbox.backends.podman._pool`.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

from agentbox.backends._uidslots import release as release_uid_slot
from agentbox.backends.oci._cli import force_remove
from agentbox.backends.podman import _pool_disk as pool_disk
from agentbox.backends.podman._detach import inspect
from agentbox.backends.podman._pool_slots import (
    SLOT_PREFIX,
    alive,
    discard,
    filler_alive,
    locked,
    pool_dir,
    slot_log,
    slots,
    unmount_if_empty,
)
from agentbox.backends.podman._pool_view import claim_record
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.errors import AgentboxError
from agentbox.linux.mounts import is_mount


def release(settings: Settings, name: str) -> bool:
    """Once sandbox ``name`` (a task's, or a slot's) is gone: unmount its slot's binds,
    keep its final log in the task's log, remove the slot. True if there was one."""
    root = pool_dir(settings)
    rec = claim_record(root, name)
    slot = str(rec.get("slot", "")) if rec is not None else name
    if not slot.startswith(SLOT_PREFIX) or "/" in slot:
        return False
    sdir = root / "slots" / slot
    if rec is not None:
        _keep_log(slot_log(root, slot), Path(str(rec.get("task_log", ""))))
    found = sdir.is_dir()
    if found:
        discard(sdir)
    # Its host uid range (the slot's, handed to the task at claim) is free again.
    release_uid_slot(settings, name)
    release_uid_slot(settings, slot)
    if rec is not None:
        (root / "claims" / f"{name}.json").unlink(missing_ok=True)
    if found and settings.pool_size <= 0:
        unmount_if_empty(root)  # a pool of a launcher before this one: its last task ended
    return found


def sweep(settings: Settings, *, everything: bool = False) -> list[str]:
    """Remove expired or dead unclaimed entries (``everything``: every unclaimed one),
    slots of claims that never completed, and, once no slot is left, the pool mount.

    An entry is dead when its sandbox's conmon is gone or the process that filled it
    (a launcher's keeper) is: a launcher that died leaves its pool to the next one's
    orphan sweep, and a live keeper's pool is left to it."""
    root = pool_dir(settings)
    if not root.is_dir():
        return []
    removed = []
    now = time.time()
    with locked(settings):
        for sdir, ready in slots(root):
            if ready is not None:
                fresh = float(ready.get("expires", 0)) > now
                if not everything and fresh and alive(ready) and filler_alive(ready):
                    continue
                try:  # taken from claimers first: a claim and a drain never share one
                    (sdir / "ready").rename(sdir / "drained")
                except OSError:
                    continue
            elif (sdir / "claimed").exists() and _claimed_in_use(root, sdir.name):
                continue
            elif not (sdir / "claimed").exists() and not (sdir / "drained").exists():
                continue  # being filled (under this lock: by a filler that died) or odd
            with contextlib.suppress(AgentboxError):
                force_remove(sdir.name)
            discard(sdir)
            release_uid_slot(settings, sdir.name)
            removed.append(sdir.name)
        # Staged disks of slots that are gone or were never finished (a filler killed).
        pool_disk.sweep(settings.data_dir, root / "slots")
        if not any((root / "slots").iterdir()) and is_mount(root):
            with contextlib.suppress(AgentboxError):
                _proc.run(["umount", root], timeout=60)
    return removed


def drain(settings: Settings) -> list[str]:
    """Remove every unclaimed pooled sandbox (``launcher stop``); claimed ones run on."""
    return sweep(settings, everything=True)


def _claimed_in_use(root: Path, slot: str) -> bool:
    """A claimed slot whose claim record names it (its follower releases it) or whose
    container still exists (a claim under way)."""
    claims = root / "claims"
    if claims.is_dir():
        for rec_path in claims.glob("*.json"):
            rec = claim_record(root, rec_path.stem)
            if rec is not None and rec.get("slot") == slot:
                return True
    return inspect(slot) is not None


def _keep_log(written: Path, task_log: Path) -> None:
    """The task's log is a hard link of the slot's; past conmon's cap (a new file) or
    on another filesystem it is not: copy the final one over it."""
    if not task_log.is_absolute() or not written.is_file():
        return
    with contextlib.suppress(OSError):
        if task_log.exists() and written.samefile(task_log):
            return
        tmp = task_log.with_name(task_log.name + ".pool")
        shutil.copyfile(written, tmp, follow_symlinks=False)
        tmp.replace(task_log)
