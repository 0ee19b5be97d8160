"""Request-level egress rules: construction checks, matching, the paste-able suggestion."""

from __future__ import annotations

import tomllib

import pytest

from agentbox.egress.rules import (
    Inject,
    NetworkRule,
    canonical_path,
    match_rule,
    path_matches,
    rule_hosts,
    secret_names,
    suggest_rule,
)

PYPI = NetworkRule(
    host="PyPI.Corp.Example.",
    paths=("/simple/*", "/packages/*"),
    inject=Inject("Authorization", "Bearer ${secret:CORP_PYPI_TOKEN}"),
    phases=frozenset({"setup"}),
)
GIT_DENY = NetworkRule(
    host="git.example",
    methods=("POST",),
    paths=("/*/git-receive-pack",),
    refuse_message="results are published from the host",
    origin="git-fetch",
)
WILD = NetworkRule(host="*.corp.example", methods=("get",))


def test_defaults_and_normalization() -> None:
    r = NetworkRule(host="a.example")
    assert r.methods == ("GET", "HEAD") and r.paths == ("/*",)
    assert r.phases == frozenset({"setup", "agent"}) and r.origin == "boxfile"
    assert PYPI.host == "pypi.corp.example"
    assert WILD.methods == ("GET",)
    assert GIT_DENY.deny and not PYPI.deny


@pytest.mark.parametrize(
    ("kwargs", "msg"),
    [
        ({"host": "*"}, "names everything"),
        ({"host": "10.0.0.1"}, "IP literal"),
        ({"host": "a.example", "methods": ()}, "methods"),
        ({"host": "a.example", "methods": ("CONNECT",)}, "CONNECT"),
        ({"host": "a.example", "paths": ("simple/*",)}, "start with"),
        ({"host": "a.example", "paths": ("/a?x=1",)}, "query"),
        ({"host": "a.example", "phases": frozenset({"build"})}, "phases"),
        ({"host": "a.example", "origin": "elsewhere"}, "origin"),
        (
            {"host": "a.example", "refuse_message": "no", "inject": Inject("X-A", "b")},
            "deny rule",
        ),
    ],
)
def test_bad_rules_refused(kwargs: dict[str, object], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        NetworkRule(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("Host", "x"),
        ("content-length", "1"),
        ("Transfer-Encoding", "chunked"),
        ("Bad Header", "x"),
        ("X-Token", "a\r\nX-Evil: 1"),
        ("X-Token", "${secret:1bad}"),
    ],
)
def test_bad_inject_refused(header: str, value: str) -> None:
    with pytest.raises(ValueError):
        Inject(header, value)


def test_path_globs() -> None:
    assert path_matches("/simple/*", "/simple/requests/")
    assert path_matches("/simple/*", "/simple/a/b/c")
    assert not path_matches("/simple/*", "/simple")
    assert not path_matches("/simple/*", "/packages/x")
    assert path_matches("/*/info/refs", "/org/repo.git/info/refs")
    assert path_matches("/exact", "/exact") and not path_matches("/exact", "/exact/")
    assert path_matches("/a.b", "/a.b") and not path_matches("/a.b", "/axb")


def test_match_first_rule_host_method_path_phase() -> None:
    rules = [GIT_DENY, PYPI, WILD]
    hit = lambda **kw: match_rule(rules, **{"method": "GET", "phase": "setup", **kw})  # noqa: E731
    assert hit(host="pypi.corp.example", path="/simple/x/") is PYPI
    # the same host, a path the first rule does not name: the wildcard rule (first match order)
    assert hit(host="pypi.corp.example", path="/admin") is WILD
    assert hit(host="pypi.corp.example", path="/simple/x/", phase="agent") is WILD
    assert hit(host="pypi.corp.example", path="/simple/x/", method="DELETE") is None
    assert hit(host="corp.example", path="/") is None  # *.suffix: strict subdomains
    assert hit(host="evilcorp.example", path="/") is None
    assert hit(host="git.example", path="/o/r/git-receive-pack", method="POST") is GIT_DENY
    assert hit(host="git.example", path="/o/r/git-upload-pack", method="POST") is None
    assert hit(host="other.example", path="/simple/x/") is None


def test_query_must_equal_when_set() -> None:
    r = NetworkRule(host="g.example", paths=("/*/info/refs",), query="service=git-upload-pack")
    assert r.matches("g.example", "GET", "/r/info/refs", "agent", "service=git-upload-pack")
    assert not r.matches("g.example", "GET", "/r/info/refs", "agent", "service=git-receive-pack")
    assert not r.matches("g.example", "GET", "/r/info/refs", "agent", "")


@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ("/simple/x/", True),
        ("/simple/../admin", False),
        ("/simple/./x", False),
        ("/simple/%2e%2e/admin", False),
        ("/simple/a%2Fb", True),  # npm: /@scope%2fname
        ("/@corp%2fgreet", True),
        ("/simple%2f..%2fadmin", False),
        ("/simple/x%2f../admin", False),
        ("/simple%2f%2fx", False),
        ("/simple//x", False),
        ("/simple\\x", False),
        ("/a b", False),
        ("/simple/%2541", False),
        ("/simple/caf%C3%A9", True),
        ("relative", False),
    ],
)
def test_canonical_path(path: str, ok: bool) -> None:
    assert canonical_path(path) is ok


def test_round_trip_and_secrets() -> None:
    for r in (PYPI, GIT_DENY, WILD):
        assert NetworkRule.from_dict(r.to_dict()) == r
    assert secret_names([PYPI, GIT_DENY, WILD]) == ("CORP_PYPI_TOKEN",)
    assert rule_hosts([PYPI, WILD, PYPI]) == ("pypi.corp.example", "*.corp.example")
    assert "CORP_PYPI_TOKEN" in PYPI.name or "pypi.corp.example" in PYPI.name
    assert "secret" not in str(PYPI.to_dict()["host"])


def test_suggestion_is_pasteable_toml() -> None:
    text = suggest_rule("Pypi.Corp.Example", "post", "/upload/a/b?token=x")
    doc = tomllib.loads(text)
    (rule,) = doc["network"]["rule"]
    assert rule == {"host": "pypi.corp.example", "methods": ["POST"], "paths": ["/upload/*"]}
    r = NetworkRule(host=rule["host"], methods=tuple(rule["methods"]), paths=tuple(rule["paths"]))
    assert r.matches("pypi.corp.example", "POST", "/upload/a/b", "agent")
    assert "token" not in text
    assert tomllib.loads(suggest_rule("a.example", "GET", "/"))["network"]["rule"][0]["paths"] == [
        "/"
    ]


def test_policy_with_rules_decides_rule_hosts_per_request() -> None:
    from agentbox.egress import EgressPolicy

    base = EgressPolicy()
    assert base.network_rules == ()  # computed (and cached) before with_rules
    pol = base.with_rules([PYPI, WILD])
    assert pol.network_rules == (WILD,)  # the default phase is "agent"; PYPI is setup-only
    assert pol.decide("a.corp.example", 443, tls=True).rule == "rules"
    assert pol.decide("a.corp.example", 80, tls=False).allowed is False  # never plain HTTP
    assert pol.decide("other.example", 443, tls=True).rule == "not-allowed"
    setup = EgressPolicy(phase="setup").with_rules([PYPI])
    assert setup.network_rules == (PYPI,) and "pypi.corp.example" in setup.hosts


def test_egress_hosts_address_is_checked_like_a_registry_name(tmp_path: object) -> None:
    import asyncio

    from agentbox.egress import EgressPolicy
    from agentbox.egress._proxy import EgressProxy
    from agentbox.egress._request import Attempt, _Refuse

    class _NoLog:
        def write(self, **_: object) -> None:
            pass

    pol = EgressPolicy(hosts_map={"corp.example": "10.1.2.3", "lo.example": "127.0.0.1",
                                  "md.example": "169.254.169.254"})  # fmt: skip
    proxy = EgressProxy(pol, _NoLog())  # type: ignore[arg-type]

    async def addrs(host: str) -> object:
        return await proxy._addresses(Attempt(conn=1, start=0.0), host, 443, trusted=False)

    assert [str(a) for a in asyncio.run(addrs("corp.example"))] == ["10.1.2.3"]  # type: ignore[attr-defined]
    for host, why in (("lo.example", "loopback"), ("md.example", "metadata")):
        with pytest.raises(_Refuse) as err:
            asyncio.run(addrs(host))
        assert err.value.rule == f"address:{why}"
