"""A pooled sandbox's workspace disk made at fill, filled at claim (issue 35 §2).

Real podman, runc, loop devices and mounts:

* a claim fills the slot's staged disk (no ``mkfs.ext4 -d`` on the task's path) and
  the task sees what a fresh sandbox's ``mkfs -d`` disk shows: every entry's type,
  mode, owner, link count, size, blocks, time and link target, the root's owner and
  mode, the mount's flags, the filesystem's size and inode count; its writes come back;
* the disk limit holds on that path: a write past it fails with ENOSPC, and so does
  a file past the inode limit;
* a workspace past the copy's bound, or holding a FIFO, or a move of the staged disk
  refused, takes ``mkfs -d`` (the staged disk dropped at once) and runs as well;
* a drained slot, one a claim found dead, one whose filler died (the next launcher's
  orphan sweep) and a staged disk whose slot is gone leave no mount, loop device or
  image.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends import Exited
from agentbox.backends import _wsdisk as wsdisk
from agentbox.backends.base import SandboxSpec
from agentbox.backends.oci._cli import force_remove
from agentbox.backends.podman import PodmanBackend
from agentbox.backends.podman import _pool as pool
from agentbox.backends.podman import _pool_disk as pool_disk
from agentbox.backends.podman import _pool_ends as pool_ends
from agentbox.backends.podman import _removals as removals
from agentbox.boxfile import Resources
from agentbox.collect._checkout import chown_tree
from agentbox.config import Settings
from agentbox.launcher._adopt import remove_orphans
from agentbox.launcher._store import Store
from mount_helpers import assert_no_mounts_under, loops_under, mounts_under
from sandbox_leaks import SandboxTracker

pytestmark = [
    pytest.mark.podman,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace disks and mounts need root"),
]

SMALL = Resources(disk=64 * 1024**2, inodes=1024)


@pytest.fixture
def pooled(
    sandbox_settings: Settings, podman_boxes: SandboxTracker
) -> Iterator[tuple[PodmanBackend, Settings]]:
    """A backend whose settings turn the pool on; the pool drained after, nothing left."""
    settings = sandbox_settings.model_copy(update={"pool_size": 1})
    yield PodmanBackend(settings), settings
    pool_ends.drain(settings)
    assert removals.wait(timeout=120), "a removal (off the path) hung"
    assert not _staged(settings), _staged(settings)
    assert_no_mounts_under(settings.data_dir)  # and no loop device (a bounded wait)


@pytest.fixture
def mkfs_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The workspaces :meth:`WorkspaceDisk.mount` (``mkfs.ext4 -d``) was asked to make."""
    calls: list[str] = []
    real = wsdisk.WorkspaceDisk.mount

    def spy(self: wsdisk.WorkspaceDisk) -> None:
        calls.append(str(self.workspace))
        real(self)

    monkeypatch.setattr(wsdisk.WorkspaceDisk, "mount", spy)
    return calls


def _staged(settings: Settings) -> list[str]:
    base = pool_disk.disks_root(settings.data_dir)
    return sorted(p.name for p in base.iterdir()) if base.is_dir() else []


def _template(image: str, ws: Path, **kw: object) -> SandboxSpec:
    return SandboxSpec(name="template", image=image, workspace=ws, deadline=120, **kw)  # type: ignore[arg-type]


def _fill(
    tracker: SandboxTracker, backend: PodmanBackend, template: SandboxSpec, n: int
) -> list[str]:
    names = pool.fill(backend, template, n, ttl=120)
    for name in names:
        tracker.track(name)
    return names


def _run(
    tracker: SandboxTracker, backend: PodmanBackend, spec: SandboxSpec, script: str, log: Path
) -> tuple[Exited, str, str]:
    out: list[bytes] = []
    err: list[bytes] = []
    tracker.track(spec.name)
    backend.launch(spec, ["sh", "-c", script], log=log)
    ended = backend.follow(
        spec.name, log=log, on_stdout=out.append, on_stderr=err.append, poll=0.05
    )
    assert removals.wait(spec.name, 120), "the container's removal (off the path) hung"
    return ended, b"".join(out).decode(), b"".join(err).decode()


def _populate(ws: Path, uid: int) -> None:
    """A tree of every kind the copy keeps: nested dirs, modes, an old time, a hard
    link, symlinks (one dangling, one out of the tree), an empty and a sparse file."""
    (ws / "src" / "pkg").mkdir(parents=True)
    (ws / "src" / "pkg" / "mod.py").write_text("print('hi')\n")
    (ws / "run.sh").write_text("#!/bin/sh\necho run\n")
    (ws / "run.sh").chmod(0o755)
    (ws / "secret").write_text("s\n")
    (ws / "secret").chmod(0o600)
    (ws / "empty").touch()
    with (ws / "sparse").open("wb") as fh:
        fh.seek(1 << 20)
        fh.write(b"end")
    os.link(ws / "src" / "pkg" / "mod.py", ws / "hard.py")
    (ws / "link").symlink_to("src/pkg/mod.py")
    (ws / "dangling").symlink_to("nowhere")
    (ws / "out").symlink_to("/etc/passwd")
    (ws / "ro").mkdir(mode=0o555)
    old = 1_600_000_000
    os.utime(ws / "secret", (old, old))
    os.utime(ws / "src" / "pkg", (old, old))
    chown_tree(ws, uid, uid)
    ws.chmod(0o751)


_LIST = r"""
cd /workspace
find . -mindepth 1 -printf '%P|%y|%m|%U|%G|%n|%s|%b|%Ts|%l\n' | sort
echo --; stat -c '%a %u %g' /workspace
echo --; stat -f -c '%b %S %c' /workspace
echo --; awk '$5 == "/workspace" {print $6}' /proc/self/mountinfo | tail -1
echo new > written.txt
"""


def test_claim_fills_the_staged_disk_as_mkfs_would(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace: Callable[[], Path],
    tmp_path: Path,
    podman_boxes: SandboxTracker,
    mkfs_calls: list[str],
) -> None:
    backend, settings = pooled
    uid = settings.sandbox_host_uid
    ws_pooled = make_workspace()
    _populate(ws_pooled, uid)
    ws_fresh = make_workspace()
    shutil.rmtree(ws_fresh)
    shutil.copytree(ws_pooled, ws_fresh, symlinks=True)  # times kept (copy2)
    os.link(ws_fresh / "src" / "pkg" / "mod.py", ws_fresh / "hard.py.tmp")
    os.replace(ws_fresh / "hard.py.tmp", ws_fresh / "hard.py")  # a hard link again
    chown_tree(ws_fresh, uid, uid)
    ws_fresh.chmod(0o751)
    [slot] = _fill(podman_boxes, backend, _template(default_image, ws_pooled), 1)
    ready = json.loads((pool.pool_dir(settings) / "slots" / slot / "ready").read_text())
    assert ready["disk"] and f"{slot}.img" in _staged(settings)
    assert any(f"/{slot}.d " in m for m in mounts_under(settings.data_dir))
    listings = {}
    for kind, ws in (("pooled", ws_pooled), ("fresh", ws_fresh)):
        spec = _template(default_image, ws).replace(name=f"agentbox-pdisk-{kind}-{os.getpid()}")
        ended, out, err = _run(podman_boxes, backend, spec, _LIST, tmp_path / f"{kind}.log")
        assert ended == Exited(0, False), err
        listings[kind] = out
        assert (ws / "written.txt").read_text() == "new\n"  # copied back
        if kind == "pooled":
            assert mkfs_calls == [], "the claim ran mkfs -d"
            assert not _staged(settings)  # the image moved to the task's disk, then went
    assert mkfs_calls == [str(ws_fresh)]
    entries, root, _fs, opts = listings["pooled"].split("--\n")
    assert "hard.py|f|644|64000|64000|2|" in entries and "sparse|f|" in entries, entries
    assert root.split() == ["751", "64000", "64000"]
    assert opts.strip().split(",")[:4] == ["rw", "nosuid", "nodev", "noatime"], opts
    assert listings["pooled"] == listings["fresh"]


def test_disk_limit_holds_on_the_staged_disk(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace: Callable[[], Path],
    tmp_path: Path,
    podman_boxes: SandboxTracker,
    mkfs_calls: list[str],
) -> None:
    backend, _ = pooled
    ws = make_workspace()
    template = _template(default_image, ws, resources=SMALL)
    _fill(podman_boxes, backend, template, 1)
    script = (
        "dd if=/dev/zero of=big bs=1M count=100 2>&1 | grep 'No space'; rm -f big; "
        "mkdir many; i=0; while touch many/f$i 2>/dev/null; do i=$((i+1)); done; "
        "echo files=$i; touch many/more; rc=$?; rm -rf many; exit $rc"
    )
    spec = template.replace(name=f"agentbox-pdisk-limit-{os.getpid()}")
    ended, out, err = _run(podman_boxes, backend, spec, script, tmp_path / "t.log")
    assert mkfs_calls == [], "the claim ran mkfs -d"
    assert "No space left on device" in out, out
    files = int(out.split("files=")[1].split()[0])
    assert 900 < files < 1024, out  # the inode limit, less the root's own few
    assert "No space left on device" in err, err
    assert ended == Exited(1, False), (out, err)


@pytest.mark.parametrize("why", ["entries", "fifo", "move"])
def test_a_workspace_not_for_the_copy_takes_mkfs(
    why: str,
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace: Callable[[], Path],
    tmp_path: Path,
    podman_boxes: SandboxTracker,
    mkfs_calls: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend, settings = pooled
    ws = make_workspace()
    for i in range(5):
        (ws / f"f{i}").write_text(f"{i}\n")
    if why == "fifo":
        os.mkfifo(ws / "pipe")
    elif why == "entries":
        monkeypatch.setattr(pool_disk, "MAX_ENTRIES", 3)
    else:  # the move refused (a data dir on a shared mount): undone, then mkfs

        def refuse(*_: object) -> None:
            raise OSError(errno.EINVAL, "refused")

        monkeypatch.setattr(pool_disk, "mount", refuse)
    chown_tree(ws, settings.sandbox_host_uid, settings.sandbox_host_uid)
    [slot] = _fill(podman_boxes, backend, _template(default_image, ws), 1)
    spec = _template(default_image, ws).replace(name=f"agentbox-pdisk-{why}-{os.getpid()}")
    ended, out, err = _run(
        podman_boxes, backend, spec, "cat f0 f4; ls -A | wc -l; echo x > f9", tmp_path / "t.log"
    )
    assert ended == Exited(0, False), err
    assert out.split() == ["0", "4", "6" if why == "fifo" else "5"]
    assert mkfs_calls == [str(ws)]  # the fallback, not the fresh path: the slot served it
    assert not (pool.pool_dir(settings) / "slots" / slot).exists()
    assert (ws / "f9").read_text() == "x\n"


def test_unclaimed_staged_disks_leave_nothing(
    pooled: tuple[PodmanBackend, Settings],
    default_image: str,
    make_workspace: Callable[[], Path],
    tmp_path: Path,
    podman_boxes: SandboxTracker,
) -> None:
    """Drained slots, a slot a claim found dead, a dead filler's slot (swept at a next
    launcher's start) and a staged disk whose slot is gone (a filler killed mid-way)
    leave no mount, loop device or image."""
    backend, settings = pooled
    template = _template(default_image, make_workspace())
    slots = _fill(podman_boxes, backend, template, 2)
    assert _staged(settings) == sorted(f"{s}.{x}" for s in slots for x in ("d", "img"))
    assert len(loops_under(settings.data_dir)) == 2
    assert sorted(pool_ends.drain(settings)) == sorted(slots)
    assert not _staged(settings)
    assert_no_mounts_under(settings.data_dir, clean=False)
    # a claim that finds the slot's sandbox dead discards the slot, its disk with it
    [dead] = _fill(podman_boxes, backend, template, 1)
    path = pool.pool_dir(settings) / "slots" / dead / "ready"
    ready = json.loads(path.read_text())
    ready["conmon_start"] = 1.0  # not its conmon any more
    path.unlink()
    pool.write(path, ready, mode=0o600)
    spec = template.replace(name=f"agentbox-pdisk-dead-{os.getpid()}")
    assert not pool.claim(backend, spec, ["true"], log_path=tmp_path / "dead.log")
    assert not _staged(settings)
    force_remove(dead)
    # a launcher that died with its pool: the next one's start reaps slot and disk
    [kept] = _fill(podman_boxes, backend, template, 1)
    gone = subprocess.Popen(["true"])
    gone.wait()
    path = pool.pool_dir(settings) / "slots" / kept / "ready"
    ready = json.loads(path.read_text())
    ready["filler"] = gone.pid
    path.unlink()
    pool.write(path, ready, mode=0o600)
    remove_orphans(settings, Store(settings.data_dir / "state.db"))
    assert not _staged(settings)
    assert_no_mounts_under(settings.data_dir, clean=False)
    # a staged disk whose slot never got a record: the pool's sweep drops it
    orphan = f"{pool.SLOT_PREFIX}{os.getpid():012x}"
    podman_boxes.track(orphan)
    pool_disk.make(settings, orphan, template.resources.disk_limit(settings))
    assert len(loops_under(settings.data_dir)) == 1
    assert pool_ends.sweep(settings) == []
    assert not _staged(settings)
    assert_no_mounts_under(settings.data_dir, clean=False)


def test_the_filled_disk_is_let_go_only_past_its_copys_clock_tick(
    sandbox_settings: Settings, make_workspace: Callable[[], Path]
) -> None:
    """The copy gives each entry a ctime of now: the disk is handed on only once the
    timestamp clock has passed every ctime the mount-time snapshot holds, so an agent's
    first write cannot keep an entry's inode and ctime (the copy back would keep the
    old bytes). Checked over several fills: without the wait most end within the tick."""
    settings = sandbox_settings
    limit = SMALL.disk_limit(settings)
    coarse = getattr(time, "CLOCK_REALTIME_COARSE", 5)
    for i in range(5):
        ws = make_workspace()
        (ws / "f.txt").write_text("base\n")
        slot = f"{pool.SLOT_PREFIX}{os.getpid():08x}{i:04x}"
        staged = pool_disk.make(settings, slot, limit)
        disk = pool_disk.PrebuiltDisk(
            settings, f"agentbox-pdisk-tick-{os.getpid()}-{i}", ws, limit,
            slot=slot, staged=staged,
        )  # fmt: skip
        try:
            disk.mount()
            now = time.clock_gettime_ns(coarse)
            newest = max(ctime for _, ctime in disk._snap.values())
            assert now > newest, f"handed on within the copy's tick (fill {i})"
        finally:
            disk.release()
            pool_disk.drop(settings.data_dir, slot)
    assert wsdisk.wait_released(60)
    assert_no_mounts_under(settings.data_dir)
