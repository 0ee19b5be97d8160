"""A real gateway writes its handshake, and a launcher adopts it by it (issue 19 item 4).

The gateway process, spawned as the launcher spawns a task's (dropping to its own
identity, its usage file in a state dir of its own), writes ``gateway.json`` with its
handshake version and pid; :func:`gateway_refusal`, what a re-adopting launcher asks,
accepts it, and refuses the same gateway once the file says a newer version.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import psutil
import pytest

from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.gateway import spawn_gateway
from agentbox.gateway._handshake import HANDSHAKE_VERSION, read_handshake
from agentbox.gateway._process import gateway_identity
from agentbox.launcher._adopt import gateway_refusal
from agentbox.launcher._store import Owner
from gateway_helpers import CHAT_SCRIPT, write_script


@pytest.mark.skipif(os.geteuid() != 0, reason="the launcher's gateway drops privileges (root)")
def test_a_real_gateway_writes_its_handshake_and_is_adopted_by_it(
    tmp_path: Path, settings: Settings
) -> None:
    paths = TaskPaths(settings.data_dir, "t-handshake")
    paths.gateway_dir.mkdir(parents=True)
    token_file = paths.root / "token"
    token_file.write_text(secrets.token_urlsafe(24) + "\n")
    token_file.chmod(0o600)
    run_as = gateway_identity(settings)
    assert run_as is not None
    handle = spawn_gateway(
        socket_path=paths.gateway_socket,
        token_file=token_file,
        model="replay-demo",
        budget=50_000,
        usage_file=paths.usage_file,
        settings=settings,
        replay_script=write_script(tmp_path, CHAT_SCRIPT),
        log_file=tmp_path / "gw.log",
        run_as=run_as,
    )
    try:
        state = paths.usage_file.with_name("usage.json.d")
        hs = read_handshake(state)
        assert hs is not None and (hs.version, hs.pid) == (HANDSHAKE_VERSION, handle.pid)
        gw = Owner(handle.pid, psutil.Process(handle.pid).create_time())
        assert gateway_refusal(gw, paths) is None
        newer = {"v": HANDSHAKE_VERSION + 1, "pid": handle.pid, "started": hs.started}
        (state / "gateway.json").write_text(json.dumps(newer))
        why = gateway_refusal(gw, paths)
        assert why is not None and f"handshake version {HANDSHAKE_VERSION + 1}" in why, why
        (state / "gateway.json").write_text(json.dumps({**newer, "v": "1; rm -rf /"}))
        why = gateway_refusal(gw, paths)
        assert why is not None and "handshake is unreadable" in why, why
    finally:
        handle.stop()
