"""The replay model on its own: event order, turn choice, side requests, injections."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbox.errors import ConfigError
from agentbox.gateway._script import load_script
from gateway_helpers import running_replay

TOOLS = [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}]
SYSTEM = "You are Claude Code.\n - Primary working directory: /tmp/proj\n"

SCRIPT: dict[str, Any] = {
    "name": "t",
    "side_reply": "A title",
    "chunk_size": 4,
    "turns": [
        {"text": "Listing.", "tool_use": [{"name": "Bash", "input": {"command": "ls {{cwd}}"}}]},
        {
            "branches": [
                {"match": "README", "text": "There is a README in {{cwd}}."},
                {"text": "Empty directory."},
            ]
        },
        {"match": "^thanks$", "text": "You're welcome."},
    ],
}


def _req(messages: list[Any], **kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 100, "system": SYSTEM, "tools": TOOLS,
            "messages": messages, **kw}  # fmt: skip


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_stream_event_order_and_tool_use(tmp_path: Path) -> None:
    with running_replay(tmp_path, SCRIPT) as rp:
        r = httpx.post(rp.url + "/v1/messages",
                       json=_req([{"role": "user", "content": "go"}], stream=True))  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        evs = _events(r.text)
        names = [n for n, _ in evs]
        assert names[:3] == ["message_start", "content_block_start", "ping"]
        assert names[-2:] == ["message_delta", "message_stop"]
        assert all(d["type"] == n for n, d in evs)
        starts = [d for n, d in evs if n == "content_block_start"]
        assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"]
        tool_id = starts[1]["content_block"]["id"]
        partial = "".join(
            d["delta"]["partial_json"] for n, d in evs
            if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
        )  # fmt: skip
        assert json.loads(partial) == {"command": "ls /tmp/proj"}  # {{cwd}} from the prompt
        delta = evs[-2][1]
        assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] > 0
        # A second call yields a fresh tool id.
        r2 = httpx.post(rp.url + "/v1/messages", json=_req([{"role": "user", "content": "go"}]))
        assert r2.json()["content"][1]["id"] != tool_id


def test_branches_assertions_and_end(tmp_path: Path) -> None:
    def conv(result: str) -> list[Any]:
        return [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash",
                                               "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": result}]}]},
        ]  # fmt: skip

    with running_replay(tmp_path, SCRIPT) as rp:
        post = lambda body: httpx.post(rp.url + "/v1/messages", json=body)  # noqa: E731
        assert post(_req(conv("README.md\nsrc"))).json()["content"][0]["text"] == (
            "There is a README in /tmp/proj."
        )
        assert post(_req(conv("nothing"))).json()["content"][0]["text"] == "Empty directory."
        third = [*conv("x"), {"role": "assistant", "content": "y"},
                 {"role": "user", "content": "no thanks"}]  # fmt: skip
        bad = post(_req(third))
        assert bad.status_code == 400 and "expected the last" in bad.json()["error"]["message"]
        third[-1]["content"] = "thanks"
        assert post(_req(third)).json()["content"][0]["text"] == "You're welcome."
        fourth = [*third, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
        end = post(_req(fourth)).json()
        assert end["stop_reason"] == "end_turn" and "no more turns" in end["content"][0]["text"]


def test_side_requests_do_not_consume_the_script(tmp_path: Path) -> None:
    with running_replay(tmp_path, SCRIPT) as rp:
        side = {"model": "haiku", "max_tokens": 32, "messages": [{"role": "user", "content": "t"}]}
        for _ in range(3):
            r = httpx.post(rp.url + "/v1/messages", json=side)
            assert r.json()["content"] == [{"type": "text", "text": "A title"}]
        main = httpx.post(rp.url + "/v1/messages", json=_req([{"role": "user", "content": "go"}]))
        assert main.json()["content"][0]["text"] == "Listing."
        n = httpx.post(rp.url + "/v1/messages/count_tokens", json=_req([]))
        assert n.json()["input_tokens"] > 0
        assert httpx.get(rp.url + "/v1/messages").status_code == 404


def test_injected_errors_then_success(tmp_path: Path) -> None:
    script = {"main": "all", "turns": [{"text": "ok", "errors": [
        {"status": 529}, {"status": 429, "retry_after": 3}, {"status": 500, "type": "api_error"},
    ]}]}  # fmt: skip
    with running_replay(tmp_path, script) as rp:
        body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "q"}]}
        got = [httpx.post(rp.url + "/v1/messages", json=body) for _ in range(4)]
        assert [r.status_code for r in got] == [529, 429, 500, 200]
        assert got[0].json()["error"]["type"] == "overloaded_error"
        assert got[1].headers["retry-after"] == "3"
        assert got[1].json()["error"]["type"] == "rate_limit_error"


def test_cwd_required_when_used(tmp_path: Path) -> None:
    with running_replay(tmp_path, SCRIPT) as rp:
        body = _req([{"role": "user", "content": "go"}])
        del body["system"]
        r = httpx.post(rp.url + "/v1/messages", json=body)
        assert r.status_code == 400 and "working directory" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "bad",
    [
        "turns: 3\n",
        "turns:\n  - {text: a, branches: [{text: b}]}\n",
        "turns:\n  - {match: '(', text: a}\n",
        "turns:\n  - {tool_use: [{name: A, id: x}, {name: B, id: x}]}\n",
        "turns:\n  - {text: a, surprise: 1}\n",
        "turns: [\n",
    ],
)
def test_script_validation(tmp_path: Path, bad: str) -> None:
    p = tmp_path / "s.yaml"
    p.write_text(bad)
    with pytest.raises(ConfigError, match="replay script"):
        load_script(p)


def test_demo_script_is_valid() -> None:
    from agentbox.gateway import DEMO_SCRIPT

    s = load_script(DEMO_SCRIPT)
    names = [t.name for turn in s.turns for b in turn.blocks() if (t := b.tool_use)]
    assert names == ["Write", "Write", "Edit", "Bash"]


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ("turns: 3\n", "turns: must be a list, not 3"),
        ("turns:\n  - {text: a, branches: [{text: b}]}\n",
         "turns.0: a turn with branches has no content of its own"),
        ("turns:\n  - {branches: []}\n", "turns.0: branches must not be empty"),
        ("turns:\n  - content: [{text: a, tool_use: {name: x}}]\n",
         "turns.0.content.0: a block has exactly one of text, tool_use or thinking"),
        ("turns:\n  - {tool_use: [{name: ''}]}\n",
         "turns.0.tool_use.0.name: String should have at least 1 character"),
        ("turns:\n  - {tool_use: [{name: A, id: x}, {name: B, id: x}]}\n",
         "tool_use id 'x' used twice"),
        ("turns:\n  - {delay: 601}\n", "turns.0.delay: Input should be less than or equal to 600"),
        ("turns:\n  - {errors: [{status: 300}]}\n",
         "turns.0.errors.0.status: Input should be greater than or equal to 400"),
        ("turns:\n  - {usage: {input_tokens: -1}}\n",
         "turns.0.usage.input_tokens: Input should be greater than or equal to 0"),
        ("turns:\n  - {text: a, surprise: 1}\n", "turns.0.surprise: is not a key here"),
        ("turns: []\nmain: x\n", "main: must be one of 'tools' or 'all', not 'x'"),
        ("turns: []\nchunk_size: 0\n", "chunk_size: Input should be greater than or equal to 1"),
        ("name: x\n", "turns: is required"),
    ],
)  # fmt: skip
def test_script_errors_name_the_key(tmp_path: Path, bad: str, said: str) -> None:
    """Hand-checked scripts (the gateway loads no pydantic) name what is wrong, and where."""
    p = tmp_path / "s.yaml"
    p.write_text(bad)
    with pytest.raises(ConfigError) as info:
        load_script(p)
    assert str(info.value).startswith(f"replay script {p} is not valid: ")
    assert said in str(info.value)
