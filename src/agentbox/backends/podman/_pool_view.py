"""How a claimed pool sandbox looks to the detached verbs: as if launched for its task.

A pooled sandbox (:mod:`agentbox.backends.podman._pool`) was started before its
task existed, so its podman labels, its ``StartedAt`` and its log path are the
pool's. At claim the host writes a record, ``<pool dir>/claims/<task sandbox
name>.json`` (root-only, in the data dir), and renames the container to the task's
sandbox name. :func:`pool_view` folds that record into ``podman inspect``'s answer,
so ``follow``, ``adoptable`` and the seal check see the task's labels, its seal
and its deadline counted from the claim (not from the pool start), unchanged.

The record is trusted only when it is a regular file owned by us, not a link, and
names the very container (its id and pool name) that carries the pool labels.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

#: The pool key (shape hash) of a pooled sandbox.
POOL_LABEL = "io.agentbox.pool"
#: The pool's directory (``data_dir/pool``): where its claim records are.
POOL_DIR_LABEL = "io.agentbox.pool-dir"
#: The name the sandbox was started under (its slot), before a claim renamed it.
POOL_NAME_LABEL = "io.agentbox.pool-name"
#: Key added to a viewed inspect answer: the log conmon really writes (the slot's).
POOL_LOG_KEY = "AgentboxPoolLog"

_MAX_RECORD = 64 * 1024


def claim_record(pool_dir: Path, name: str) -> dict[str, Any] | None:
    """The claim record of sandbox ``name`` under ``pool_dir``; None if absent or untrusted."""
    if "/" in name or name.startswith("."):
        return None
    path = pool_dir / "claims" / f"{name}.json"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        data = os.read(fd, _MAX_RECORD + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_RECORD:
        return None
    try:
        rec = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) else None


def pool_view(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` (one ``podman inspect`` entry) as its task sees it, if it is a claimed
    pool sandbox with a trusted claim record; else ``info`` unchanged."""
    config = info.get("Config")
    labels = config.get("Labels") if isinstance(config, dict) else None
    if not isinstance(labels, dict) or not labels.get(POOL_LABEL):
        return info
    pool_dir = labels.get(POOL_DIR_LABEL)
    name = str(info.get("Name", "")).lstrip("/")
    if not isinstance(pool_dir, str) or not pool_dir.startswith("/"):
        return info
    rec = claim_record(Path(pool_dir), name)
    if (
        rec is None
        or rec.get("id") != info.get("Id")
        or rec.get("slot") != labels.get(POOL_NAME_LABEL)
        or not isinstance(rec.get("labels"), dict)
        or not isinstance(rec.get("claimed_at"), (int, float))
    ):
        return info
    assert isinstance(config, dict)
    view = dict(info)
    view["Config"] = {**config, "Labels": {**labels, **_strs(rec["labels"])}}
    state = info.get("State")
    started = datetime.fromtimestamp(float(rec["claimed_at"]), UTC).isoformat()
    view["State"] = {**(state if isinstance(state, dict) else {}), "StartedAt": started}
    log = rec.get("log")
    if isinstance(log, str) and log.startswith("/"):
        view[POOL_LOG_KEY] = log
    return view


def pool_log(info: Mapping[str, Any] | None, log: Path) -> Path:
    """The file a follower reads: the slot's log for a claimed pool sandbox (conmon
    writes there, and starts it over at its cap), else ``log``."""
    found = info.get(POOL_LOG_KEY) if info is not None else None
    return Path(found) if isinstance(found, str) else log


def _strs(m: Mapping[Any, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in m.items()}
