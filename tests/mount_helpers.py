"""Mounts a test leaves behind: none may remain under its data dir (issue 19).

A workspace disk (``backends/_wsdisk.py``) is a loop mount over a task's workspace,
and settling one reaches the directory under it; a launcher killed at the wrong
moment, or two settlers racing, used to leave ``…/workspace`` mounted from a deleted
image or a ``disks/.settle-*`` bind mount of the root filesystem. Every live-restore,
owner-signal and detached test asserts with :func:`assert_no_mounts_under` that its
data dir holds no mount when it ends.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_under(root: Path) -> list[str]:
    """Mount points at or under ``root`` in this mount namespace, with their source."""
    base = str(Path(root).resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        target = _unescape(fields[4])
        if target == base or target.startswith(base + "/"):
            dash = fields.index("-")
            found.append(f"{fields[dash + 2]} on {target} (root {_unescape(fields[3])})")
    return found


def loops_under(root: Path) -> list[str]:
    """Loop devices whose backing file is (or was) under ``root``."""
    base = str(Path(root).resolve())
    res = subprocess.run(
        ["losetup", "-n", "-O", "NAME,BACK-FILE"], capture_output=True, text=True, check=False
    )
    return [line for line in res.stdout.splitlines() if base + "/" in line]


def assert_no_mounts_under(root: Path, *, clean: bool = True) -> None:
    """Fail if a mount (or a loop device of an image) under ``root`` remains.

    With ``clean`` what is found is unmounted first (lazily), so that the caller's
    ``rmtree`` of ``root`` neither fails nor reaches through a leaked mount. The loop
    device goes with its filesystem's last user, which a container's mount namespace
    may hold a moment past its end: a bounded wait for that, not a speed assertion.
    A mount still there 30 s on is a leak (a task's disk is settled by its follower,
    which may be a moment behind the test: a bounded wait, not a speed assertion).
    """
    end = time.monotonic() + 30
    while (left := mounts_under(root)) and time.monotonic() < end:
        time.sleep(0.2)
    if clean:
        for m in reversed(left):
            target = m.split(" on ", 1)[1].rsplit(" (root ", 1)[0]
            subprocess.run(["umount", "--lazy", target], capture_output=True, check=False)
    assert left == [], f"mounts left under {root}: {left}"
    end = time.monotonic() + 60
    while (loops := loops_under(root)) and time.monotonic() < end:
        time.sleep(0.2)
    assert loops == [], f"loop devices left on images under {root}: {loops} {_holders(loops)}"


def _holders(loops: list[str]) -> list[str]:
    """The processes whose mount namespace still mounts these loop devices."""
    found = []
    for line in loops:
        dev = line.split()[0]
        try:
            rdev = os.stat(dev).st_rdev
        except OSError:
            continue
        want = f" {os.major(rdev)}:{os.minor(rdev)} "
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if want in proc.joinpath("mountinfo").read_text():
                    cmd = proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ")
                    ns = os.readlink(proc / "ns" / "mnt")
                    found.append(f"{dev} held by pid {proc.name} ({ns}): {cmd[:200]!r}")
            except OSError:
                continue
    return found
