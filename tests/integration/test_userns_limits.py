"""The per-sandbox caps on kernel counters charged to root (issue 18, item 2).

The OCI hook itself (the real sh script), with a real user namespace made and
mapped by root as runc does (no podman needed); the podman path is in
tests/integration/test_podman_kernel_quotas.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from agentbox.backends.oci._userns_limits import (
    HOOK_SCRIPT,
    HOST_SANDBOXES,
    HOST_SYSCTLS,
    SANDBOX_CAPS,
    hooks_dir,
    host_shortfall,
)


def test_host_limits_leave_room_for_many_sandboxes_at_their_caps() -> None:
    inst = HOST_SYSCTLS["fs.inotify.max_user_instances"]
    watches = HOST_SYSCTLS["fs.inotify.max_user_watches"]
    assert inst > HOST_SANDBOXES * SANDBOX_CAPS["max_inotify_instances"]
    assert watches > HOST_SANDBOXES * SANDBOX_CAPS["max_inotify_watches"]


def test_shortfall_reads_the_host_values(tmp_path: Path) -> None:
    d = tmp_path / "fs" / "inotify"
    d.mkdir(parents=True)
    (d / "max_user_instances").write_text("128\n")
    (d / "max_user_watches").write_text(f"{10**9}\n")
    short = host_shortfall(tmp_path)
    assert short == {
        "fs.inotify.max_user_instances": (128, HOST_SYSCTLS["fs.inotify.max_user_instances"])
    }


def test_hooks_dir_is_written_once_read_only_and_names_every_cap(tmp_path: Path) -> None:
    d1 = hooks_dir(tmp_path)
    d2 = hooks_dir(tmp_path)
    assert d1 == d2
    cfg_path = d1 / "agentbox-userns-limits.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["stages"] == ["prestart"] and cfg["when"] == {"always": True}
    assert cfg["hook"]["path"] == "/bin/sh"
    args = cfg["hook"]["args"]
    script = Path(args[1])
    assert script.read_text() == HOOK_SCRIPT
    assert script.stat().st_mode & 0o777 == 0o555
    assert cfg_path.stat().st_mode & 0o777 == 0o444
    assert set(args[2:]) == {f"{k}={v}" for k, v in SANDBOX_CAPS.items()}
    # runc's 10 s default failed starts when 40 sandboxes started at once on 2 cores.
    assert cfg["hook"]["timeout"] >= 60


def _hook(tmp_path: Path, state: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = hooks_dir(tmp_path).parent / "userns_hook.sh"
    return subprocess.run(
        ["/bin/sh", str(script), *args],
        input=state, capture_output=True, text=True, env={}, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    "bad", ["max_inotify_instances", "max_x=-1", "evil=1", "max_a=1;x", "max_A=1", "max_a="]
)
def test_hook_refuses_bad_arguments(tmp_path: Path, bad: str) -> None:
    res = _hook(tmp_path, f'{{"pid": {os.getpid()}}}', bad)
    assert res.returncode == 1 and "bad limit argument" in res.stderr


@pytest.mark.parametrize(
    "state", ["", "[]", '{"pid": 1}', '{"pid": "12"}', '{"pid": true}', '{"id": "x"}']
)
def test_hook_fails_closed_on_bad_state(tmp_path: Path, state: str) -> None:
    res = _hook(tmp_path, state, "max_inotify_instances=8")
    assert res.returncode == 1 and "no usable pid" in res.stderr


def test_hook_never_writes_the_hosts_own_limits(tmp_path: Path) -> None:
    before = Path("/proc/sys/user/max_inotify_instances").read_text()
    res = _hook(tmp_path, f'{{"pid": {os.getpid()}}}', "max_inotify_instances=3")
    assert res.returncode == 0, res.stderr
    assert Path("/proc/sys/user/max_inotify_instances").read_text() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the hook runs as root under runc)")
def test_hook_caps_a_real_user_namespace_from_outside(tmp_path: Path) -> None:
    # A user namespace made and mapped by root as runc does (0 -> 100000, 65536 ids);
    # the hook, run by root outside it, sets that namespace's own maximum, and the
    # host's stays as it was.
    before = Path("/proc/sys/user/max_inotify_instances").read_text()
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
        res = _hook(tmp_path, state, "max_inotify_instances=7", "max_user_namespaces=0")
        assert res.returncode == 0, res.stderr
        seen = subprocess.run(
            ["nsenter", "-U", "-t", str(child.pid), "--preserve-credentials",
             "cat", "/proc/sys/user/max_inotify_instances", "/proc/sys/user/max_user_namespaces"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.split()  # fmt: skip
        assert seen == ["7", "0"]
    finally:
        child.kill()
        child.wait()
    assert Path("/proc/sys/user/max_inotify_instances").read_text() == before


def test_doctor_row_names_the_shortfall_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbox.backends.podman import _doctor
    from agentbox.backends.podman._doctor import _kernel_quotas

    # The podman backend's doctor rows read it.
    monkeypatch.setattr(
        _doctor,
        "host_shortfall",
        lambda: {"fs.inotify.max_user_instances": (128, 8320)},
    )
    fac = _kernel_quotas()
    assert not fac.ok
    assert "max_user_instances=128" in fac.detail and "8320" in fac.detail
    assert "setup.sh" in fac.fix and "sysctl -w fs.inotify.max_user_instances=" in fac.fix
    monkeypatch.setattr(_doctor, "host_shortfall", lambda: {})
    assert _kernel_quotas().ok


def test_hooks_dir_refuses_a_hook_others_could_have_written(tmp_path: Path) -> None:
    from agentbox.errors import UnsupportedError

    hooks = hooks_dir(tmp_path)
    script = hooks.parent / "userns_hook.sh"
    script.chmod(0o777)
    with pytest.raises(UnsupportedError, match="writable by others"):
        hooks_dir(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the hook runs as root under runc)")
def test_hook_leaves_a_namespace_without_uid_0_alone(tmp_path: Path) -> None:
    # gVisor's sandbox process sits in such a namespace: nothing to act as, nothing to cap.
    child = subprocess.Popen(["unshare", "--user", "sleep", "30"])
    try:
        ns = Path(f"/proc/{child.pid}/ns/user")
        for _ in range(500):
            if ns.exists() and ns.readlink() != Path("/proc/self/ns/user").readlink():
                break
            time.sleep(0.01)
        res = _hook(tmp_path, json.dumps({"pid": child.pid}), "max_inotify_instances=7")
        assert res.returncode == 0, res.stderr
        seen = subprocess.run(
            ["nsenter", "-U", "-t", str(child.pid), "--preserve-credentials",
             "cat", "/proc/sys/user/max_inotify_instances"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
        assert seen != "7"
    finally:
        child.kill()
        child.wait()
