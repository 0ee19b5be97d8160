"""The SDK's row of bench/start_latency.py (``--sdk``): ``Sandbox.create()`` -> first output.

A real launcher (``agentbox launcher serve``, root, a private data dir, ``pool_size`` 1:
it keeps one spare SDK sandbox started) serves the SDK over its socket. Each step times
``Sandbox.create()`` and ``commands.run(["echo", "x"], stream=True)`` to its first chunk,
from this process, as a user's script would; the sandbox is removed untimed, and the
step then waits (untimed) for the next spare. A step that found no spare ready is
counted in its own row (cold), never mixed into the warm one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

SDK_ROW = "Sandbox.create() -> first output (warm spare)"
SDK_COLD_ROW = "Sandbox.create() -> first output (cold)"
#: After a step, until the next spare is up (untimed).
REFILL_WAIT = 4.0


class SdkLauncher:
    """``agentbox launcher serve`` on ``root/sdk-data`` with a warm spare; :meth:`stop` it."""

    def __init__(self, root: Path) -> None:
        data = root / "sdk-data"
        self.socket = data / "launcher.sock"
        env = {**os.environ, "AGENTBOX_DATA_DIR": str(data), "AGENTBOX_POOL_SIZE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "agentbox", "launcher", "serve"],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)  # fmt: skip
        end = time.monotonic() + 120
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("the launcher did not start")
            time.sleep(0.1)
        os.environ["AGENTBOX_LAUNCHER_SOCKET"] = str(self.socket)

    def step(self, rows: dict[str, list[float]]) -> Callable[[], None]:
        from agentbox import Sandbox

        self.rows = rows
        rows.setdefault(SDK_ROW, [])
        rows.setdefault(SDK_COLD_ROW, [])

        def sdk() -> None:
            t0 = time.perf_counter()
            sb = Sandbox.create(timeout=120)
            try:
                for _chunk in sb.commands.run(["echo", "x"], stream=True):
                    first = time.perf_counter() - t0
                    break
                rows[SDK_ROW if sb.info.warm else SDK_COLD_ROW].append(first)
            finally:
                sb.close()
            time.sleep(REFILL_WAIT)

        return sdk

    def stop(self) -> None:
        """SIGTERM: the launcher removes its SDK sandboxes and its spare on the way out."""
        if not getattr(self, "rows", {}).get(SDK_COLD_ROW, True):
            del self.rows[SDK_COLD_ROW]  # none was cold
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
