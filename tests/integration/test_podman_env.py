"""Environment values reach the sandbox through a sealed memfd and are never on disk.

A task's one-time gateway token travels in the environment. It must arrive in the
sandbox, never appear in a file (where a SIGKILLed caller would leave it), and never
be held by any process but ours and the podman client we started (not conmon, not
the runtime, not the sandbox). Checked with real podman for ``run`` (foreground),
``run -d`` (:meth:`PodmanBackend.create`) and ``exec``; the interactive path is in
test_podman_shell.py. Every sandbox goes through the leak guard (``sandbox_factory``),
which also checks that no env memfd stays open in the test process.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from agentbox.backends.base import SandboxSpec
from agentbox.backends.oci._cli import ENV_MEMFD_NAME, env_file
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.errors import ConfigError
from agentbox.sandbox import spec_from_boxfile
from sandbox_leaks import SandboxTracker

TMP = Path(tempfile.gettempdir())
#: Shell that prints the two values, then lingers so the host can look while it runs.
SHOW = 'printf "%s|%s\\n" "$AB_TOKEN" "$AB_ODD"; sleep 1'
ODD = "a b='c' \"d\" $HOME =x"


def _traces(*roots: Path) -> set[Path]:
    """Every ``agentbox-env*`` entry in the temp dir and under each root."""
    found = set(TMP.glob("agentbox-env*"))
    for root in roots:
        found |= set(root.rglob("agentbox-env*"))
    return found


def _our_memfds() -> set[tuple[int, int]]:
    """(dev, inode) of every env memfd this process holds right now."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{ENV_MEMFD_NAME}"):
                st = os.stat(f"/proc/self/fd/{fd}")
                found.add((st.st_dev, st.st_ino))
        except OSError:
            continue
    return found


def _holders(files: set[tuple[int, int]]) -> set[int]:
    """Pids of every process holding one of ``files`` open."""
    pids = set()
    for proc in psutil.process_iter(["pid"]):
        pid = proc.info["pid"]
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in files:
                pids.add(pid)
    return pids


def _allowed_holders() -> set[int]:
    """Us and the podman clients we started directly."""
    me = psutil.Process()
    return {me.pid} | {c.pid for c in me.children() if c.name() == "podman"}


@pytest.fixture
def token() -> str:
    return f"tok-{secrets.token_hex(16)}"


def _spec(settings: Settings, token: str) -> SandboxSpec:
    return spec_from_boxfile(Boxfile(), settings, extra_env={"AB_TOKEN": token, "AB_ODD": ODD})


# --- the memfd itself ----------------------------------------------------------------------


def test_env_file_is_a_sealed_memfd_with_the_values() -> None:
    before = _traces()
    with env_file({"A": "1", "B": "x y=z"}) as envf:
        assert os.readlink(envf.path).startswith(f"/memfd:{ENV_MEMFD_NAME}")
        assert envf.path.read_text() == "A=1\nB=x y=z\n"
        assert not os.get_inheritable(envf.fd), "a child would inherit it (and hand it on)"
        with pytest.raises(PermissionError):  # sealed: F_SEAL_WRITE
            os.write(envf.fd, b"C=3\n")
        assert _traces() == before
    with pytest.raises(OSError):
        os.fstat(envf.fd)  # closed on exit
    with pytest.raises(ConfigError), env_file({"A": "1\nB=2"}):
        pass


KILLED = r"""
import os, signal, sys
from agentbox.backends.oci._cli import env_file
with env_file({"AB_TOKEN": sys.argv[1]}) as envf:
    print(envf.path, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_sigkilled_caller_leaves_nothing_on_disk(token: str) -> None:
    before = _traces()
    proc = subprocess.run(
        [sys.executable, "-c", KILLED, token], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.startswith("/proc/") and "/fd/" in proc.stdout
    assert _traces() == before


# --- through real podman -------------------------------------------------------------------

pod = pytest.mark.podman


@pod
def test_run_gets_the_values_and_nothing_else_holds_them(
    sandbox_settings: Settings, default_image: str, token: str, podman_boxes: SandboxTracker
) -> None:
    before = _traces(sandbox_settings.data_dir)
    seen: dict[str, object] = {}

    def look(chunk: bytes) -> None:
        if "holders" not in seen:
            files = _our_memfds()
            seen["files"] = files
            seen["holders"] = _holders(files) - _allowed_holders()
            seen["traces"] = _traces(sandbox_settings.data_dir) - before
        seen["out"] = seen.get("out", b"") + chunk  # type: ignore[operator]

    spec = _spec(sandbox_settings, token)
    res = podman_boxes.run(spec, ["sh", "-c", SHOW], on_stdout=look)
    assert res.exit_code == 0, res.stderr
    assert seen["out"] == f"{token}|{ODD}\n".encode()
    assert seen["files"], "the run held no env memfd while the sandbox ran"
    assert seen["holders"] == set(), "conmon, the runtime or the sandbox holds it"
    assert seen["traces"] == set()
    assert _traces(sandbox_settings.data_dir) == before


@pod
def test_create_and_exec_get_the_values_and_nothing_else_holds_them(
    sandbox_settings: Settings, default_image: str, token: str, podman_boxes: SandboxTracker
) -> None:
    before = _traces(sandbox_settings.data_dir)
    spec = _spec(sandbox_settings, token)
    with podman_boxes.create(spec) as box:
        # run -d: the values are the sandbox's own environment (pid 1's).
        res = box.exec(["sh", "-c", 'tr "\\0" "\\n" </proc/1/environ | grep ^AB_TOKEN='])
        assert res.stdout.decode().strip() == f"AB_TOKEN={token}"
        # Our memfd for run -d is closed; if conmon or the sandbox had inherited it,
        # it would still be open somewhere: look at every process of this container.
        pids = _container_pids(box.name)
        assert pids, "found no process of the sandbox"
        assert not [p for p in pids if _holds_env_memfd(p)]

        seen: dict[str, object] = {}

        def look(chunk: bytes) -> None:
            if "holders" not in seen:
                seen["files"] = files = _our_memfds()
                seen["holders"] = _holders(files) - _allowed_holders()
                seen["traces"] = _traces(sandbox_settings.data_dir) - before

        other = f"other-{secrets.token_hex(4)}"
        res = box.exec(["sh", "-c", SHOW], env={"AB_TOKEN": other, "AB_ODD": ODD}, on_stdout=look)
        assert res.exit_code == 0
        assert seen["files"] and seen["holders"] == set() and seen["traces"] == set()
        out = box.exec(
            ["sh", "-c", 'printf "%s|%s\\n" "$AB_TOKEN" "$AB_ODD"'],
            env={"AB_TOKEN": other, "AB_ODD": ODD},
        )
        assert out.stdout == f"{other}|{ODD}\n".encode()
    assert _traces(sandbox_settings.data_dir) == before


def _container_pids(name: str) -> list[int]:
    res = subprocess.run(
        ["podman", "inspect", "--format", "{{.State.ConmonPid}} {{.State.Pid}}", name],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    pids: list[int] = []
    for top in (int(x) for x in res.stdout.split()):
        try:
            proc = psutil.Process(top)
            pids += [top, *(c.pid for c in proc.children(recursive=True))]
        except psutil.Error:
            continue
    return pids


def _holds_env_memfd(pid: int) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{ENV_MEMFD_NAME}"):
                return True
        except OSError:
            continue
    return False


RUN_KILLED = r"""
import os, signal, sys
from agentbox.backends.base import SandboxSpec
from agentbox.backends.podman import PodmanBackend
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.sandbox import spec_from_boxfile
s = Settings()
spec = spec_from_boxfile(Boxfile(), s, name=sys.argv[1], extra_env={"AB_TOKEN": sys.argv[2]})
def up(chunk):
    print("up", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no finally, no atexit: what a crash leaves
PodmanBackend(s).run(spec, ["sh", "-c", "echo up; exec sleep 120"], on_stdout=up)
"""


@pod
def test_a_sigkilled_podman_caller_leaves_no_env_on_disk(
    sandbox_settings: Settings, default_image: str, token: str, podman_boxes: SandboxTracker
) -> None:
    before = _traces(sandbox_settings.data_dir)
    name = f"agentbox-envkill-{os.getpid()}"
    podman_boxes.track(name)  # made by the killed caller
    env = {"PATH": os.environ["PATH"], "AGENTBOX_DATA_DIR": str(sandbox_settings.data_dir)}
    proc = subprocess.run(
        [sys.executable, "-c", RUN_KILLED, name, token],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    try:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        assert proc.stdout.strip() == "up"
        assert _traces(sandbox_settings.data_dir) == before
    finally:
        removed = podman_boxes.backend.cleanup_orphans()
    assert name in removed
