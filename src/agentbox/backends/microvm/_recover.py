"""The VM dirs of microVM sandboxes (qemu, firecracker): who owns them, killing, recovery.

Each VM lives in ``<data dir>/microvm/<vm name>/`` with an ``owner`` record (the
creating process, the sandbox name, the workspace it was made from), its disks
and its run dir; its VMM lives in the cgroup ``agentbox/<vm name>``. Both
microVM backends keep that same layout, so a restarted launcher settles the
orphans of either the same way: kill the cgroup, save ``/data`` into the
recorded workspace (read in userspace, in a jail, never mounted), remove the dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from agentbox.backends.base import LABEL, SandboxSpec
from agentbox.backends.microvm import export_disk
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.paths import check_inside
from agentbox.errors import AgentboxError

log = get_logger(__name__)


def vmm_uid(settings: Settings, isolation: Literal["standard", "strict"]) -> int:
    """The host uid the VMM runs as: yours (standard) or one that owns nothing (strict).

    The strict uid is the sandbox's own host uid when it holds a uid slot
    (``settings.uid_slot``: no other live sandbox's, see backends/_uidslots.py); a
    slot-less one runs just past the 65536 ids of range 0, neither the user nor
    any container's uid.
    """
    if isolation == "strict":
        if settings.uid_slot is not None:
            return settings.sandbox_host_uid
        return settings.subid_base + 65536 + 1
    return os.getuid()


def write_owner(vm_dir: Path, spec: SandboxSpec) -> None:
    """Record who made ``vm_dir``, and for which workspace: a launcher that restarts
    after a crash saves the orphan's /data there (:func:`recover_sandbox`) before
    removing the VM."""
    owner = {
        "pid": os.getpid(),
        LABEL: spec.name,
        "workspace": spec.workspace and str(spec.workspace),
    }
    (vm_dir / "owner").write_text(json.dumps(owner))


def recover_sandbox(settings: Settings, name: str) -> list[str]:
    """Settle the VMs of sandbox ``name`` whose owner died (a launcher crash).

    Each VM's VMM is killed, its ``/data`` disk read in userspace (in a jail, never
    mounted) into the workspace recorded at creation when that lies inside the data
    dir, so nothing the agent wrote is lost; then the VM dir is removed. Returns
    the VM names.
    """
    return settle(settings, name)


def settle(settings: Settings, name: str | None) -> list[str]:
    """Settle the VMs of sandbox ``name`` (of every sandbox if None) whose owner died."""
    settled = []
    for vm_dir, owner in vm_dirs(settings):
        if _orphaned(owner, name):
            _recover(settings, vm_dir, owner)
            settled.append(vm_dir.name)
    return settled


def vm_dirs(settings: Settings) -> Iterator[tuple[Path, dict[str, object]]]:
    """Each VM dir under ``settings.data_dir`` with its parsed ``owner`` record."""
    base = settings.data_dir / "microvm"
    if not base.is_dir():
        return
    for d in sorted(base.iterdir()):
        try:
            owner = json.loads((d / "owner").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict):
            yield d, owner


def _orphaned(owner: dict[str, object], name: str | None) -> bool:
    if name is not None and owner.get(LABEL) != name:
        return False
    pid = owner.get("pid")
    return isinstance(pid, int) and pid != os.getpid() and not pid_alive(pid)


def _recover(settings: Settings, vm_dir: Path, owner: dict[str, object]) -> None:
    from agentbox.backends.microvm import Cgroup

    with contextlib.suppress(AgentboxError):
        cg = Cgroup.__new__(Cgroup)
        cg.name, cg.dirs = vm_dir.name, cgroup_dirs(vm_dir.name)
        cg.remove()  # kills what is left in it first
    ws = owner.get("workspace")
    disk = vm_dir / "data.img"
    if isinstance(ws, str) and disk.is_file():
        try:
            workspace = check_inside(settings.data_dir, Path(ws), what="recorded workspace")
            uid = vmm_uid(settings, "strict")
            replace_workspace(workspace, lambda dest: export_disk(disk, dest, uid=uid))
        except AgentboxError as exc:
            log.error("could not save an orphan VM's /data", vm=vm_dir.name, error=str(exc))
    shutil.rmtree(vm_dir, ignore_errors=True)


def export_into(disk: Path, dest: Path, *, uid: int) -> None:
    """Read the ext4 image ``disk`` into the new directory ``dest`` (in a jail as ``uid``)."""
    export_disk(disk, dest, uid=uid)


def replace_workspace(ws: Path, fill: Callable[[Path], object]) -> None:
    """Fill a staging dir next to ``ws`` with ``fill``, then swap its entries into ``ws``."""
    staging = ws.parent / f".{ws.name}.agentbox-export-{secrets.token_hex(4)}"
    try:
        fill(staging)
        for entry in list(ws.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        for entry in list(staging.iterdir()):
            entry.rename(ws / entry.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def kill_sandbox(settings: Settings, name: str) -> list[str]:
    """Kill the VMMs of every VM created for sandbox ``name``; return the VM names."""
    base = settings.data_dir / "microvm"
    killed: list[str] = []
    if not base.is_dir():
        return killed
    for d in base.iterdir():
        try:
            owner = json.loads((d / "owner").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(owner, dict) or owner.get(LABEL) != name:
            continue
        for cg in cgroup_dirs(d.name):
            with contextlib.suppress(OSError, ValueError):
                for pid in (cg / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), 9)
        killed.append(d.name)
    return killed


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie has exited: its watchdog reaps its VMs before its parent reaps it.
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] != b"Z"


def cgroup_dirs(name: str) -> list[Path]:
    """The cgroup dirs of VM ``name`` (one on cgroup v2; pids and memory on v1)."""
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        return [root / "agentbox" / name]
    return [root / "pids" / "agentbox" / name, root / "memory" / "agentbox" / name]
