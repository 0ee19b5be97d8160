"""The gateway as the launcher runs it: a separate process behind spawn_gateway()."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import anthropic
import httpx2
import pytest

from agentbox.config import Settings
from agentbox.errors import ConfigError, GatewayError
from agentbox.gateway import read_usage, spawn_gateway
from gateway_helpers import spawn_replay_gateway, wait_usage


def _token(tmp_path: Path) -> tuple[str, Path]:
    token = secrets.token_urlsafe(24)
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token, path


def test_spawn_serve_stop(tmp_path: Path, settings: Settings) -> None:
    sock = tmp_path / "gw.sock"
    usage = tmp_path / "usage.json"
    handle, token = spawn_replay_gateway(tmp_path, settings)
    try:
        assert handle.alive()
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660
        assert read_usage(usage).budget == 50_000  # exists before the first request
        cmdline = Path(f"/proc/{handle.pid}/cmdline").read_bytes()
        assert token.encode() not in cmdline  # the token travels in its file only
        client = anthropic.Anthropic(
            api_key=token,
            base_url="http://gateway",
            max_retries=0,
            http_client=httpx2.Client(transport=httpx2.HTTPTransport(uds=str(sock))),
        )
        with client:  # its connection closed here, not left to the garbage collector
            msg = client.messages.create(
                model="ignored", max_tokens=30, messages=[{"role": "user", "content": "hi"}]
            )
        assert msg.content[0].text == "Hello from the replay model."  # type: ignore[union-attr]
        assert msg.model == "replay-demo"
        u = wait_usage(usage, lambda u: u.output > 0)  # written just after the answer
        assert (u.input, u.output, u.requests) == (11, 7, 1)
    finally:
        code = handle.stop()
    assert code == 0 and not handle.alive()  # a graceful exit on TERM
    assert handle.stop() == 0  # idempotent
    assert not sock.exists()
    assert read_usage(usage).requests == 1


def test_spawn_refuses_unknown_model_before_starting(tmp_path: Path, settings: Settings) -> None:
    _, token_file = _token(tmp_path)
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        spawn_gateway(
            socket_path=tmp_path / "s",
            token_file=token_file,
            model="nope",
            budget=1,
            usage_file=tmp_path / "u",
            settings=settings,
        )


def test_spawn_reports_a_gateway_that_cannot_start(tmp_path: Path, settings: Settings) -> None:
    _, token_file = _token(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("turns: 5\n")
    with pytest.raises(GatewayError, match="replay script"):
        spawn_gateway(
            socket_path=tmp_path / "s",
            token_file=token_file,
            model="replay-demo",
            budget=1000,
            usage_file=tmp_path / "u",
            settings=settings,
            replay_script=bad,
            log_file=tmp_path / "gw.log",
        )


def test_cli_refuses_non_loopback_and_lists_models(tmp_path: Path) -> None:
    _, token_file = _token(tmp_path)
    argv = [sys.executable, "-m", "agentbox", "gateway", "--listen", "tcp:0.0.0.0:18999",
            "--token-file", str(token_file), "--model", "replay-demo"]  # fmt: skip
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert res.returncode == 3 and "loopback" in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "agentbox", "models", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0
    assert "replay-demo" in res.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_spawn_drops_privileges(tmp_path: Path, settings: Settings) -> None:
    # The usage file's directory must be reachable and writable by the dropped identity.
    usage_dir = Path(tempfile.mkdtemp(prefix="agentbox-gw-usage-", dir="/tmp"))
    os.chown(usage_dir, 65534, 65534)
    usage = usage_dir / "usage.json"
    sock = tmp_path / "gw.sock"
    handle, token = spawn_replay_gateway(
        tmp_path, settings, usage_file=usage, run_as=(65534, 65534)
    )
    try:
        status = dict(
            line.split(":\t", 1)
            for line in Path(f"/proc/{handle.pid}/status").read_text().splitlines()
            if ":\t" in line
        )
        assert status["Uid"].split() == ["65534"] * 4
        assert status["Gid"].split() == ["65534"] * 4
        assert status["Groups"].strip() == ""
        assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
        client = anthropic.Anthropic(
            api_key=token,
            base_url="http://gateway",
            max_retries=0,
            http_client=httpx2.Client(transport=httpx2.HTTPTransport(uds=str(sock))),
        )
        with client:
            msg = client.messages.create(
                model="x", max_tokens=30, messages=[{"role": "user", "content": "hi"}]
            )
        assert msg.usage.output_tokens == 7
        u = wait_usage(usage, lambda u: u.output > 0)
        assert u.output == 7
    finally:
        handle.stop()
        shutil.rmtree(usage_dir, ignore_errors=True)
