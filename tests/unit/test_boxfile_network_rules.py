"""Boxfile ``[[network.rule]]`` parsing and the egress host settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.boxfile import loads_boxfile
from agentbox.config import Settings
from agentbox.egress.rules import Inject, NetworkRule
from agentbox.errors import BoxfileError

ISSUE_EXAMPLE = """
[[network.rule]]
host = "pypi.corp.example"
methods = ["GET", "HEAD"]
paths = ["/simple/*", "/packages/*"]
inject = { header = "Authorization", value = "Bearer ${secret:CORP_PYPI_TOKEN}" }
phases = ["setup"]

[[network.rule]]
host = "*.corp.example"
"""


def _load(text: str):  # type: ignore[no-untyped-def]
    return loads_boxfile(text, path=Path("Boxfile"))


def test_issue_example_parses_into_rules() -> None:
    box = _load(ISSUE_EXAMPLE)
    first, second = box.network_rules()
    assert first == NetworkRule(
        host="pypi.corp.example",
        paths=("/simple/*", "/packages/*"),
        inject=Inject("Authorization", "Bearer ${secret:CORP_PYPI_TOKEN}"),
        phases=frozenset({"setup"}),
    )
    assert first.line == 1 and second.line == 2
    assert second.methods == ("GET", "HEAD") and second.phases == frozenset({"setup", "agent"})
    assert box.network_rules("agent") == (second,)
    assert box.egress_allow == ()
    assert _load('image = "x"\n').network_rules() == ()


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ('host = "a.example"\nbogus = 1', "rule.0.bogus: unknown key"),
        ('host = "a.example"\ninject = { header = "X", value = "v", x = 1 }', "unknown key"),
        ('host = "${secret:A}.example"', "only in inject.value"),
        ('host = "a.example"\npaths = ["/${secret:A}"]', "only in inject.value"),
        (
            'host = "a.example"\ninject = { header = "${secret:A}", value = "v" }',
            "only in inject.value",
        ),
        ('host = "a.example"\ninject = { header = "X", value = "${secret:lower}" }', "lower"),
        ('host = "a.example"\ninject = { header = "X", value = "${secret:OPEN" }', "unclosed"),
        ('host = "a.example"\ninject = { header = "Host", value = "v" }', "cannot be set"),
        ('host = "10.0.0.1"', "IP literals"),
        ('host = "*"', "host"),
        ('host = "a.example"\nphases = ["build"]', "phases"),
        ('host = "a.example"\npaths = ["simple/*"]', "start with"),
        ('host = "a.example"\nmethods = []', "methods"),
    ],
)
def test_bad_rules_refused_by_key(body: str, words: str) -> None:
    with pytest.raises(BoxfileError) as err:
        _load("[[network.rule]]\n" + body + "\n")
    assert words in str(err.value)
    assert "Value error" not in str(err.value)


def test_secret_values_are_never_read_from_a_boxfile() -> None:
    # A reference is only a name: loading never resolves it, whatever the environment holds.
    box = _load(ISSUE_EXAMPLE)
    rule = box.network_rules()[0]
    assert rule.inject is not None and rule.inject.secrets == ("CORP_PYPI_TOKEN",)


def test_egress_host_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_EGRESS_HOSTS", "PyPI.Corp.Example=10.1.2.3, git.corp=fd00::1")
    monkeypatch.setenv("AGENTBOX_EGRESS_UPSTREAM_CA", "/a.pem:/b.pem")
    s = Settings()
    assert s.egress_hosts == {"pypi.corp.example": "10.1.2.3", "git.corp": "fd00::1"}
    assert s.egress_upstream_ca == (Path("/a.pem"), Path("/b.pem"))
    monkeypatch.setenv("AGENTBOX_EGRESS_HOSTS", "pypi.corp.example")
    with pytest.raises(ValueError, match="NAME=ADDRESS"):
        Settings()
    monkeypatch.setenv("AGENTBOX_EGRESS_HOSTS", "pypi.corp.example=not-an-address")
    with pytest.raises(ValueError):
        Settings()
