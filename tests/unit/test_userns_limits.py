"""The per-sandbox caps on kernel counters charged to root (issue 18, item 2).

The OCI hook's own logic, with a real user namespace where we are root (no
podman needed); the podman path is in tests/integration/test_podman_kernel_quotas.py.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentbox.backends import _userns_hook as hook
from agentbox.backends._userns_limits import (
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
    d1 = hooks_dir(tmp_path, python="/usr/bin/python3")
    d2 = hooks_dir(tmp_path, python="/usr/bin/python3")
    assert d1 == d2
    cfg_path = d1 / "agentbox-userns-limits.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["stages"] == ["prestart"] and cfg["when"] == {"always": True}
    args = cfg["hook"]["args"]
    script = Path(args[3])
    assert script.read_bytes() == Path(hook.__file__).read_bytes()
    assert script.stat().st_mode & 0o777 == 0o555
    assert cfg_path.stat().st_mode & 0o777 == 0o444
    assert {a for a in args[4:]} == {f"{k}={v}" for k, v in SANDBOX_CAPS.items()}


@pytest.mark.parametrize("bad", ["max_inotify_instances", "max_x=-1", "evil=1", "max_a=1; rm"])
def test_hook_refuses_bad_arguments(bad: str) -> None:
    with pytest.raises(ValueError):
        hook._parse([bad])


@pytest.mark.parametrize(
    "state", ["", "[]", '{"pid": 1}', '{"pid": "12"}', '{"pid": true}', '{"id": "x"}']
)
def test_hook_fails_closed_on_bad_state(state: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(state))
    assert hook.main(["max_inotify_instances=8"]) == 1


def test_hook_never_writes_the_hosts_own_limits() -> None:
    before = Path("/proc/sys/user/max_inotify_instances").read_text()
    out = hook.apply(os.getpid(), {"max_inotify_instances": 3})
    assert "nothing to cap" in out
    assert Path("/proc/sys/user/max_inotify_instances").read_text() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the hook runs as root under runc)")
def test_hook_caps_a_real_user_namespace_from_outside() -> None:
    # A process in a fresh user namespace (made by root, as runc does): the hook, run
    # by root outside it, sets that namespace's own maximum; the host's stays as it was.
    before = Path("/proc/sys/user/max_inotify_instances").read_text()
    child = subprocess.Popen(["unshare", "--user", "sleep", "30"])
    try:
        for _ in range(200):
            ns = Path(f"/proc/{child.pid}/ns/user")
            if ns.exists() and ns.readlink() != Path("/proc/self/ns/user").readlink():
                break
            subprocess.run(["sleep", "0.01"], check=True)
        code = (
            "import sys; from agentbox.backends import _userns_hook as h; "
            f"print(h.apply({child.pid}, {{'max_inotify_instances': 7, "
            "'max_user_namespaces': 0}))"
        )
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
        )
        assert "max_inotify_instances=7" in res.stdout
        seen = subprocess.run(
            ["nsenter", "-U", "-t", str(child.pid), "--preserve-credentials",
             "cat", "/proc/sys/user/max_inotify_instances"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        assert seen.strip() == "7"
    finally:
        child.kill()
        child.wait()
    assert Path("/proc/sys/user/max_inotify_instances").read_text() == before


def test_doctor_row_names_the_shortfall_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbox.backends import _userns_limits
    from agentbox.cli._doctor import _kernel_quotas

    monkeypatch.setattr(
        _userns_limits,
        "host_shortfall",
        lambda: {"fs.inotify.max_user_instances": (128, 8320)},
    )
    fac = _kernel_quotas()
    assert not fac.ok
    assert "max_user_instances=128" in fac.detail and "8320" in fac.detail
    assert "setup.sh" in fac.fix and "sysctl -w fs.inotify.max_user_instances=" in fac.fix
    monkeypatch.setattr(_userns_limits, "host_shortfall", lambda: {})
    assert _kernel_quotas().ok


def test_hooks_dir_refuses_a_hook_others_could_have_written(tmp_path: Path) -> None:
    from agentbox.errors import UnsupportedError

    hooks = hooks_dir(tmp_path, python="/usr/bin/python3")
    script = hooks.parent / "userns_hook.py"
    script.chmod(0o777)
    with pytest.raises(UnsupportedError, match="writable by others"):
        hooks_dir(tmp_path, python="/usr/bin/python3")
