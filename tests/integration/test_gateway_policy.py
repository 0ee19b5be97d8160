"""The request allow-lists (issue 11 item 3), against a real gateway and a recording upstream.

Anything that would make the upstream reach the network is refused with a 400
naming it and never reaches the upstream; unknown harmless fields are stripped;
what Claude Code really sends (recorded from 2.1.332) passes intact.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.errors import ConfigError
from agentbox.gateway._policy import CLAUDE_CODE_BETAS
from agentbox.gateway.registry import ModelEntry
from gateway_helpers import CHAT_SCRIPT, replay_entry, running_gateway, running_replay

PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)

#: The shape of a Claude Code 2.1.332 request (recorded through the replay model): its
#: top-level fields, a tool round trip with an image result, thinking, cache_control.
CLAUDE_CODE_REQUEST: dict[str, Any] = {
    "model": "claude-opus-5-5",
    "max_tokens": 128000,
    "stream": True,
    "metadata": {"user_id": '{"device_id":"9c51","account_uuid":"","session_id":"9188"}'},
    "thinking": {"type": "adaptive", "display": "omitted"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "medium"},
    "system": [
        {"type": "text", "text": "You are Claude Code."},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
    ],
    "tools": [
        {
            "name": "Read",
            "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
        },
        {
            "name": "Bash",
            "description": "Run a command",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
            "cache_control": {"type": "ephemeral"},
        },
    ],
    "messages": [
        {"role": "system", "content": "Primary working directory: /workspace"},
        {"role": "user", "content": [{"type": "text", "text": "look at the image"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "c2ln"},
                {"type": "redacted_thinking", "data": "ZW5j"},
                {"type": "text", "text": "Reading."},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": "Read",
                    "input": {"file_path": "/workspace/a.png"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                        }
                    ],
                },
                {
                    "type": "document",
                    "source": {"type": "text", "media_type": "text/plain", "data": "notes"},
                },
                {"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ],
}
BETAS = ",".join(CLAUDE_CODE_BETAS)


def _with(path: str, value: Any) -> dict[str, Any]:
    """The Claude Code request with ``value`` set at a dotted ``path`` (ints index lists)."""
    req = copy.deepcopy(CLAUDE_CODE_REQUEST)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = req
    for p in parents:
        node = node[p]
    if isinstance(node, list) and last == len(node):
        node.append(value)
    else:
        node[last] = value
    return req


def _url_source(kind: str, media: str) -> dict[str, Any]:
    return {"type": kind, "source": {"type": "url", "url": "http://attacker.example/x"}}


NETWORK_SHAPES = [
    pytest.param(
        _with("mcp_servers", [{"type": "url", "url": "http://evil/", "name": "e"}]),
        "mcp_servers",
        id="mcp_servers",
    ),
    pytest.param(_with("container", "cntr_01"), "container", id="container"),
    pytest.param(
        _with("tools.2", {"type": "web_fetch_20250910", "name": "web_fetch"}),
        "web_fetch_20250910",
        id="web_fetch tool",
    ),
    pytest.param(
        _with("tools.2", {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}),
        "web_search_20250305",
        id="web_search tool",
    ),
    pytest.param(
        _with("tools.2", {"type": "code_execution_20250825", "name": "code_execution"}),
        "code_execution_20250825",
        id="code_execution tool",
    ),
    pytest.param(
        _with("tools.2", {"type": "bash_20250124", "name": "bash"}),
        "bash_20250124",
        id="anthropic-defined tool",
    ),
    pytest.param(
        _with("messages.3.content.3", _url_source("image", "image/png")),
        "source.type 'url'",
        id="image url source",
    ),
    pytest.param(
        _with("messages.3.content.3", _url_source("document", "application/pdf")),
        "source.type 'url'",
        id="document url source",
    ),
    pytest.param(
        _with("messages.3.content.0.content.1", _url_source("image", "image/png")),
        "source.type 'url'",
        id="url image inside a tool result",
    ),
    pytest.param(
        _with(
            "messages.3.content.3",
            {"type": "document", "source": {"type": "file", "file_id": "file_01"}},
        ),
        "source.type 'file'",
        id="files api source",
    ),
    pytest.param(
        _with(
            "messages.2.content.4",
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_fetch", "input": {}},
        ),
        "server_tool_use",
        id="server_tool_use block",
    ),
    pytest.param(
        _with("messages.2.content.4", {"type": "mcp_tool_use", "id": "m", "name": "x"}),
        "mcp_tool_use",
        id="mcp_tool_use block",
    ),
    pytest.param(
        _with("messages.3.content.3", {"type": "container_upload", "file_id": "f"}),
        "container_upload",
        id="container_upload block",
    ),
    pytest.param(
        _with("messages.3.content.3", {"type": "brand_new_block", "x": 1}),
        "brand_new_block",
        id="unknown block type",
    ),
]


@pytest.fixture
def pair(tmp_path: Path) -> Any:
    entry = replay_entry(kind="anthropic")
    with (
        running_replay(tmp_path, CHAT_SCRIPT) as up,
        running_gateway(tmp_path, upstream=up.url, entry=entry, budget=10**9) as gw,
    ):
        yield up, gw


def _post(gw: Any, body: Any, betas: str = BETAS) -> httpx.Response:
    headers = {**gw.auth(), "anthropic-beta": betas}
    return httpx.post(gw.url + "/v1/messages?beta=true", json=body, headers=headers, timeout=30)


def test_claude_code_request_passes_intact(pair: Any) -> None:
    up, gw = pair
    r = _post(gw, CLAUDE_CODE_REQUEST)
    assert r.status_code == 200, r.text
    rec = up.requests()[0]
    got = {k.lower(): v for k, v in rec["headers"]}
    assert got["anthropic-beta"] == BETAS  # all eight betas, in order
    sent = rec["body"]
    expected = {**CLAUDE_CODE_REQUEST, "model": "test-model"}
    assert sent == expected


@pytest.mark.parametrize(("body", "named"), NETWORK_SHAPES)
def test_network_reaching_parts_refused_by_name(pair: Any, body: Any, named: str) -> None:
    up, gw = pair
    r = _post(gw, body)
    assert r.status_code == 400, r.text
    doc = r.json()
    assert doc["error"]["type"] == "invalid_request_error"
    assert named in doc["error"]["message"], doc
    assert up.requests() == []  # nothing reached the upstream
    assert gw.usage().refusals == {"policy": 1}


@pytest.mark.parametrize(
    "beta", ["mcp-client-2025-04-04", "web-fetch-2025-09-10", "files-api-2025-04-14"]
)
def test_network_betas_refused_by_name(pair: Any, beta: str) -> None:
    up, gw = pair
    r = _post(gw, CLAUDE_CODE_REQUEST, betas=f"{BETAS},{beta}")
    assert r.status_code == 400 and beta in r.json()["error"]["message"], r.text
    assert up.requests() == []


def test_unknown_harmless_fields_stripped(pair: Any) -> None:
    up, gw = pair
    body = _with("service_tier", "priority")
    body["frobnicate"] = {"a": 1}
    body["metadata"]["callback"] = "http://x/"
    body["tools"][0]["allowed_callers"] = ["code_execution_20250825"]
    body["messages"][1]["name"] = "someone"
    r = _post(gw, body, betas=f"{BETAS},totally-new-beta-2030-01-01")
    assert r.status_code == 200, r.text
    rec = up.requests()[0]
    assert rec["body"] == {**CLAUDE_CODE_REQUEST, "model": "test-model"}
    got = {k.lower(): v for k, v in rec["headers"]}
    assert got["anthropic-beta"] == BETAS


def test_registry_cannot_allow_network_parts(tmp_path: Path) -> None:
    ModelEntry(name="m", kind="anthropic", upstream="https://x", allowed_fields=("temperature",))
    for bad in (
        {"allowed_fields": ("mcp_servers",)},
        {"allowed_block_types": ("text", "web_fetch_tool_result")},
        {"allowed_betas": ("mcp-client-2025-04-04",)},
    ):
        with pytest.raises(ValueError, match="network"):
            ModelEntry(name="m", kind="anthropic", upstream="https://x", **bad)
    f = tmp_path / "models.toml"
    f.write_text('[models.m]\nkind = "anthropic"\nupstream = "https://x"\n'
                 'allowed_fields = ["container"]\n')  # fmt: skip
    from agentbox.gateway.registry import load_registry

    with pytest.raises(ConfigError, match="network"):
        load_registry(path=f)


def test_entry_allow_lists_narrow_what_passes(tmp_path: Path) -> None:
    entry = replay_entry(kind="anthropic", allowed_fields=("temperature",), allowed_betas=())
    with (
        running_replay(tmp_path, CHAT_SCRIPT) as up,
        running_gateway(tmp_path, upstream=up.url, entry=entry) as gw,
    ):
        body = {
            "max_tokens": 5,
            "temperature": 0.5,
            "top_k": 3,
            "messages": [{"role": "user", "content": "hi"}],
        }
        assert _post(gw, body).status_code == 200
        rec = up.requests()[0]
        assert rec["body"] == {
            "model": "test-model",
            "max_tokens": 5,
            "temperature": 0.5,
            "messages": [{"role": "user", "content": "hi"}],
        }
        assert "anthropic-beta" not in {k.lower() for k, _ in rec["headers"]}


def test_compatible_kind_drops_betas_and_its_unsupported_fields(tmp_path: Path) -> None:
    with (
        running_replay(tmp_path, CHAT_SCRIPT) as up,
        running_gateway(tmp_path, upstream=up.url, entry=replay_entry(kind="compatible")) as gw,
    ):
        assert _post(gw, CLAUDE_CODE_REQUEST).status_code == 200
        rec = up.requests()[0]
        assert "thinking" not in rec["body"] and "context_management" not in rec["body"]
        assert "anthropic-beta" not in {k.lower() for k, _ in rec["headers"]}
        # The network refusals hold for every kind.
        r = _post(gw, _with("mcp_servers", []))
        assert r.status_code == 400 and "mcp_servers" in r.text
    assert json.dumps(CLAUDE_CODE_REQUEST)  # the fixture itself was not mutated


def test_empty_allow_lists_mean_nothing_optional(tmp_path: Path) -> None:
    """An empty list admits nothing optional (not "the default"); required fields stay."""
    entry = replay_entry(kind="anthropic", allowed_fields=(), allowed_block_types=("text",))
    with (
        running_replay(tmp_path, CHAT_SCRIPT) as up,
        running_gateway(tmp_path, upstream=up.url, entry=entry) as gw,
    ):
        body = {"max_tokens": 5, "temperature": 1, "messages": [{"role": "user", "content": "x"}]}
        assert _post(gw, body).status_code == 200
        assert up.requests()[0]["body"] == {
            "model": "test-model",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "x"}],
        }
        img = _with("messages.1.content.0", {"type": "image", "source": {}})
        r = _post(gw, img)
        assert r.status_code == 400 and "not allowed" in r.text
