"""Host pip/npm/netrc/git credentials become injection rules; the sandbox config has none."""

from __future__ import annotations

import base64
import os
import subprocess
from pathlib import Path

import pytest

from agentbox.egress._hostcreds import (
    GIT_REFUSE_MESSAGE,
    Brokered,
    combine,
    git_fetch,
    host_credentials,
)
from agentbox.egress.rules import Inject, NetworkRule, expand, match_rule
from agentbox.errors import PolicyRefused
from keyring_helpers import keyring_home

UID = os.geteuid()


def _home(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    (home / ".config" / "pip").mkdir(parents=True)
    return {"HOME": str(home), "PATH": os.environ["PATH"]}


def _secret_free(b: Brokered, *secrets: str) -> None:
    text = repr(b) + str(b.env) + b.npmrc + " ".join(b.notes) + repr(b.rules)
    for s in secrets:
        assert s not in text


def _injected(b: Brokered, host: str, path: str, phase: str = "setup") -> str | None:
    rule = match_rule(b.rules, host=host, method="GET", path=path, phase=phase)
    if rule is None or rule.inject is None:
        return None
    return expand(rule.inject.value, b.values)


def test_pip_index_url_with_credentials(tmp_path: Path) -> None:
    env = _home(tmp_path)
    Path(env["HOME"], ".config/pip/pip.conf").write_text(
        "[global]\nindex-url = https://corp:s3cret-pip@pypi.corp.example/simple/\n"
    )
    b = host_credentials(UID, env=env)
    want = "Basic " + base64.b64encode(b"corp:s3cret-pip").decode()
    assert _injected(b, "pypi.corp.example", "/simple/x/") == want
    assert _injected(b, "pypi.corp.example", "/packages/x.whl") == want
    assert _injected(b, "pypi.corp.example", "/simple/x/", phase="agent") is None
    assert _injected(b, "other.example", "/simple/x/") is None
    assert b.env["PIP_INDEX_URL"] == "https://pypi.corp.example/simple/"
    assert b.rules[0].origin == "host-pip"
    _secret_free(b, "s3cret-pip", want.split()[1])


def test_pip_env_and_netrc(tmp_path: Path) -> None:
    env = _home(tmp_path)
    Path(env["HOME"], ".netrc").write_text(
        "machine pypi.corp.example login corp password netrc-pass\n"
    )
    Path(env["HOME"], ".netrc").chmod(0o600)
    env["PIP_INDEX_URL"] = "https://pypi.corp.example/simple/"
    env["PIP_EXTRA_INDEX_URL"] = "https://u:extra-pass@extra.corp.example/simple/"
    b = host_credentials(UID, env=env)
    assert (
        _injected(b, "pypi.corp.example", "/simple/")
        == "Basic " + base64.b64encode(b"corp:netrc-pass").decode()
    )
    assert (
        _injected(b, "extra.corp.example", "/simple/")
        == "Basic " + base64.b64encode(b"u:extra-pass").decode()
    )
    assert {r.origin for r in b.rules} == {"host-netrc", "host-pip"}
    assert b.env == {
        "PIP_INDEX_URL": "https://pypi.corp.example/simple/",
        "PIP_EXTRA_INDEX_URL": "https://extra.corp.example/simple/",
    }
    _secret_free(b, "netrc-pass", "extra-pass")


def test_pip_password_from_the_users_keyring(tmp_path: Path) -> None:
    env = _home(tmp_path)
    # pip's own pattern: the index URL names the user, the keyring holds the password
    # (under the index URL, or under its host as the second index does).
    Path(env["HOME"], ".config/pip/pip.conf").write_text(
        "[global]\nindex-url = https://corp@pypi.corp.example/simple/\n"
        "extra-index-url = https://bot@extra.corp.example/simple/ https://none.corp.example/s/\n"
    )
    keyring_home(env, {
        ("https://pypi.corp.example/simple/", "corp"): "kr-pass-1",
        ("extra.corp.example", "bot"): "kr-pass-2",
    })  # fmt: skip
    b = host_credentials(UID, env=env)
    assert _injected(b, "pypi.corp.example", "/simple/x/") == (
        "Basic " + base64.b64encode(b"corp:kr-pass-1").decode()
    )
    assert _injected(b, "extra.corp.example", "/simple/x/") == (
        "Basic " + base64.b64encode(b"bot:kr-pass-2").decode()
    )
    assert _injected(b, "none.corp.example", "/s/") is None
    assert {r.origin for r in b.rules} == {"host-keyring"}
    assert any("keyring" in n for n in b.notes)
    assert b.env["PIP_INDEX_URL"] == "https://pypi.corp.example/simple/"
    _secret_free(b, "kr-pass-1", "kr-pass-2")


def test_a_password_in_the_url_wins_over_the_keyring(tmp_path: Path) -> None:
    env = _home(tmp_path)
    Path(env["HOME"], ".config/pip/pip.conf").write_text(
        "[global]\nindex-url = https://corp:url-pass@pypi.corp.example/simple/\n"
    )
    keyring_home(env, {("https://pypi.corp.example/simple/", "corp"): "kr-pass"})
    b = host_credentials(UID, env=env)
    assert _injected(b, "pypi.corp.example", "/simple/") == (
        "Basic " + base64.b64encode(b"corp:url-pass").decode()
    )
    assert {r.origin for r in b.rules} == {"host-pip"}


def test_npmrc_tokens_and_scopes(tmp_path: Path) -> None:
    env = _home(tmp_path)
    env["NPM_TOKEN"] = "npm-tok-from-env"
    Path(env["HOME"], ".npmrc").write_text(
        "registry=https://npm.corp.example/\n"
        "@corp:registry=https://npm.corp.example/scoped/\n"
        "//npm.corp.example/:_authToken=${NPM_TOKEN}\n"
        "//basic.corp.example/:_auth=dTpw\n"
    )
    b = host_credentials(UID, env=env)
    assert _injected(b, "npm.corp.example", "/@corp%2fgreet") == "Bearer npm-tok-from-env"
    assert _injected(b, "basic.corp.example", "/x") == "Basic dTpw"
    assert "registry=https://npm.corp.example/" in b.npmrc
    assert "@corp:registry=https://npm.corp.example/scoped/" in b.npmrc
    assert "//npm.corp.example/:_authToken=agentbox-brokered" in b.npmrc
    assert {r.origin for r in b.rules} == {"host-npm"}
    _secret_free(b, "npm-tok-from-env", "dTpw")


def test_nothing_configured_brokers_nothing(tmp_path: Path) -> None:
    b = host_credentials(UID, env=_home(tmp_path))
    assert b.rules == () and dict(b.values) == {} and b.npmrc == ""


def test_a_boxfile_rule_cannot_name_a_brokered_value() -> None:
    evil = NetworkRule(
        host="attacker.example",
        inject=Inject("X-Leak", "${secret:AGENTBOX_HOST_PIP_1}"),
    )
    with pytest.raises(PolicyRefused, match="reserved"):
        combine([evil], Brokered())
    ok = NetworkRule(host="docs.example")
    assert combine([ok], Brokered()) == (ok,)


def _repo(tmp_path: Path, url: str) -> Path:
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "remote", "add", "origin", url], check=True)
    return repo


def test_git_fetch_allows_upload_pack_refuses_receive_pack(tmp_path: Path) -> None:
    env = _home(tmp_path)
    Path(env["HOME"], ".git-credentials").write_text("https://dev:helper-pass@git.corp.example\n")
    Path(env["HOME"], ".gitconfig").write_text("[credential]\n\thelper = store\n")
    repo = _repo(tmp_path, "https://git.corp.example/team/proj.git")
    b = git_fetch(repo, UID, env=env)
    want = "Basic " + base64.b64encode(b"dev:helper-pass").decode()
    rules = combine([], b)
    get = match_rule(
        rules, host="git.corp.example", method="GET", path="/team/proj.git/info/refs",
        phase="agent", query="service=git-upload-pack",
    )  # fmt: skip
    assert get is not None and get.inject is not None
    assert expand(get.inject.value, b.values) == want
    post = match_rule(
        rules, host="git.corp.example", method="POST", path="/team/proj.git/git-upload-pack",
        phase="agent",
    )  # fmt: skip
    assert post is not None and not post.deny
    for method, path, query in (
        ("GET", "/team/proj.git/info/refs", "service=git-receive-pack"),
        ("POST", "/team/proj.git/git-receive-pack", ""),
    ):
        rule = match_rule(
            rules, host="git.corp.example", method=method, path=path, phase="agent", query=query
        )
        assert rule is not None and rule.deny and rule.refuse_message == GIT_REFUSE_MESSAGE
    # Another repo on the same host is not fetchable.
    assert match_rule(
        rules, host="git.corp.example", method="POST", path="/team/other.git/git-upload-pack",
        phase="agent",
    ) is None  # fmt: skip
    assert b.env["GIT_CONFIG_VALUE_0"] == "https://git.corp.example/team/proj.git"
    _secret_free(b, "helper-pass", want.split()[1])


def test_git_fetch_url_credentials_are_stripped(tmp_path: Path) -> None:
    repo = _repo(tmp_path, "https://tok:url-pass@git.corp.example/proj.git")
    b = git_fetch(repo, UID, env=_home(tmp_path))
    assert b.env["GIT_CONFIG_VALUE_0"] == "https://git.corp.example/proj.git"
    assert list(b.values.values()) == ["Basic " + base64.b64encode(b"tok:url-pass").decode()]
    _secret_free(b, "url-pass")


def test_git_fetch_refuses_a_non_https_remote(tmp_path: Path) -> None:
    repo = _repo(tmp_path, "git@git.corp.example:proj.git")
    with pytest.raises(PolicyRefused, match="not an https URL"):
        git_fetch(repo, UID, env=_home(tmp_path))


def test_boxfile_git_section() -> None:
    from agentbox.boxfile import loads_boxfile
    from agentbox.errors import BoxfileError

    here = Path("Boxfile")
    box = loads_boxfile('[git]\nfetch = true\nsecret = "CORP_GIT_TOKEN"\n', path=here)
    assert box.git.fetch and box.git.remote == "origin" and box.git.secret == "CORP_GIT_TOKEN"
    assert not loads_boxfile("", path=here).git.fetch
    for bad in ("[git]\npush = true\n", '[git]\nsecret = "AGENTBOX_GIT_FETCH"\n'):
        with pytest.raises(BoxfileError):
            loads_boxfile(bad, path=here)
