"""Issue 13 section 4: ``models`` (CLI and MCP's launcher call) says what a user can use.

The CLI runs as its own process on a real models file; the launcher's ``models()``
is what the MCP ``models`` tool returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentbox.config import Settings
from agentbox.errors import ConfigError, PolicyRefused
from agentbox.gateway import DEMO_SCRIPT
from agentbox.gateway.registry import load_registry
from agentbox.launcher import Launcher, TaskRequest


def _models(*args: str, env: dict[str, str] | None = None) -> Any:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COLUMNS": "80"}
    if "PYTHONPATH" in os.environ:
        base["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run(
        [sys.executable, "-m", "agentbox", "models", *args],
        env={**base, **(env or {})}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "models.toml"
    p.write_text(text)
    return p


def test_keyless_models_are_unavailable_with_the_reason() -> None:
    rows = {m["name"]: m for m in json.loads(_models("--json").stdout)}
    assert rows["sonnet"]["available"] is False
    assert rows["sonnet"]["unavailable_reason"] == "ANTHROPIC_API_KEY is not set"
    assert rows["replay-demo"]["available"] is True and rows["replay-demo"]["default"] is True
    keyed = {m["name"]: m for m in json.loads(
        _models("--json", env={"ANTHROPIC_API_KEY": "sk-test"}).stdout)}  # fmt: skip
    assert keyed["sonnet"]["available"] is True
    text = _models().stdout
    assert "no: ANTHROPIC_API_KEY is not set" in text.replace("\n", " ") or (
        "ANTHROPIC_API_KEY" in text
    ), text
    assert "replay-demo (default)" in text and "default: replay-demo" in text


def test_models_json_lists_current_ids_prices_and_a_real_default_with_a_key() -> None:
    """Issue 27: opus/sonnet/haiku name the 5.5 models with prices; the default is a real
    model when its key is set, and the scripted demo when not, each with why."""
    keyless = {m["name"]: m for m in json.loads(_models("--json").stdout)}
    keyed = {m["name"]: m for m in json.loads(
        _models("--json", env={"ANTHROPIC_API_KEY": "sk-test"}).stdout)}  # fmt: skip
    ids = {n: keyed[n]["upstream_model"] for n in ("opus", "sonnet", "haiku")}
    assert ids == {"opus": "claude-opus-5-5", "sonnet": "claude-sonnet-5-5",
                   "haiku": "claude-haiku-5-5"}  # fmt: skip
    assert keyed["sonnet"]["price"] == {"input": 2.0, "output": 10.0, "cache_write": 2.5,
                                        "cache_write_1h": 4.0, "cache_read": 0.1}  # fmt: skip
    assert keyed["opus"]["price"]["output"] == 20.0 and keyed["haiku"]["price"]["input"] == 0.1
    assert keyed["replay-demo"]["price"] is None and keyed["replay-demo"]["scripted"] is True
    assert keyed["sonnet"]["default"] is True and not keyed["replay-demo"]["default"]
    assert "ANTHROPIC_API_KEY is set" in keyed["sonnet"]["default_reason"]
    assert keyless["replay-demo"]["default"] is True
    assert "scripted" in keyless["replay-demo"]["default_reason"]


def test_the_default_is_said_and_can_be_set(tmp_path: Path) -> None:
    body = f"""
[models.zeta]
kind = "replay"
upstream = "{DEMO_SCRIPT}"
[models.alpha]
kind = "replay"
upstream = "{DEMO_SCRIPT}"
"""
    out = _models("--models-file", str(_file(tmp_path, body))).stdout
    assert "alpha (default)" in out
    assert "sets no `default`" in out.replace("\n", " "), out
    reg = load_registry(None, _file(tmp_path, 'default = "zeta"\n' + body))
    assert reg.default == "zeta" and "set by `default`" in reg.default_reason
    with pytest.raises(ConfigError, match="names no entry"):
        load_registry(None, _file(tmp_path, 'default = "nope"\n' + body))


def test_a_missing_replay_script_fails_at_load(tmp_path: Path) -> None:
    path = _file(tmp_path, '[models.mine]\nkind = "replay"\nupstream = "gone.yaml"\n')
    r = _models("--models-file", str(path))
    assert r.returncode == 1
    assert "[models.mine] upstream: replay script" in r.stderr and "gone.yaml" in r.stderr


def test_bad_entries_are_said_in_our_words(tmp_path: Path) -> None:
    path = _file(tmp_path, '[models.mine]\nkind = "openai"\nupstream = "https://x"\ncolour = 1\n')
    r = _models("--models-file", str(path))
    assert r.returncode == 1
    err = " ".join(r.stderr.split())
    assert "[models.mine] kind: must be one of 'anthropic', 'compatible' or 'replay'" in err, err
    assert "[models.mine] colour: is not a key" in err
    assert "pydantic" not in err and "http" not in err.replace("https://x", "")


@pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root")
def test_launcher_models_and_submit(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """What MCP's ``models`` tool returns; a task naming an unavailable model is refused
    up front with the reason instead of failing inside."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with Launcher(settings, max_tasks=1) as la:
        ms = {m.name: m for m in la.models()}
        assert not ms["haiku"].available and "ANTHROPIC_API_KEY" in ms["haiku"].unavailable_reason
        assert ms["replay-demo"].default and ms["replay-demo"].default_reason
        repo = settings.repos_root / "r"
        (repo / ".git").mkdir(parents=True)
        with pytest.raises(PolicyRefused, match="'sonnet' is unavailable: ANTHROPIC_API_KEY"):
            la.submit(TaskRequest(repo=str(repo), task="x", model="sonnet"))
