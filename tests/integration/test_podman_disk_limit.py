"""A podman sandbox cannot write more to /workspace than its disk limit (issue 11 item 6).

Each sandbox's workspace lives on its own sparse ext4 image, loop-mounted over
the workspace for the sandbox's life (backends/_wsdisk.py). These tests
run real podman (runc and runsc) and check, from the host:

* writing past the limit (``fallocate``, ``dd``, a flood of files) fails inside
  with ENOSPC, and what was written before is still in the workspace after;
* the copy back keeps what collection needs and nothing it must not: hard
  links stay links, sparse files stay sparse, setuid bits go, FIFOs are skipped;
* nothing is left behind: no mount on the workspace, no loop device on the
  image, no image or record in ``data_dir/disks``;
* a disk whose owner died is copied back and unmounted by ``cleanup_orphans``.

Every sandbox goes through the leak guard (``sandbox_factory``) as well.

Before the fix the same ``fallocate -l 1G`` succeeded on the host's disk.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from agentbox.backends._wsdisk import WorkspaceDisk, settle_orphan_disks
from agentbox.backends.podman import PodmanBackend
from agentbox.boxfile import Boxfile, DiskLimit
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.sandbox import spec_from_boxfile
from sandbox_leaks import SandboxTracker

RUNTIMES = [rt for rt in ("runc", "runsc") if _host.podman_runtime(rt).ok]
MiB = 1024**2


def _box(runtime: str = "runc", **resources: object) -> Boxfile:
    return Boxfile.from_dict({"runtime": runtime, "resources": resources})


def _assert_no_disk_left(settings: Settings, ws: Path) -> None:
    mnt = subprocess.run(
        ["findmnt", "-n", "-o", "TARGET", "--mountpoint", str(ws)], capture_output=True, text=True
    )
    assert mnt.stdout.strip() == "", f"still mounted: {mnt.stdout}"
    disks = settings.data_dir / "disks"
    # The loop device goes with the filesystem's last user: a container's mount
    # namespace (runsc's gofer) may outlive `podman run --rm` by a moment, longer on
    # a loaded host. A bounded wait for cleanup, not a speed assertion.
    for _ in range(600):
        loops = subprocess.run(["losetup", "-n", "-O", "BACK-FILE"], capture_output=True, text=True)
        if str(disks) not in loops.stdout:
            break
        time.sleep(0.1)
    assert str(disks) not in loops.stdout, loops.stdout
    assert not disks.exists() or list(disks.iterdir()) == []


def _seed(ws: Path, settings: Settings) -> None:
    (ws / "keep.txt").write_text("written before the task\n")
    os.chown(ws / "keep.txt", settings.sandbox_host_uid, settings.sandbox_host_uid)


@pytest.mark.podman
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_writing_past_the_limit_fails_inside_with_enospc(
    sandbox_settings: Settings,
    make_workspace: Callable[[], Path],
    default_image: str,
    runtime: str,
    podman_boxes: SandboxTracker,
) -> None:
    ws = make_workspace()
    _seed(ws, sandbox_settings)
    spec = spec_from_boxfile(_box(runtime, disk="128MiB"), sandbox_settings, workspace=ws)
    script = (
        "echo partial > /workspace/partial.txt; "
        "fallocate -l 1G /workspace/falloc; echo fallocate=$?; "
        "dd if=/dev/zero of=/workspace/dd bs=1M count=400 status=none; echo dd=$?; "
        "df -k /workspace | tail -1"
    )
    res = podman_boxes.run(spec, ["sh", "-c", script])
    out, err = res.stdout.decode(), res.stderr.decode()
    assert "fallocate=1" in out and "dd=1" in out, (out, err)
    assert err.count("No space left on device") >= 2, err
    # The filesystem the sandbox sees is the limit, not the host's disk.
    size_kib = int(out.strip().splitlines()[-1].split()[1])
    assert size_kib * 1024 <= 128 * MiB
    # Collection afterwards: what the agent wrote before the limit is in the workspace.
    assert (ws / "keep.txt").read_text() == "written before the task\n"
    assert (ws / "partial.txt").read_text() == "partial\n"
    held = sum(p.lstat().st_blocks * 512 for p in ws.iterdir())
    assert held <= 128 * MiB
    assert (ws / "keep.txt").stat().st_uid == sandbox_settings.sandbox_host_uid
    _assert_no_disk_left(sandbox_settings, ws)


@pytest.mark.podman
def test_a_flood_of_files_stops_at_the_inode_limit(
    sandbox_settings: Settings,
    make_workspace: Callable[[], Path],
    default_image: str,
    podman_boxes: SandboxTracker,
) -> None:
    ws = make_workspace()
    spec = spec_from_boxfile(_box(disk="256MiB", inodes=2048), sandbox_settings, workspace=ws)
    flood = (
        "import os\n"
        "n = 0\n"
        "try:\n"
        "    for i in range(20000):\n"
        "        open(f'/workspace/f{i}', 'w').close(); n += 1\n"
        "except OSError as e:\n"
        "    print('stopped', n, e.errno)\n"
    )
    res = podman_boxes.run(spec, ["python3", "-c", flood])
    out = res.stdout.decode()
    assert out.startswith("stopped"), (out, res.stderr.decode())
    made, errno_ = int(out.split()[1]), int(out.split()[2])
    assert errno_ == 28 and made < 2048  # ENOSPC: no inode left
    assert len(list(ws.iterdir())) == made  # all copied back for collection
    _assert_no_disk_left(sandbox_settings, ws)


@pytest.mark.podman
def test_copy_back_keeps_links_holes_fifos_and_modes_as_the_agent_left_them(
    sandbox_settings: Settings,
    make_workspace: Callable[[], Path],
    default_image: str,
    podman_boxes: SandboxTracker,
) -> None:
    ws = make_workspace()
    spec = spec_from_boxfile(_box(disk="256MiB"), sandbox_settings, workspace=ws)
    script = (
        "cd /workspace && mkdir -p d/e && echo x > d/e/f && ln d/e/f d/hard && "
        "ln -s e/f d/sym && ln -s /etc/shadow out && truncate -s 100G sparse && "
        "echo data > suid && chmod 4755 suid && mkfifo fifo && echo ok"
    )
    res = podman_boxes.run(spec, ["sh", "-c", script])
    assert res.stdout.decode().strip() == "ok", res.stderr.decode()
    assert (ws / "d/e/f").read_text() == "x\n"
    assert (ws / "d/hard").stat().st_ino == (ws / "d/e/f").stat().st_ino
    assert os.readlink(ws / "d/sym") == "e/f" and os.readlink(ws / "out") == "/etc/shadow"
    sparse = (ws / "sparse").stat()
    assert sparse.st_size == 100 * 1024**3 and sparse.st_blocks == 0
    # As a bind mount showed them: collection (the trusted reader) skips the FIFO and
    # drops and reports the setuid bit (the e2e attack corpus checks the report).
    assert (ws / "suid").stat().st_mode & 0o7777 == 0o4755
    assert stat.S_ISFIFO((ws / "fifo").lstat().st_mode)
    assert (ws / "d/e/f").stat().st_uid == sandbox_settings.sandbox_host_uid
    _assert_no_disk_left(sandbox_settings, ws)


@pytest.mark.podman
def test_created_sandbox_keeps_its_disk_until_destroyed(
    sandbox_settings: Settings,
    make_workspace: Callable[[], Path],
    default_image: str,
    podman_boxes: SandboxTracker,
) -> None:
    ws = make_workspace()
    spec = spec_from_boxfile(_box(disk="96MiB"), sandbox_settings, workspace=ws)
    box = podman_boxes.create(spec)
    try:
        res = box.exec(["sh", "-c", "echo one > /workspace/a; fallocate -l 1G /workspace/b"])
        assert res.exit_code != 0 and b"No space left" in res.stderr
        assert os.path.ismount(ws)
        assert box.exec(["cat", "/workspace/a"]).stdout == b"one\n"
    finally:
        box.destroy()
    assert (ws / "a").read_text() == "one\n"
    _assert_no_disk_left(sandbox_settings, ws)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a workspace disk needs root")
def test_a_disk_whose_owner_died_is_copied_back_and_unmounted(
    sandbox_settings: Settings, make_workspace: Callable[[], Path]
) -> None:
    ws = make_workspace()
    _seed(ws, sandbox_settings)
    disk = WorkspaceDisk(sandbox_settings, "orphan-test", ws, DiskLimit(size=64 * MiB, inodes=4096))
    disk.mount()
    try:
        assert os.path.ismount(ws)
        (ws / "late.txt").write_text("written on the disk\n")
        # The owner "dies": the record now names a process that has exited.
        dead = subprocess.Popen(["true"])
        dead.wait()
        rec = json.loads(disk.record.read_text())
        disk.record.write_text(json.dumps({**rec, "pid": dead.pid}))
        assert settle_orphan_disks(sandbox_settings) == ["orphan-test"]
        assert not os.path.ismount(ws)
        assert (ws / "late.txt").read_text() == "written on the disk\n"
        assert (ws / "keep.txt").exists()
        _assert_no_disk_left(sandbox_settings, ws)
    finally:
        if os.path.ismount(ws):
            subprocess.run(["umount", "--lazy", str(ws)], check=False)
        disk.image.unlink(missing_ok=True)
        disk.record.unlink(missing_ok=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a workspace disk needs root")
def test_a_live_owners_disk_is_left_alone(
    sandbox_settings: Settings, make_workspace: Callable[[], Path]
) -> None:
    ws = make_workspace()
    disk = WorkspaceDisk(sandbox_settings, "live-test", ws, DiskLimit(size=64 * MiB, inodes=4096))
    disk.mount()
    try:
        assert settle_orphan_disks(sandbox_settings) == []
        assert os.path.ismount(ws)
    finally:
        disk.release()
    _assert_no_disk_left(sandbox_settings, ws)


def test_disk_limit_is_clamped_by_the_host(settings: Settings) -> None:
    box = _box(disk="1TiB")
    small = settings.model_copy(update={"max_disk": 10 * 1024**3, "max_inodes": 5000})
    assert box.resources.disk_limit(small) == DiskLimit(size=10 * 1024**3, inodes=5000)
    default = Boxfile().resources.disk_limit(settings)
    assert default.size == 20 * 1024**3 and default.inodes == 20 * 1024**3 // 16384
    assert _box(disk="1GiB", inodes=3000).resources.disk_limit(settings).inodes == 3000


_OWNER = """
import sys
from pathlib import Path
from agentbox.backends.podman import PodmanBackend
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.sandbox import spec_from_boxfile
settings = Settings(data_dir=Path(sys.argv[1]))
box = Boxfile.from_dict({"resources": {"disk": "96MiB"}})
spec = spec_from_boxfile(box, settings, name=sys.argv[3], workspace=Path(sys.argv[2]))
PodmanBackend(settings).run(spec, ["sh", "-c", "echo mine > /workspace/f; exec sleep 300"])
"""


@pytest.mark.podman
def test_reap_after_the_owner_was_killed_saves_the_work_and_unmounts(
    sandbox_settings: Settings,
    make_workspace: Callable[[], Path],
    default_image: str,
    podman_boxes: SandboxTracker,
) -> None:
    import signal
    import sys

    ws = make_workspace()
    name = f"agentbox-reap-{os.getpid()}"
    podman_boxes.track(name)  # made by the owner process
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(sandbox_settings.data_dir), str(ws), name]
    )
    try:
        deadline = time.monotonic() + 120
        while not (ws / "f").exists():  # written on the mounted disk
            assert owner.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert os.path.ismount(ws)
        owner.send_signal(signal.SIGKILL)
        while psutil.Process(owner.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)
        assert os.path.ismount(ws)  # nobody released it
        # Reaped the moment it died: the owner is still a zombie (nobody waited for it).
        assert PodmanBackend(sandbox_settings).reap(name) == [name]
        owner.wait()
        assert not os.path.ismount(ws)
        assert (ws / "f").read_text() == "mine\n"
        _assert_no_disk_left(sandbox_settings, ws)
    finally:
        owner.kill()
        PodmanBackend(sandbox_settings).kill(name)
        if os.path.ismount(ws):
            subprocess.run(["umount", "--lazy", str(ws)], check=False)


@pytest.mark.podman
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_escape_suites_disk_probe_passes(
    sandbox_settings: Settings,
    make_workspace: Callable[[], Path],
    default_image: str,
    runtime: str,
    podman_boxes: SandboxTracker,
) -> None:
    from agentbox.escape._runner import run_probe_program

    box = Boxfile.from_dict({"runtime": runtime, "resources": {"disk": "96MiB"}})
    spec = spec_from_boxfile(box, sandbox_settings, workspace=make_workspace())
    limit = spec.resources.disk_limit(sandbox_settings)
    with podman_boxes.create(spec) as sb:
        data = run_probe_program(
            sb, {"disk": limit.model_dump(), "workspace": "/workspace"}, ["--only", "limits.disk"]
        )
        image = sandbox_settings.data_dir / "disks" / f"{spec.name}.img"
        # fallocate inside marks extents unwritten: the host's sparse image stays small.
        assert image.stat().st_blocks * 512 < 32 * MiB
    r = data["results"]["limits.disk"]
    assert r["ok"] is True and "ENOSPC" in r["seen"], r


@pytest.mark.podman
def test_a_workspace_larger_than_the_limit_is_refused_clearly(
    sandbox_settings: Settings,
    make_workspace: Callable[[], Path],
    default_image: str,
    podman_boxes: SandboxTracker,
) -> None:
    from agentbox.errors import SandboxError

    ws = make_workspace()
    (ws / "big.bin").write_bytes(os.urandom(80 * MiB))
    spec = spec_from_boxfile(_box(disk="64MiB"), sandbox_settings, workspace=ws)
    with pytest.raises(SandboxError, match="does not fit in its disk limit"):
        podman_boxes.run(spec, ["true"])
    assert (ws / "big.bin").stat().st_size == 80 * MiB
    _assert_no_disk_left(sandbox_settings, ws)


@pytest.mark.podman
def test_a_workspace_in_use_by_another_sandbox_is_refused(
    sandbox_settings: Settings,
    make_workspace: Callable[[], Path],
    default_image: str,
    podman_boxes: SandboxTracker,
) -> None:
    from agentbox.errors import SandboxError

    ws = make_workspace()
    first = podman_boxes.create(
        spec_from_boxfile(_box(disk="64MiB"), sandbox_settings, workspace=ws)
    )
    try:
        second = spec_from_boxfile(_box(disk="64MiB"), sandbox_settings, workspace=ws)
        with pytest.raises(SandboxError, match="mount point"):
            podman_boxes.run(second, ["true"])
        assert os.path.ismount(ws)  # the first sandbox's disk is untouched
    finally:
        first.destroy()
    _assert_no_disk_left(sandbox_settings, ws)


@pytest.mark.podman
def test_only_what_the_sandbox_changed_is_copied_back(
    sandbox_settings: Settings,
    make_workspace: Callable[[], Path],
    default_image: str,
    podman_boxes: SandboxTracker,
) -> None:
    ws = make_workspace()
    uid = sandbox_settings.sandbox_host_uid
    files = [("same.txt", "same\n"), ("edit.txt", "old\n"), ("gone.txt", "x\n"),
             ("mode.sh", "echo\n"), ("d/keep.txt", "k\n"), ("swap", "file\n")]  # fmt: skip
    for rel, text in files:
        p = ws / rel
        p.parent.mkdir(exist_ok=True)
        p.write_text(text)
    for p in [ws / "d", *ws.rglob("*")]:
        os.chown(p, uid, uid)
    before = {p.name: p.stat() for p in (ws / "same.txt", ws / "d/keep.txt", ws / "edit.txt")}
    d_before = (ws / "d").stat()
    spec = spec_from_boxfile(_box(disk="96MiB"), sandbox_settings, workspace=ws)
    script = (
        "cd /workspace && echo new > edit.txt && rm gone.txt && chmod 755 mode.sh && "
        "rm swap && mkdir swap && echo in > swap/f && echo added > added.txt && echo ok"
    )
    res = podman_boxes.run(spec, ["sh", "-c", script])
    assert res.stdout == b"ok\n", res.stderr
    # Untouched entries are the very same files: same inode, same ctime (collection's
    # stat cache still holds them); so is the untouched directory.
    for name, p in (("same.txt", ws / "same.txt"), ("keep.txt", ws / "d/keep.txt")):
        st = p.stat()
        assert (st.st_ino, st.st_ctime_ns) == (before[name].st_ino, before[name].st_ctime_ns)
    assert (ws / "d").stat().st_ctime_ns == d_before.st_ctime_ns
    assert (ws / "edit.txt").read_text() == "new\n"
    assert (ws / "edit.txt").stat().st_ctime_ns != before["edit.txt"].st_ctime_ns
    assert not (ws / "gone.txt").exists()
    assert (ws / "mode.sh").stat().st_mode & 0o777 == 0o755
    assert (ws / "swap/f").read_text() == "in\n" and (ws / "added.txt").read_text() == "added\n"
    _assert_no_disk_left(sandbox_settings, ws)
