"""Shared helpers for the gateway and replay tests: real servers on real sockets.

Servers run in a background thread of the test process (fast to start); the
tests that need a separate process (``spawn_gateway``, the CLI, Claude Code)
start one themselves.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agentbox.config import Settings
from agentbox.gateway import GatewayHandle, spawn_gateway
from agentbox.gateway._app import Gateway
from agentbox.gateway._replay import ReplayModel
from agentbox.gateway._run import build_gateway
from agentbox.gateway._script import load_script
from agentbox.gateway._serve import ServerGroup, bind, parse_listen
from agentbox.gateway._usage import Usage, read_usage
from agentbox.gateway.registry import ModelEntry

#: A script for plain SDK conversations: every request plays it, text only.
CHAT_SCRIPT: dict[str, Any] = {
    "name": "chat",
    "main": "all",
    "turns": [
        {
            "text": "Hello from the replay model.",
            "usage": {"input_tokens": 11, "output_tokens": 7},
        },
        {
            "text": "Second answer.",
            "usage": {
                "input_tokens": 20,
                "output_tokens": 5,
                "cache_creation_input_tokens": 100,
                "cache_read_input_tokens": 1000,
            },
        },
    ],
}


def wait_usage(path: Path, done: Any, timeout: float = 10.0) -> Usage:
    """Read the usage file of a gateway process until ``done(usage)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        u = read_usage(path)
        if done(u) or time.monotonic() > deadline:
            return u
        time.sleep(0.01)


_GREET_TURNS = """\
main: tools
side_reply: "Add greet"
turns:
  - text: "Adding greet()."
    tool_use:
      - name: Write
        input:
          file_path: "{{cwd}}/greet.py"
          content: "def greet(name):\\n    return f'hello {name}'\\n"
  - text: "Added greet() in greet.py."
"""


def greet_script(name: str) -> str:
    """A replay script (YAML text) whose agent writes greet.py with one Write call."""
    return f"name: {name}\n" + _GREET_TURNS


def write_script(directory: Path, script: dict[str, Any], name: str = "script.yaml") -> Path:
    """Write ``script`` as YAML into ``directory`` and return its path."""
    path = directory / name
    path.write_text(yaml.safe_dump(script))
    return path


class ThreadServers:
    """A :class:`ServerGroup` served by a background thread with its own event loop."""

    def __init__(self, group: ServerGroup) -> None:
        self.group = group
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not group.started:
            if self.error is not None or not self.thread.is_alive():
                raise RuntimeError(f"servers failed to start: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("servers did not start")
            time.sleep(0.005)

    def _run(self) -> None:
        try:
            asyncio.run(self.group.run(signals=False))
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self.group.stop()
        self.thread.join(15)


@dataclass
class RunningReplay:
    """A replay model serving on TCP loopback, recording requests to ``log``."""

    url: str
    log: Path
    model: ReplayModel

    def requests(self) -> list[dict[str, Any]]:
        """The recorded requests, oldest first."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@contextmanager
def running_replay(tmp_path: Path, script: dict[str, Any]) -> Iterator[RunningReplay]:
    """Serve ``script`` on 127.0.0.1 (a free port), with a request log."""
    path = write_script(tmp_path, script, f"replay-{secrets.token_hex(4)}.yaml")
    log = tmp_path / f"requests-{secrets.token_hex(4)}.jsonl"
    model = ReplayModel(load_script(path), log_path=log)
    sock = bind(parse_listen("tcp:127.0.0.1:0"))
    port = sock.getsockname()[1]
    servers = ThreadServers(ServerGroup([(model, sock)]))
    try:
        yield RunningReplay(f"http://127.0.0.1:{port}", log, model)
    finally:
        servers.stop()


@dataclass
class RunningGateway:
    """A gateway serving on TCP loopback (``url``) or a unix socket (``uds``)."""

    url: str
    token: str
    usage_file: Path
    gateway: Gateway
    uds: str | None = None

    def usage(self) -> Usage:
        """The usage file as the launcher would read it, once every request is written."""
        deadline = time.monotonic() + 10
        while self.gateway.active or not self.gateway.usage_settled:
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not settle")
            time.sleep(0.002)
        return read_usage(self.usage_file)

    def auth(self) -> dict[str, str]:
        """Headers carrying the task token."""
        return {"x-api-key": self.token, "anthropic-version": "2023-06-01"}


def replay_entry(name: str = "test-model", **kw: Any) -> ModelEntry:
    """A registry entry for tests (its upstream is always overridden)."""
    return ModelEntry(name=name, kind=kw.pop("kind", "replay"), upstream="unused.yaml", **kw)


@contextmanager
def running_gateway(
    tmp_path: Path,
    *,
    script: dict[str, Any] | None = None,
    upstream: str | None = None,
    budget: int = 1_000_000,
    entry: ModelEntry | None = None,
    unix: bool = False,
    **kw: Any,
) -> Iterator[RunningGateway]:
    """A gateway in front of ``upstream`` or of an in-process replay of ``script``."""
    if upstream is None:
        upstream = f"replay:{write_script(tmp_path, script or CHAT_SCRIPT, 'gw-script.yaml')}"
    token = secrets.token_urlsafe(24)
    usage = tmp_path / f"usage-{secrets.token_hex(4)}.json"
    listen = f"unix:{tmp_path / 'gw.sock'}" if unix else "tcp:127.0.0.1:0"
    group, gateway, private = build_gateway(
        listen=listen,
        token=token,
        entry=entry or replay_entry(),
        budget=budget,
        upstream=upstream,
        usage_file=usage,
        **kw,
    )
    sock = group.apps[-1][1]
    servers = ThreadServers(group)
    try:
        if unix:
            yield RunningGateway("http://gateway", token, usage, gateway, str(tmp_path / "gw.sock"))
        else:
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            yield RunningGateway(url, token, usage, gateway)
    finally:
        servers.stop()
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


def spawn_replay_gateway(
    tmp_path: Path,
    settings: Settings,
    script: dict[str, Any] | None = None,
    **overrides: Any,
) -> tuple[GatewayHandle, str]:
    """A real gateway process (:func:`~agentbox.gateway.spawn_gateway`) serving ``script``
    (default :data:`CHAT_SCRIPT`) as ``replay-demo``, and its token (written 0600 to
    ``tmp_path/token``). Socket, usage file and log are in ``tmp_path`` (``gw.sock``,
    ``usage.json``, ``gw.log``); any of :func:`spawn_gateway`'s arguments overrides."""
    token = secrets.token_urlsafe(24)
    token_file = overrides.pop("token_file", tmp_path / "token")
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    args: dict[str, Any] = {
        "socket_path": tmp_path / "gw.sock",
        "token_file": token_file,
        "model": "replay-demo",
        "budget": 50_000,
        "usage_file": tmp_path / "usage.json",
        "settings": settings,
        "log_file": tmp_path / "gw.log",
    }
    args.update(overrides)
    if "replay_script" not in args:
        args["replay_script"] = write_script(tmp_path, script or CHAT_SCRIPT)
    return spawn_gateway(**args), token
