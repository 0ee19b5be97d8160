"""The per-task gateway process stays lean (issue 15): what it imports, and its options.

A gateway runs for each task's whole life, so every module it imports is paid once
per task in memory. These tests run a real gateway process (the ``agentbox.gateway``
module as ``__main__``, as :func:`spawn_gateway` starts it), send it a request, stop
it with SIGTERM, and read the modules it held when it exited.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from agentbox.core.wait import socket_accepts, wait_until
from agentbox.gateway import DEMO_SCRIPT
from agentbox.gateway.__main__ import OPTIONS
from agentbox.gateway._cli import gateway

#: Never imported by a gateway, whatever its upstream: each is MiBs per task
#: (rich ~5, click+typer ~6, pydantic ~7 with our models, pydantic-settings ~5,
#: httpx ~4) or a part of agentbox it does not serve with.
HEAVY = (
    "rich",
    "typer",
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "pydantic_settings",
    "httpx",
    "httpcore",
    "anyio",
    "agentbox.boxfile",
    "agentbox.config",
    "agentbox.cli",
    "agentbox.gateway._process",
)


#: ``python -m agentbox.gateway ARGS``, plus an exit hook writing ``sys.modules`` to argv[1].
_RUN = """
import atexit, runpy, sys
out = sys.argv.pop(1)
def dump():
    with open(out, "w") as f:
        f.write("\\n".join(m for m, v in sys.modules.items() if v is not None))
atexit.register(dump)
runpy.run_module("agentbox.gateway", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("upstream", ["replay", "http", "https"])
def test_a_serving_gateway_imports_nothing_heavy(tmp_path: Path, upstream: str) -> None:
    token = tmp_path / "token"
    token.write_text(secrets.token_urlsafe(24))
    token.chmod(0o600)
    sock = tmp_path / "gw.sock"
    target = f"replay:{DEMO_SCRIPT}" if upstream == "replay" else f"{upstream}://127.0.0.1:9"
    modules = tmp_path / "modules.txt"
    argv = [sys.executable, "-c", _RUN, str(modules),
            "--listen", f"unix:{sock}", "--token-file", str(token), "--model", "replay-demo",
            "--builtin-models", "--budget", "1000", "--upstream", target,
            "--usage-file", str(tmp_path / "usage.json")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTBOX_")}
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env
    )  # fmt: skip
    try:
        wait_until(
            lambda: proc.poll() is not None or socket_accepts(sock),
            timeout=120,  # a loaded 2-core box: start-up has taken over 30 s
            on_timeout=lambda: AssertionError("the gateway did not listen"),
        )
        assert proc.poll() is None, "the gateway exited early"
        # One request through it, so what the first request imports lazily is counted too.
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(sock))
            c.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            assert c.recv(100).startswith(b"HTTP/1.1 401")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    imported = set(modules.read_text().split())
    assert "agentbox.gateway._app" in imported  # the probe works: it saw the gateway load
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY or m in HEAVY)
    assert heavy == [], f"a gateway process imported {heavy}"
    if upstream != "replay":  # yaml (~1.2 MiB) reads replay scripts only
        assert "yaml" not in imported


def test_main_has_the_options_of_the_gateway_command() -> None:
    """``python -m agentbox.gateway`` (argparse) and ``agentbox gateway`` (typer) agree."""
    app = typer.Typer(add_completion=False)
    app.command()(gateway)
    command = typer.main.get_command(app)
    typer_opts = {
        p.name.replace("_", "-"): (None if p.required else p.default) for p in command.params
    }
    ours = {name: (None if default is ... else default) for name, _, default, _ in OPTIONS}
    assert ours == typer_opts
