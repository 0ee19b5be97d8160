"""Request-level egress records: the log line, its summary, what show/logs print, redaction."""

from __future__ import annotations

import tomllib
from pathlib import Path

from agentbox.cli._env import env_rows
from agentbox.egress import summarize
from agentbox.egress._intercept import Redactor, log_path
from agentbox.egress._record import EgressLog, format_record
from agentbox.egress.rules import suggest_rule


def _write(path: Path) -> None:
    log = EgressLog(path, max_bytes=1 << 20)
    log.write(conn=1, method="GET", host="pypi.corp.example", port=443, path="/simple/x/",
              decision="allowed", rule="boxfile#1:pypi.corp.example GET,HEAD /simple/*",
              reason="", status=200, bytes_up=90, bytes_down=5000, injected=True)  # fmt: skip
    log.write(conn=1, method="POST", host="pypi.corp.example", port=443,
              path="/upload/a?token=…", decision="denied", rule="no-rule",
              reason="no [[network.rule]] allows POST pypi.corp.example/upload/a", status=403,
              bytes_up=0, bytes_down=0, injected=False,
              suggest=suggest_rule("pypi.corp.example", "POST", "/upload/a"))  # fmt: skip
    log.write(conn=2, method="POST", host="git.corp.example", port=443,
              path="/r.git/git-receive-pack", decision="denied", rule="git-fetch:git.corp.example",
              reason="results are published from the host", status=403, bytes_up=0,
              bytes_down=0, injected=False)  # fmt: skip
    log.write(conn=3, method="CONNECT", host="evil.example", port=443, decision="denied",
              rule="not-allowed", reason="not in the allow-list", status=403)  # fmt: skip
    log.close()


def test_summary_counts_injections_and_keeps_refusals(tmp_path: Path) -> None:
    _write(tmp_path / "e.jsonl")
    s = summarize(tmp_path / "e.jsonl")
    assert s.allowed == 1 and s.denied == 3 and s.injected == 1
    assert [h.injected for h in s.hosts if h.host == "pypi.corp.example"] == [1]
    assert [(r.method, r.host, r.path) for r in s.refused] == [
        ("POST", "pypi.corp.example", "/upload/a?token=…"),
        ("POST", "git.corp.example", "/r.git/git-receive-pack"),
    ]  # the tunnel-level refusal is in the host summary, not here
    assert s.refused[0].suggest is not None and s.refused[1].suggest is None


def test_show_rows_name_the_rule_to_paste(tmp_path: Path) -> None:
    _write(tmp_path / "e.jsonl")
    report = {"egress": summarize(tmp_path / "e.jsonl").model_dump(mode="json")}
    rows = env_rows(report)
    assert rows[0][0] == "egress" and "1 with an injected header" in rows[0][1]
    refused = [text for label, text in rows if label == "refused"]
    assert len(refused) == 2
    assert "results are published from the host" in refused[1]
    pasted = refused[0].split("add to the Boxfile:\n", 1)[1]
    rule = tomllib.loads(pasted)["network"]["rule"][0]
    assert rule == {"host": "pypi.corp.example", "methods": ["POST"], "paths": ["/upload/*"]}


def test_log_lines_for_logs(tmp_path: Path) -> None:
    _write(tmp_path / "e.jsonl")
    import json

    lines = [format_record(json.loads(x)) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert "GET pypi.corp.example/simple/x/ → 200 allowed" in lines[0] and "injected" in lines[0]
    assert "403 denied [no-rule]" in lines[1] and "injected" not in lines[1]
    assert lines[3].startswith(lines[3][:8]) and "CONNECT evil.example → 403 denied" in lines[3]


def test_logged_path_elides_query_values() -> None:
    assert log_path("/a/b?token=SECRET&x=1") == "/a/b?token=…&x=…"
    assert log_path("/plain") == "/plain"
    assert "SECRET" not in log_path("/p?SECRET")  # a bare key is kept as a key, bounded
    assert log_path("/p?" + "k=v&" * 100).count("=…") == 10


def test_redactor_same_length_and_across_chunks() -> None:
    secret = b"tok-0123456789"
    r = Redactor([secret, b"Bearer " + secret, b"ab"])  # too short a value is not redacted
    body = b"x" * 10 + b"Bearer " + secret + b"y" * 5 + secret + b"ab"
    out = b""
    for i in range(0, len(body), 3):  # every split point
        out += r.feed(body[i : i + 3])
    out += r.flush()
    assert len(out) == len(body) and secret not in out and b"Bearer " not in out
    assert out.endswith(b"*" * len(secret) + b"ab")
    assert r.header(b"Basic " + secret) == b"Basic " + b"*" * len(secret)
    none = Redactor([])
    assert none.feed(b"abc") == b"abc" and none.flush() == b""


def test_redactor_parts_match_feed_at_every_split() -> None:
    secret = b"tok-0123456789"
    body = b"a" * 40 + b"Bearer " + secret + b"b" * 30 + secret + b"c" * 50 + b"tok-01" + b"d" * 20
    for size in (1, 5, 13, 14, 15, 16, 29, 64):
        whole, parts = (Redactor([secret, b"Bearer " + secret]) for _ in range(2))
        a = b"".join(whole.feed(body[i : i + size]) for i in range(0, len(body), size))
        b = b"".join(
            bytes(p)
            for i in range(0, len(body), size)
            for p in parts.feed_parts(body[i : i + size])
        )
        a, b = a + whole.flush(), b + parts.flush()
        assert a == b and len(b) == len(body) and secret not in b
        assert whole.hits == parts.hits == 2  # "Bearer <secret>" whole, then the bare one
