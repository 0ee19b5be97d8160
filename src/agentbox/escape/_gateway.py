"""The gateway's posture, read off a real gateway process the way the VMM's is.

The gateway parses every byte a sandbox sends, so a bug in it
must land in an identity that owns nothing: the suite spawns a gateway exactly as
``run_task`` does (``run_as=gateway_identity(settings)``, replay model, a root-only
task directory) and reads every thread from ``/proc`` with
:func:`agentbox.escape._hostcheck.gateway_posture`. The positive control spawns
the same gateway the way the launcher did before the fix (no ``run_as``: root,
full capabilities, no filter), on which every check must fire.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from pathlib import Path

from agentbox.config import Settings
from agentbox.errors import AgentboxError
from agentbox.escape._hostcheck import gateway_posture
from agentbox.escape._model import Outcome, Status
from agentbox.escape._registry import by_id
from agentbox.gateway import gateway_identity, spawn_gateway
from agentbox.gateway.registry import DEFAULT_MODEL

#: The probe ids, in the order :func:`gateway_posture` returns them.
GATEWAY_CHECKS = (
    "gateway.uid",
    "gateway.caps",
    "gateway.no_new_privs",
    "gateway.seccomp",
    "gateway.memory_limit",
)


def _task_dir(root: Path) -> Path:
    """A task dir laid out like the launcher's: root-only, the socket dir world-traversable."""
    task = root / "tasks" / "escape-gw"
    task.mkdir(parents=True)
    (root / "tasks").chmod(0o700)
    task.chmod(0o700)
    (task / "gw").mkdir(mode=0o755)
    (task / "logs").mkdir(mode=0o700)
    token = task / "token"
    token.write_text(secrets.token_urlsafe(24))
    token.chmod(0o600)
    return task


def gateway_outcomes(settings: Settings, *, control: bool = False) -> list[Outcome]:
    """Spawn a gateway as a task would get it, read its posture, stop it.

    ``control``: spawn it unconfined (the pre-fix launcher), so every check fires.
    A gateway that does not start is an ``error`` for every check, never a pass.
    """
    identity = gateway_identity(settings)
    root = Path(tempfile.mkdtemp(prefix="agentbox-escape-gw-"))
    try:
        task = _task_dir(root)
        try:
            with spawn_gateway(
                socket_path=task / "gw" / "gateway.sock",
                token_file=task / "token",
                model=DEFAULT_MODEL,
                budget=10**6,
                usage_file=task / "usage.json",
                settings=settings,
                log_file=task / "logs" / "gateway.log",
                run_as=None if control else identity,
                max_memory=0 if control else None,
            ) as gw:
                want = identity[0] if identity is not None else -1
                checks = gateway_posture(gw.pid, want_uid=want)
        except AgentboxError as exc:
            seen = f"the gateway did not start: {exc}"[:400]
            return [_outcome(cid, "error", seen) for cid in GATEWAY_CHECKS]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return [_outcome(cid, "pass" if ok else "fail", seen) for cid, ok, seen in checks]


def _outcome(cid: str, status: Status, seen: str) -> Outcome:
    spec = by_id(cid)
    return Outcome(spec.id, spec.where, spec.tried, spec.expected, seen[:400], status)
