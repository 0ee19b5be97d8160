"""How a task's sandbox and gateway are named and found: labels, names, live processes.

A sandbox is named after its task and carries two labels: the task id and a hash
of the data dir (launchers of other data dirs leave it be). Re-adoption checks
the labels a sandbox carries against the ones recorded in the store
(:data:`LABELS_VERSION` says which set of labels a launcher wrote).
"""

from __future__ import annotations

import hashlib

import psutil

from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.errors import AgentboxError
from agentbox.launcher._store import Owner

#: Label naming the task a sandbox belongs to (orphans are found by it).
SANDBOX_LABEL = "io.agentbox.task"
#: Label naming the data dir (hashed) whose launcher owns the sandbox.
DATA_LABEL = "io.agentbox.data"


def sandbox_name(task_id: str) -> str:
    """The sandbox of a task is named after it (the id is already validated)."""
    return f"agentbox-task-{task_id}"


def kill_gateway(gw: Owner) -> None:
    """Kill a gateway process group if it is still that very process."""
    from agentbox.launcher._watchdog import kill_gateway as _kill

    _kill(gw.pid, gw.start)


def data_label(settings: Settings) -> str:
    """A label value naming this data dir: launchers of other data dirs leave our sandboxes be."""
    return hashlib.sha256(str(settings.data_dir).encode()).hexdigest()[:16]


def list_task_sandboxes(settings: Settings) -> list[str]:
    """Names of the podman containers of tasks of this data dir."""
    argv = ["podman", "ps", "-a", "--filter", f"label={SANDBOX_LABEL}",
            "--filter", f"label={DATA_LABEL}={data_label(settings)}",
            "--format", "{{.Names}}"]  # fmt: skip
    try:
        res = _proc.run(argv, timeout=60, check=False)
    except AgentboxError:
        return []
    return [n for n in res.stdout.split() if n.startswith("agentbox-task-")]


def list_task_gateways(settings: Settings) -> list[tuple[str, Owner]]:
    """Gateway processes serving a task socket of this data dir: (task id, process)."""
    prefix = f"unix:{settings.data_dir / 'tasks'}/"
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
        cmd = proc.info.get("cmdline") or []
        # ``python -m agentbox gateway …`` or ``python -m agentbox.gateway …``: what
        # names it is a --listen on a socket under this data dir's task dirs.
        if "--listen" not in cmd or not any(a.endswith("gateway") for a in cmd[:4]):
            continue
        i = cmd.index("--listen")
        listen = cmd[i + 1] if i + 1 < len(cmd) else ""
        if not listen.startswith(prefix):
            continue
        task_id = listen[len(prefix) :].split("/", 1)[0]
        found.append((task_id, Owner(proc.info["pid"], proc.info["create_time"] or 0.0)))
    return found


#: Label naming the version of this set of labels (a later launcher reads older ones).
VERSION_LABEL = "io.agentbox.labels"
#: The version written in :data:`VERSION_LABEL`.
LABELS_VERSION = "1"


def sandbox_labels(settings: Settings, task_id: str) -> dict[str, str]:
    """The labels a task's sandbox carries (recorded in the store, checked at re-adoption)."""
    return {
        SANDBOX_LABEL: task_id,
        DATA_LABEL: data_label(settings),
        VERSION_LABEL: LABELS_VERSION,
    }
