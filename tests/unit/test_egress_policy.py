"""The egress proxy's policy: address classes, names, allow-lists and caps, host client config.

Host names here are under ``.test`` (reserved for testing); the host's real
registries are only ever read from its own clients, as the code does.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.core.hostname import normalize_host
from agentbox.egress import AllowRule, EgressPolicy, host_registries, proxy_env
from agentbox.egress._addr import (
    address_class,
    check_address,
    host_matches,
    pattern_covers,
)
from agentbox.egress._env import CA_ENV_VARS, host_ca_bundle
from agentbox.errors import ConfigError, PolicyRefused


@pytest.mark.parametrize(
    ("addr", "cls"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("64:ff9b::7f00:1", "loopback"),  # NAT64 of 127.0.0.1
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("::ffff:10.0.0.1", "private"),
        ("fd12:3456::1", "private"),
        ("169.254.169.254", "metadata"),
        ("fd00:ec2::254", "metadata"),
        ("::ffff:169.254.169.254", "metadata"),
        ("169.254.170.2", "metadata"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("100.64.0.1", "cgnat"),
        ("100.127.255.254", "cgnat"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("203.0.113.80", "reserved"),
        ("192.0.2.1", "reserved"),
        ("198.18.0.1", "reserved"),
        ("240.0.0.1", "reserved"),
        ("2001:db8::1", "reserved"),
        ("8.8.8.8", None),
        ("1.1.1.1", None),
        ("2606:4700:4700::1111", None),
    ],
)
def test_address_class(addr: str, cls: str | None) -> None:
    assert address_class(ipaddress.ip_address(addr)) == cls


def _check(addr: str, trusted: bool = False, ranges: tuple[str, ...] = ()) -> str | None:
    nets = tuple(ipaddress.ip_network(r) for r in ranges)
    return check_address(ipaddress.ip_address(addr), trusted_name=trusted, trusted_ranges=nets)


def test_check_address_trusted_names_and_ranges() -> None:
    # A name from the host's own client config may resolve to reserved/private ranges …
    assert _check("203.0.113.80", trusted=True) is None
    assert _check("10.0.0.5", trusted=True) is None
    assert _check("100.64.1.1", trusted=True) is None
    # … never to loopback, multicast, unspecified or metadata.
    assert _check("127.0.0.1", trusted=True) == "loopback"
    assert _check("0.0.0.0", trusted=True) == "unspecified"
    assert _check("169.254.169.254", trusted=True) == "metadata"
    # Any other allowed name only to public addresses …
    assert _check("203.0.113.80") == "reserved"
    assert _check("10.0.0.5") == "private"
    assert _check("8.8.8.8") is None
    # … unless the host setting lists the range; metadata stays refused even then.
    assert _check("203.0.113.80", ranges=("203.0.113.0/24",)) is None
    assert _check("::ffff:203.0.113.80", ranges=("203.0.113.0/24",)) is None
    assert _check("10.0.0.5", ranges=("203.0.113.0/24",)) == "private"
    assert _check("169.254.169.254", ranges=("169.254.0.0/16",)) == "metadata"
    assert _check("169.254.169.254", ranges=("0.0.0.0/0",)) == "metadata"


@pytest.mark.parametrize("name", ["Mirror.Example.TEST.", "a-b.c.test", "xn--bcher-kva.test"])
def test_normalize_host_accepts_names(name: str) -> None:
    assert normalize_host(name) == name.lower().rstrip(".")


@pytest.mark.parametrize(
    "name",
    [
        "127.0.0.1",
        "[::1]",
        "::1",
        "2130706433",  # inet_aton's decimal form of 127.0.0.1
        "0x7f000001",
        "127.1",
        "0177.0.0.1",
        "10.0.0.1.",
        "",
        "a..test",
        "-a.test",
        "a-.test",
        "a_b.test",
        "a b.test",
        "bücher.test",
        "a/b.test",
        "a@b.test",
        "x" * 64 + ".test",
        ("a" * 60 + ".") * 5 + "test",
    ],
)
def test_normalize_host_refuses(name: str) -> None:
    with pytest.raises(ValueError):
        normalize_host(name)


def test_host_patterns() -> None:
    assert host_matches("mirror.test", "mirror.test")
    assert not host_matches("mirror.test", "evil-mirror.test")
    assert host_matches("*.corp.test", "a.corp.test")
    assert host_matches("*.corp.test", "b.a.corp.test")
    assert not host_matches("*.corp.test", "corp.test")
    assert not host_matches("*.corp.test", "evilcorp.test")
    assert pattern_covers("*", "*.x.test")
    assert pattern_covers("*.corp.test", "a.corp.test")
    assert pattern_covers("*.corp.test", "*.a.corp.test")
    assert pattern_covers("*.corp.test", "*.corp.test")
    assert not pattern_covers("*.corp.test", "corp.test")
    assert not pattern_covers("*.corp.test", "*.test")
    assert not pattern_covers("*.corp.test", "*.evilcorp.test")
    assert not pattern_covers("a.corp.test", "*.corp.test")
    assert not pattern_covers("a.corp.test", "*")


def test_decide_ports_and_rules() -> None:
    policy = EgressPolicy(
        rules=(
            AllowRule(pattern="*.corp.test", source="boxfile"),
            AllowRule(pattern="pkgs.corp.test", source="pip", trusted=True,
                      tls_ports=frozenset({443, 8443})),
        )
    )  # fmt: skip
    v = policy.decide("pkgs.corp.test", 8443, tls=True)
    assert v.allowed and v.trusted and v.rule == "pip:pkgs.corp.test"
    v = policy.decide("pkgs.corp.test", 443, tls=True)
    assert v.allowed and v.trusted  # the trusted rule wins over the wildcard
    v = policy.decide("other.corp.test", 443, tls=True)
    assert v.allowed and not v.trusted and v.rule == "boxfile:*.corp.test"
    assert policy.decide("other.corp.test", 22, tls=True).rule == "port"
    assert policy.decide("other.corp.test", 80, tls=False).allowed
    assert policy.decide("other.corp.test", 8080, tls=False).rule == "port"
    assert policy.decide("corp.test", 443, tls=True).rule == "not-allowed"
    assert policy.decide("elsewhere.test", 443, tls=True).rule == "not-allowed"


def test_policy_round_trips_as_json() -> None:
    policy = EgressPolicy(
        rules=(AllowRule(pattern="a.test", source="npm", trusted=True),),
        trusted_ranges=("10.9.0.0/16",),
    )
    assert EgressPolicy.model_validate_json(policy.model_dump_json()) == policy
    with pytest.raises(ValueError):
        AllowRule(pattern="*", source="boxfile")
    with pytest.raises(ValueError):
        AllowRule(pattern="127.0.0.1", source="boxfile")
    with pytest.raises(ValueError):
        EgressPolicy(trusted_ranges=("not-a-range",))


def test_for_phase_caps_boxfile_hosts(tmp_path: Path) -> None:
    none = Settings(data_dir=tmp_path)
    with pytest.raises(PolicyRefused, match="outside this host's egress cap"):
        EgressPolicy.for_phase(none, allow=["api.example.test"])
    capped = Settings(data_dir=tmp_path, egress_allow_cap=("*.example.test", "one.test"))
    policy = EgressPolicy.for_phase(capped, allow=["api.example.test", "*.cdn.example.test"])
    assert policy.hosts == ("api.example.test", "*.cdn.example.test")
    assert all(not r.trusted and r.source == "boxfile" for r in policy.rules)
    for bad in ("two.test", "example.test", "*.test", "*"):
        with pytest.raises(PolicyRefused):
            EgressPolicy.for_phase(capped, allow=[bad])
    for literal in ("10.0.0.1", "[::1]", "2130706433"):
        with pytest.raises(PolicyRefused, match="allow"):
            EgressPolicy.for_phase(capped, allow=[literal])
    anything = Settings(data_dir=tmp_path, egress_allow_cap=("*",))
    assert EgressPolicy.for_phase(anything, allow=["x.y.test"]).hosts == ("x.y.test",)
    ranged = Settings(data_dir=tmp_path, egress_trusted_ranges=("10.1.0.0/16",))
    assert EgressPolicy.for_phase(ranged).trusted_ranges == ("10.1.0.0/16",)


def test_settings_parse_egress_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_EGRESS_ALLOW_CAP", "*.corp.test, one.test")
    monkeypatch.setenv("AGENTBOX_EGRESS_TRUSTED_RANGES", "10.0.0.0/8,192.168.4.7")
    s = Settings()
    assert s.egress_allow_cap == ("*.corp.test", "one.test")
    assert s.egress_trusted_ranges == ("10.0.0.0/8", "192.168.4.7/32")
    monkeypatch.setenv("AGENTBOX_EGRESS_TRUSTED_RANGES", "nonsense")
    with pytest.raises(ValueError):
        Settings()


# -- reading the host's own clients (real pip and npm, a fake HOME) ---------------------------


def _client_env(home: Path, **extra: str) -> dict[str, str]:
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def _python_with_pip() -> str:
    python = shutil.which("python3")
    if python is None:
        pytest.skip("no python3 on PATH")
    probe = subprocess.run([python, "-m", "pip", "--version"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("the host's python3 has no pip")
    return python


def test_pip_config_is_read(tmp_path: Path) -> None:
    _python_with_pip()
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\n"
        "index-url = https://pkgs.corp.test/simple\n"
        "extra-index-url =\n    http://cache.corp.test:8080/simple\n    file:///srv/wheels\n"
        "find-links = https://wheels.corp.test/links /srv/local\n"
    )
    found = host_registries(_client_env(tmp_path, PIP_CONFIG_FILE=str(conf)))
    pip = {(sch, h, p) for src, sch, h, p in found if src == "pip"}
    assert ("https", "pkgs.corp.test", 443) in pip
    assert ("http", "cache.corp.test", 8080) in pip
    assert ("https", "wheels.corp.test", 443) in pip
    # An index-url is configured: pip's own default index is not added.
    default = _pip_default()
    assert default[0] not in {h for _, h, _ in pip}


def _pip_default() -> tuple[str, str]:
    """pip's default index host and file domain, asked of the host's pip (as the code does)."""
    python = _python_with_pip()
    out = subprocess.run(
        [python, "-c", "from pip._internal.models.index import PyPI as P\n"
         "print(P.netloc); print(P.file_storage_domain)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return out[0], out[1]


def test_pip_default_index_and_its_file_domain(tmp_path: Path) -> None:
    found = host_registries(_client_env(tmp_path, PIP_CONFIG_FILE=os.devnull))
    pip = {(sch, h) for src, sch, h, _ in found if src == "pip"}
    index, files = _pip_default()
    assert pip == {("https", index), ("https", files)}


def test_policy_for_registries_trusts_them(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = http://pkgs.corp.test:3141/root/simple\n")
    env = _client_env(tmp_path, PIP_CONFIG_FILE=str(conf))
    policy = EgressPolicy.for_phase(Settings(data_dir=tmp_path), registries=True, env=env)
    rule = next(r for r in policy.rules if r.pattern == "pkgs.corp.test")
    assert rule.trusted and rule.source == "pip" and rule.http_ports == {80, 3141}
    assert policy.decide("pkgs.corp.test", 3141, tls=False).allowed
    assert not policy.decide("pkgs.corp.test", 3141, tls=True).allowed
    none = EgressPolicy.for_phase(Settings(data_dir=tmp_path), registries=False, env=env)
    assert none.rules == ()


def test_npm_registries_are_read(tmp_path: Path) -> None:
    if shutil.which("npm") is None:
        pytest.skip("no npm on this host")
    rc = tmp_path / "npmrc"
    rc.write_text(
        "registry=https://npm.corp.test/\n@corp:registry=https://scoped.corp.test:4873/\n"
    )
    found = host_registries(
        _client_env(tmp_path, PIP_CONFIG_FILE=os.devnull, npm_config_userconfig=str(rc))
    )
    npm = {(sch, h, p) for src, sch, h, p in found if src == "npm"}
    assert npm == {("https", "npm.corp.test", 443), ("https", "scoped.corp.test", 4873)}


def test_uv_variables_and_non_http_urls(tmp_path: Path) -> None:
    env = _client_env(
        tmp_path,
        PIP_CONFIG_FILE=os.devnull,
        UV_INDEX_URL="https://uv.corp.test/simple",
        UV_EXTRA_INDEX_URL="file:///srv/x https://extra.corp.test/simple",
        UV_INDEX="internal=https://named.corp.test/simple",
        UV_DEFAULT_INDEX="ftp://nope.corp.test/ https://10.0.0.1/simple",
    )
    found = host_registries(env)
    uv = {h for src, _, h, _ in found if src == "uv"}
    assert uv == {"uv.corp.test", "extra.corp.test", "named.corp.test"}


def test_missing_clients_contribute_nothing(tmp_path: Path) -> None:
    assert host_registries({"PATH": str(tmp_path), "HOME": str(tmp_path)}) == ()


# -- the environment of a phase with egress -----------------------------------------------------


def test_proxy_env_and_ca_bundle(tmp_path: Path) -> None:
    env = proxy_env(3128, "/run/agentbox/egress/ca.pem")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "npm_config_proxy",
                "npm_config_https_proxy"):  # fmt: skip
        assert env[var] == "http://127.0.0.1:3128"
    assert "127.0.0.1" in env["NO_PROXY"].split(",")
    for var in ("SSL_CERT_FILE", "PIP_CERT", "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO",
                "REQUESTS_CA_BUNDLE"):  # fmt: skip
        assert var in CA_ENV_VARS and env[var] == "/run/agentbox/egress/ca.pem"
    with pytest.raises(ConfigError):
        proxy_env(0, "/x")
    bundle = host_ca_bundle(Settings(data_dir=tmp_path))
    assert (
        bundle.is_file() and not bundle.is_symlink() and b"BEGIN CERTIFICATE" in bundle.read_bytes()
    )
    mine = tmp_path / "corp-ca.pem"
    mine.write_text("-----BEGIN CERTIFICATE-----\n")
    assert host_ca_bundle(Settings(data_dir=tmp_path, egress_ca_bundle=mine)) == mine.resolve()
    with pytest.raises(ConfigError):
        host_ca_bundle(Settings(data_dir=tmp_path, egress_ca_bundle=tmp_path / "missing.pem"))


def test_public_api() -> None:
    import agentbox.egress as eg

    assert set(eg.__all__) >= {"EgressPolicy", "spawn_proxy", "summarize", "EgressSummary",
                               "ProxyHandle", "host_ca_bundle", "proxy_env"}  # fmt: skip
    for name in eg.__all__:
        assert getattr(eg, name).__doc__, name
    assert sys.modules["agentbox.egress"] is eg
