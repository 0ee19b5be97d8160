"""What the userns-limits hook costs every sandbox's start: the processes it runs.

runc runs the hook (``_userns_limits.HOOK_SCRIPT``) synchronously inside ``runc
create``, so each process it starts delays every podman sandbox's start. The real
script runs here under ``strace -f -e trace=execve`` against a real user namespace
made and mapped as runc does, and must still cap it; a count, not a time, so it
fails when a change adds a process per start, whatever the machine's load.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from agentbox.backends.oci._userns_limits import SANDBOX_CAPS, hooks_dir

pytestmark = [
    pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the hook runs as root under runc)"),
]

#: sh, nsenter, the sh it execs, one cat reading every value back (20 before: head,
#: tr, sed, readlink x3, grep and a cat per value).
BUDGET = 4


def test_the_hook_caps_a_namespace_in_at_most_four_processes(tmp_path: Path) -> None:
    script = hooks_dir(tmp_path / "cache").parent / "userns_hook.sh"
    child = subprocess.Popen(["unshare", "--user", "sleep", "30"])
    try:
        ns = Path(f"/proc/{child.pid}/ns/user")
        for _ in range(500):
            if ns.exists() and ns.readlink() != Path("/proc/self/ns/user").readlink():
                break
            time.sleep(0.01)
        for kind in ("uid_map", "gid_map"):
            Path(f"/proc/{child.pid}/{kind}").write_text("0 100000 65536\n")
        state = json.dumps({"ociVersion": "1.0.2", "id": "x", "pid": child.pid, "bundle": "/"})
        trace = tmp_path / "trace"
        args = [f"{k}={v}" for k, v in sorted(SANDBOX_CAPS.items())]
        res = subprocess.run(
            ["strace", "-f", "-qq", "-e", "trace=execve", "-o", str(trace),
             "/bin/sh", str(script), *args],
            input=state, capture_output=True, text=True, env={}, timeout=60, check=False,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        seen = subprocess.run(
            ["nsenter", "-U", "-t", str(child.pid), "--preserve-credentials", "cat",
             *(f"/proc/sys/user/{k}" for k in sorted(SANDBOX_CAPS))],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.split()  # fmt: skip
    finally:
        child.kill()
        child.wait()
    assert seen == [str(v) for _, v in sorted(SANDBOX_CAPS.items())]
    # execve lines that succeeded (a PATH search also logs the failed tries).
    execs = [ln for ln in trace.read_text().splitlines() if "execve(" in ln and "= 0" in ln]
    assert len(execs) <= BUDGET, "\n".join(execs)


def test_a_value_the_kernel_refuses_fails_the_start(tmp_path: Path) -> None:
    """A cap the kernel refuses (past its range) fails the hook: runc would not start
    the container (the hook fails closed)."""
    script = hooks_dir(tmp_path / "cache").parent / "userns_hook.sh"
    child = subprocess.Popen(["unshare", "--user", "sleep", "30"])
    try:
        ns = Path(f"/proc/{child.pid}/ns/user")
        for _ in range(500):
            if ns.exists() and ns.readlink() != Path("/proc/self/ns/user").readlink():
                break
            time.sleep(0.01)
        for kind in ("uid_map", "gid_map"):
            Path(f"/proc/{child.pid}/{kind}").write_text("0 100000 65536\n")
        res = subprocess.run(
            ["/bin/sh", str(script), "max_inotify_instances=7", "max_user_namespaces=99999999999"],
            input=json.dumps({"pid": child.pid}), capture_output=True, text=True, env={},
            timeout=60, check=False,
        )  # fmt: skip
    finally:
        child.kill()
        child.wait()
    assert res.returncode != 0
