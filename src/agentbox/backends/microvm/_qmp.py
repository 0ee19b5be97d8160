"""QMP through QEMU's own client (``qemu.qmp``), driven from synchronous code.

Each call opens a connection, runs its commands in order, and closes; a
command tuple whose name is ``"getfd"`` sends the fd named in its arguments
(``{"fdname": …, "fd": <int>}``) with SCM_RIGHTS first. It runs in a private
thread with its own event loop, so it works whether or not the caller is
inside one.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from agentbox.backends.microvm._sockpath import connectable
from agentbox.errors import SandboxError


async def _session(path: Path, commands: list[tuple[str, dict[str, Any] | None]]) -> list[Any]:
    from qemu.qmp import QMPClient

    client = QMPClient("agentbox")
    with connectable(path) as where:
        await client.connect(where)
    try:
        out: list[Any] = []
        for name, args in commands:
            if name == "getfd" and args is not None:
                client.send_fd_scm(int(args["fd"]))
                args = {"fdname": args["fdname"]}
            if name == "__wait_migration__":
                out.append(await _wait_migration(client, args or {}))
                continue
            if name == "__wait_loaded__":
                out.append(await _wait_loaded(client))
                continue
            out.append(await client.execute(name, args))
        return out
    finally:
        await client.disconnect()


async def _wait_migration(client: Any, args: dict[str, Any]) -> str:
    want = set(args.get("want", ["completed"]))
    while True:
        info = await client.execute("query-migrate")
        status = str(info.get("status", ""))
        if status in want:
            return status
        if status in {"failed", "cancelled"}:
            raise SandboxError(f"migration {status}: {info.get('error-desc', '')}")
        await asyncio.sleep(0.01)


async def _wait_loaded(client: Any) -> str:
    # -incoming keeps the VM in "inmigrate" until the state is read; with -S it
    # then stops in "paused" (or "prelaunch") for us to `cont`.
    while True:
        status = str((await client.execute("query-status")).get("status", ""))
        if status in {"paused", "prelaunch", "running"}:
            return status
        if status in {"internal-error", "shutdown", "guest-panicked"}:
            raise SandboxError(f"restore failed: VM is {status}")
        await asyncio.sleep(0.005)


def wait_loaded() -> tuple[str, dict[str, Any]]:
    """A pseudo-command for :func:`run_qmp`: wait until an incoming VM has loaded its state."""
    return ("__wait_loaded__", {})


def wait_migration(want: tuple[str, ...] = ("completed",)) -> tuple[str, dict[str, Any]]:
    """A pseudo-command for :func:`run_qmp`: poll ``query-migrate`` until ``want``."""
    return ("__wait_migration__", {"want": list(want)})


def run_qmp(
    path: Path,
    commands: list[tuple[str, dict[str, Any] | None]],
    *,
    timeout: float = 30.0,
    name: str = "",
) -> list[Any]:
    """Run ``commands`` over the QMP socket at ``path``; raise SandboxError on failure."""
    result: list[Any] = []
    error: list[BaseException] = []

    def worker() -> None:
        try:
            result.extend(asyncio.run(asyncio.wait_for(_session(path, commands), timeout)))
        except BaseException as exc:
            error.append(exc)

    t = threading.Thread(target=worker, name="agentbox-qmp", daemon=True)
    t.start()
    t.join(timeout + 5)
    if t.is_alive():
        raise SandboxError(f"QMP on {path} hung", sandbox=name or None)
    if error:
        exc = error[0]
        if isinstance(exc, SandboxError):
            raise exc
        raise SandboxError(
            f"QMP {[c[0] for c in commands]} failed: {exc}", sandbox=name or None
        ) from exc
    return result
