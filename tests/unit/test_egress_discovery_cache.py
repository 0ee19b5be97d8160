"""The host's registry discovery is cached (issue 12): a phase with egress no longer asks
pip and npm (seconds each under load) on every task, and any change to what steers them
is a miss. The clients here are real programs on a private ``PATH`` that count their runs."""

from __future__ import annotations

from pathlib import Path

from agentbox.egress import _hostcfg
from agentbox.egress._hostcfg import client_fingerprint, host_registries

FAKE_PYTHON = """#!/bin/sh
echo run >> "{count}"
if [ "$1" = "-m" ]; then
  /bin/sed -n 's/^index = \\(.*\\)$/global.index-url='"'"'\\1'"'"'/p' "$PIP_CONFIG_FILE"
fi
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    bindir = tmp_path / "bin"
    if not bindir.exists():
        bindir.mkdir()
        py = bindir / "python3"
        py.write_text(FAKE_PYTHON.format(count=tmp_path / "count"))
        py.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {"PATH": str(bindir), "HOME": str(home), **extra}


def _runs(tmp_path: Path) -> int:
    try:
        return len((tmp_path / "count").read_text().splitlines())
    except FileNotFoundError:
        return 0


def test_second_discovery_is_cached_and_a_config_change_is_a_miss(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("index = https://one.corp.test/simple\n")
    env = _env(tmp_path, PIP_CONFIG_FILE=str(conf))
    first = host_registries(env)
    assert ("pip", "https", "one.corp.test", 443) in first
    asked = _runs(tmp_path)
    assert asked >= 1
    # Same clients, same files, same variables: the clients are not asked again.
    assert host_registries(env) == first
    assert _runs(tmp_path) == asked
    # The config file's content changes: a miss, and the new index is seen.
    conf.write_text("index = https://two.corp.test/simple\n")
    second = host_registries(env)
    assert ("pip", "https", "two.corp.test", 443) in second
    assert ("pip", "https", "one.corp.test", 443) not in second
    assert _runs(tmp_path) > asked


def test_a_steering_variable_changes_the_key(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("index = https://one.corp.test/simple\n")
    env = _env(tmp_path, PIP_CONFIG_FILE=str(conf))
    base = client_fingerprint(env)
    assert client_fingerprint(dict(env)) == base
    assert client_fingerprint({**env, "PIP_INDEX_URL": "https://x.corp.test/"}) != base
    assert client_fingerprint({**env, "npm_config_registry": "https://n.corp.test/"}) != base
    assert client_fingerprint({**env, "UV_INDEX_URL": "https://u.corp.test/"}) != base
    # A variable that steers no client does not.
    assert client_fingerprint({**env, "TERM": "dumb"}) == base
    # A new user config file appears: a miss.
    (Path(env["HOME"]) / ".npmrc").write_text("registry=https://n.corp.test/\n")
    assert client_fingerprint(env) != base


def test_the_cache_expires(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("index = https://one.corp.test/simple\n")
    env = _env(tmp_path, PIP_CONFIG_FILE=str(conf))
    host_registries(env)
    asked = _runs(tmp_path)
    key = client_fingerprint(env)
    stamp, found = _hostcfg._cache[key]
    _hostcfg._cache[key] = (stamp - _hostcfg.CACHE_TTL - 1, found)
    host_registries(env)
    assert _runs(tmp_path) > asked
    assert host_registries(env, cache=False) == found
