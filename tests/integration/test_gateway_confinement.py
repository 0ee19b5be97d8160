"""The launcher's gateway is not root, is confined and bounded (issue 11 item 4).

Real processes: the gateway is spawned exactly as ``run_task`` spawns it (with
``run_as=gateway_identity(settings)``), in a task directory laid out like the
launcher's (root-only), and read from ``/proc`` with the escape suite's own
host check (:func:`agentbox.escape._hostcheck.gateway_posture`). Each check has
a positive control: the same gateway spawned the old way (no ``run_as``) fails it.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.config import Settings
from agentbox.errors import GatewayError
from agentbox.escape._hostcheck import gateway_posture
from agentbox.gateway import GatewayHandle, gateway_identity, read_usage, spawn_gateway
from gateway_helpers import CHAT_SCRIPT, wait_usage, write_script

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the gateway drops from root only")


def _task_dir(tmp_path: Path) -> Path:
    """A task dir like the launcher's: root-owned 0700 (the gateway uid cannot traverse it)."""
    root = tmp_path / "tasks" / "t1"
    root.mkdir(parents=True)
    (tmp_path / "tasks").chmod(0o700)
    root.chmod(0o700)
    (root / "gw").mkdir(mode=0o755)
    (root / "logs").mkdir(mode=0o700)
    return root


def _spawn(tmp_path: Path, settings: Settings, *, confined: bool, **kw: Any) -> GatewayHandle:
    root = _task_dir(tmp_path)
    token_file = root / "token"
    token_file.write_text(secrets.token_urlsafe(24))
    token_file.chmod(0o600)
    return spawn_gateway(
        socket_path=root / "gw" / "gateway.sock",
        token_file=token_file,
        model="replay-demo",
        budget=10**9,
        usage_file=root / "usage.json",
        settings=settings,
        replay_script=write_script(tmp_path, CHAT_SCRIPT),
        log_file=root / "logs" / "gateway.log",
        run_as=gateway_identity(settings) if confined else None,
        **kw,
    )


@pytest.fixture
def confined(tmp_path: Path, settings: Settings) -> Iterator[GatewayHandle]:
    with _spawn(tmp_path, settings, confined=True) as gw:
        yield gw


def _client(gw: GatewayHandle) -> httpx.Client:
    token = (gw.socket_path.parent.parent / "token").read_text()
    transport = httpx.HTTPTransport(uds=str(gw.socket_path))
    return httpx.Client(
        transport=transport, base_url="http://gw", timeout=60, headers={"x-api-key": token}
    )


HI = {"max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}


def test_launcher_gateway_posture(confined: GatewayHandle, settings: Settings) -> None:
    identity = gateway_identity(settings)
    assert identity is not None and identity[0] not in (0, settings.sandbox_host_uid)
    checks = gateway_posture(confined.pid, want_uid=identity[0])
    assert [c for c in checks if not c[1]] == [], checks
    # It serves, and the launcher reads its usage through the link it made.
    with _client(confined) as c:
        assert c.post("/v1/messages", json=HI).status_code == 200
    u = wait_usage(confined.usage_file, lambda u: u.output > 0)
    assert u.output == 7
    state = confined.usage_file.with_name("usage.json.d")
    assert confined.usage_file.is_symlink() and state.stat().st_uid == identity[0]


def test_control_unconfined_gateway_fails_the_posture(tmp_path: Path, settings: Settings) -> None:
    """Positive control: the gateway as run_task started it before (root, no filter)."""
    identity = gateway_identity(settings)
    assert identity is not None
    with _spawn(tmp_path, settings, confined=False) as gw:
        failed = {c[0] for c in gateway_posture(gw.pid, want_uid=identity[0]) if not c[1]}
    assert {"gateway.uid", "gateway.caps", "gateway.no_new_privs", "gateway.seccomp"} <= failed


def test_run_task_spawns_the_gateway_confined() -> None:
    """run_task passes the dedicated identity (read from its source: no launcher needed)."""
    import inspect

    from agentbox.launcher import _runner

    src = inspect.getsource(_runner.run_task)
    assert "run_as=gateway_identity(settings)" in src


CHILD = textwrap.dedent(
    """
    import ctypes, errno, json, os, socket, sys, threading
    from agentbox.gateway._confine import confine, prebuild
    if sys.argv[1] == "compiled":  # as the template does: compiled once, loaded by a fork
        prebuild()
    if sys.argv[1] in ("confined", "compiled"):
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
        confine()
    libc = ctypes.CDLL(None, use_errno=True)
    out = {}
    def attempt(name, fn):
        try:
            fn(); out[name] = "ok"
        except OSError as exc:
            out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
    def exec_true():
        pid = os.fork()
        if pid == 0:
            try:
                os.execv("/bin/true", ["true"])
            except OSError as exc:
                os._exit(exc.errno)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code:
            raise OSError(code, "exec")
    def unshare_user():
        pid = os.fork()
        if pid == 0:
            os._exit(0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno())
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code:
            raise OSError(code, "unshare")
    attempt("exec", exec_true)
    attempt("unshare_user", unshare_user)
    attempt("vsock", lambda: socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close())
    attempt("packet", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close())
    attempt("alg", lambda: socket.socket(socket.AF_ALG, socket.SOCK_SEQPACKET).close())
    attempt("unix", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close())
    attempt("inet", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close())
    t = threading.Thread(target=lambda: out.__setitem__("thread", "ok")); t.start(); t.join()
    print(json.dumps(out))
    """
)


def _child(mode: str) -> dict[str, str]:
    res = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def test_seccomp_filter_denies_escape_primitives() -> None:
    got = _child("confined")
    assert got["exec"] == "EPERM" and got["unshare_user"] == "EPERM", got
    assert got["vsock"] == got["packet"] == got["alg"] == "EAFNOSUPPORT", got
    # What the gateway needs still works: its sockets and threads.
    assert got["unix"] == got["inet"] == got["thread"] == "ok", got


def test_the_templates_compiled_filter_denies_the_same() -> None:
    """The program the gateway template compiles once and each forked gateway loads
    (``prctl(PR_SET_SECCOMP)``, no libseccomp call) denies and allows what the filter
    libseccomp loads does (the test above; its control below)."""
    assert _child("compiled") == _child("confined")


def test_the_filter_loads_libseccomp_without_running_ldconfig() -> None:
    """ctypes.util.find_library runs ``ldconfig -p`` (a process) on every gateway start: the
    soname is loaded as the dynamic linker finds it, and find_library is only a fallback."""
    code = textwrap.dedent(
        """
        import ctypes.util, os
        def boom(name):
            raise AssertionError(f"find_library({name!r}) ran ldconfig")
        ctypes.util.find_library = boom
        from agentbox.gateway._confine import confine
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
        confine()
        print("confined", os.getuid())
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["confined", "65534"]


def test_control_without_the_filter_these_succeed() -> None:
    """Positive control: the same child, unconfined (root), can do what the filter denies."""
    got = _child("plain")
    assert got["exec"] == "ok" and got["unshare_user"] == "ok", got
    assert "ok" in (got["vsock"], got["packet"], got["alg"]), got


def test_read_usage_follows_only_the_launchers_link(tmp_path: Path) -> None:
    state = tmp_path / "usage.json.d"
    state.mkdir()
    link = tmp_path / "usage.json"
    link.symlink_to("usage.json.d/usage.json")
    # A compromised gateway plants a link or a FIFO in its own directory: refused.
    (state / "usage.json").symlink_to("/etc/passwd")
    with pytest.raises(GatewayError, match="cannot read"):
        read_usage(link)
    (state / "usage.json").unlink()
    os.mkfifo(state / "usage.json")
    with pytest.raises(GatewayError, match="not a regular file"):
        read_usage(link)
    (state / "usage.json").unlink()
    link.unlink()
    link.symlink_to("/etc/passwd")  # only NAME.d/NAME is a link read_usage takes
    with pytest.raises(GatewayError, match="unexpected link"):
        read_usage(link)


def _pathological(size: int) -> bytes:
    n = (size - 40) // 3
    return b'{"max_tokens":1,"messages":[' + b"{}," * n + b'{"role":"user","content":"x"}]}'


async def _flood(gw: GatewayHandle, bodies: list[bytes]) -> list[int]:
    token = (gw.socket_path.parent.parent / "token").read_text()
    transport = httpx.AsyncHTTPTransport(uds=str(gw.socket_path))
    async with httpx.AsyncClient(transport=transport, timeout=300) as c:

        async def one(body: bytes) -> int:
            try:
                r = await c.post(
                    "http://gw/v1/messages", content=body, headers={"x-api-key": token}
                )
                return r.status_code
            except httpx.TransportError:
                return -1  # closed while sending a refused body: also a refusal

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.slow
def test_flood_of_pathological_bodies(confined: GatewayHandle) -> None:
    """16 concurrent 32 MiB ``{},{},…`` bodies (2.1 GB of gateway before): refused, bounded."""
    body = _pathological((32 << 20) - 1024)
    statuses = asyncio.run(_flood(confined, [body] * 16))
    assert set(statuses) <= {400, 413, 429, -1}, statuses
    assert 400 in statuses  # read, measured, refused before parsing
    assert confined.alive()
    peak = _peak_rss_kib(confined.pid)
    assert peak < 400 * 1024, f"gateway peak RSS {peak} KiB"
    with _client(confined) as c:
        assert c.post("/v1/messages", json=HI).status_code == 200

    # The usage file lags the gateway's ledger by up to ~0.1 s (its writes are coalesced).
    def refused(u: Any) -> int:
        return int(u.refusals.get("invalid_request", 0) + u.refusals.get("busy", 0))

    u = wait_usage(confined.usage_file, lambda u: refused(u) >= 16)
    assert refused(u) >= 16, u.refusals


def test_gateway_log_is_capped(tmp_path: Path, settings: Settings) -> None:
    """45k bad requests wrote 1.9 MB before; the log now stops at its cap, with a note."""
    os.environ["AGENTBOX_GATEWAY_LOG_CAP"] = "20000"
    try:
        gw = _spawn(tmp_path, settings, confined=True)
    finally:
        del os.environ["AGENTBOX_GATEWAY_LOG_CAP"]
    with gw:
        for _ in range(600):  # each is one uvicorn warning ("Invalid HTTP request received.")
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(gw.socket_path))
                s.sendall(b"GARBAGE / HTTP/9\r\n\r\n")
                s.recv(4096)
        assert gw.log_file is not None
        text = gw.log_file.read_text()
        assert gw.alive()
    assert len(text.encode()) < 20000 + 200
    assert "[agentbox: gateway log capped at 20000 bytes; later lines dropped]" in text


def test_nothing_is_imported_after_the_drop() -> None:
    """After ``prepare_for_drop`` an HTTPS upstream request imports no module: a dropped
    gateway may not read its interpreter's files (a Python under /root, 0700, as here)."""
    code = textwrap.dedent(
        """
        import asyncio, sys
        from agentbox.errors import UpstreamError
        from agentbox.gateway._upstream import make_pool
        pool = make_pool("https://localhost:9", None, connect_timeout=5, read_timeout=5)
        pool.prepare()
        before = set(sys.modules)
        async def go():
            try:
                await pool.request("/v1/messages", [("content-type", "application/json")], b"{}")
            except UpstreamError:
                pass
        asyncio.run(go())
        print(sorted(set(sys.modules) - before))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout
