"""A detached microVM's monitor process stays lean (issue 15): what it imports.

A monitor lives as long as its VM, one per task (our conmon), so every module it
imports is paid once per task in memory. This runs a real monitor process, with the
very command :meth:`~agentbox.backends.microvm.qemu._detach.QemuDetached.launch` starts
(:func:`~agentbox.backends.microvm.qemu._records.monitor_argv`), hands it a request it
refuses at once (not a dict: exit 2, no VM), and reads the modules it held when it
exited: the entry point, the backend and the records it runs with are all loaded.

Still imported, and the next cut (they need the request and the shared backend
modules rebuilt without them): pydantic and pydantic-settings (the pickled
``Settings`` and the spec's ``Resources``, ~8 MiB private). Logging no longer
imports structlog (with asyncio, ~9 MiB): :mod:`agentbox.core.log` writes its lines itself.
"""

from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path

from agentbox.backends.microvm.qemu._records import MONITOR_MODULE, monitor_argv

#: Never imported by a monitor: each is MiBs per task (rich ~5, click+typer ~6,
#: httpx ~4, PyYAML ~1) or a part of agentbox it does not run with.
HEAVY = (
    "rich",
    "structlog",
    "typer",
    "click",
    "httpx",
    "httpcore",
    "anyio",
    "yaml",
    "agentbox.cli",
    "agentbox.gateway",
    "agentbox.launcher",
    "agentbox.mcp",
    "agentbox.collect",
    "agentbox.backends.podman",
)

#: Prepended to the monitor's ``-c`` code: pop argv[1], write ``sys.modules`` there at exit.
_DUMP = """
import atexit, sys
_out = sys.argv.pop(1)
def _dump():
    with open(_out, "w") as f:
        f.write("\\n".join(m for m, v in sys.modules.items() if v is not None))
atexit.register(_dump)
"""


def test_a_monitor_imports_nothing_heavy(tmp_path: Path) -> None:
    argv = monitor_argv()
    assert argv[1] == "-c" and MONITOR_MODULE in argv  # monitor_of finds it by that word
    modules = tmp_path / "modules.txt"
    probe = [argv[0], "-c", _DUMP + argv[2], str(modules), *argv[3:]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTBOX_")}
    res = subprocess.run(
        probe, input=pickle.dumps(["not", "a", "request"]), capture_output=True, env=env,
        timeout=120, check=False,
    )  # fmt: skip
    # 2: the monitor's main() refused the request (a module that did not run exits 1).
    assert res.returncode == 2, res.stderr.decode(errors="replace")
    imported = set(modules.read_text().split())
    # The probe works: it saw what the monitor runs with load.
    for needed in (
        "agentbox.backends.microvm.qemu._backend",
        "agentbox.backends.microvm._guest",
        "agentbox.core.log",
    ):
        assert needed in imported
    heavy = sorted(m for m in imported if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert heavy == [], f"a monitor process imported {heavy}"
