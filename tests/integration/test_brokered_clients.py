"""Host credentials brokered by the real egress proxy to real private servers, with real clients.

pip, npm and git run on the host but reach the servers only through a task's proxy
process (its unix socket relayed to a loopback port by socat), with the configuration a
sandbox gets: registries and remote named without any credential, the task CA trusted.
The credentials come from a fake user's pip.conf, .npmrc and git credential store,
read by :mod:`agentbox.egress._hostcreds`; the proxy injects them. Push is refused.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.config import load_settings
from agentbox.egress import EgressPolicy, spawn_proxy
from agentbox.egress._hostcreds import (
    GIT_REFUSE_MESSAGE,
    Brokered,
    combine,
    git_fetch,
    host_credentials,
)
from keyring_helpers import keyring_home
from net_helpers import free_port
from private_servers import GIT_HOST, NPM_HOST, NPM_PACKAGE, PYPI_HOST, missing, private_servers

pytestmark = pytest.mark.skipif(
    bool(missing()) or shutil.which("socat") is None, reason=f"needs {missing() or 'socat'}"
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    with private_servers(tmp_path_factory.mktemp("srv") / "s") as srv:
        yield srv


def _user_home(tmp: Path, srv: object) -> dict[str, str]:
    home = tmp / "home"
    (home / ".config" / "pip").mkdir(parents=True)
    (home / ".config" / "pip" / "pip.conf").write_text(
        f"[global]\nindex-url = https://{srv.user}:{srv.password}@{PYPI_HOST}/simple/\n"  # type: ignore[attr-defined]
    )
    (home / ".npmrc").write_text(
        f"@corp:registry=https://{NPM_HOST}/\n//{NPM_HOST}/:_authToken={srv.npm_token}\n"  # type: ignore[attr-defined]
    )
    (home / ".git-credentials").write_text(
        f"https://{srv.user}:{srv.password}@{GIT_HOST}\n"  # type: ignore[attr-defined]
    )
    (home / ".gitconfig").write_text("[credential]\n\thelper = store\n")
    return {"HOME": str(home), "PATH": os.environ["PATH"]}


class Proxy:
    def __init__(self, tmp: Path, srv: object, phase: str, brokered: Brokered) -> None:
        settings = load_settings().model_copy(
            update={
                "egress_hosts": dict(srv.addresses),  # type: ignore[attr-defined]
                "egress_upstream_ca": (srv.ca_path,),  # type: ignore[attr-defined]
            }
        )
        policy = EgressPolicy.for_phase(settings, phase=phase)  # type: ignore[arg-type]
        self.dir = tmp / f"proxy-{phase}"
        self.dir.mkdir()
        self.log = self.dir / "egress.jsonl"
        self.handle = spawn_proxy(
            self.dir / "egress.sock", policy, self.log,
            rules=combine([], brokered), secret_values=brokered.values,
        )  # fmt: skip
        assert self.handle.ca_cert is not None
        self.ca = self.dir / "task-ca.pem"
        self.ca.write_bytes(self.handle.ca_cert)
        self.port = free_port()
        self.relay = subprocess.Popen(
            ["socat", f"TCP-LISTEN:{self.port},bind=127.0.0.1,reuseaddr,fork",
             f"UNIX-CONNECT:{self.dir / 'egress.sock'}"],
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def env(self, home: Path) -> dict[str, str]:
        """A sandbox-like environment: proxy variables, the task CA, a home with no secret."""
        return {
            "PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8",
            "HTTPS_PROXY": self.url, "https_proxy": self.url, "NO_PROXY": "127.0.0.1",
            "SSL_CERT_FILE": str(self.ca), "PIP_CERT": str(self.ca),
            "NODE_EXTRA_CA_CERTS": str(self.ca), "npm_config_cafile": str(self.ca),
            "GIT_SSL_CAINFO": str(self.ca), "npm_config_https_proxy": self.url,
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_CONFIG_FILE": "/dev/null",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
        }  # fmt: skip

    def close(self) -> None:
        self.relay.terminate()
        self.relay.wait(timeout=10)
        self.handle.stop(grace=2.0)

    def lines(self) -> list[dict[str, object]]:
        return [json.loads(x) for x in self.log.read_text().splitlines() if x.strip()]


def _nowhere(secrets: list[str], *paths: Path, texts: tuple[str, ...] = ()) -> None:
    for p in paths:
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        for f in files:
            data = f.read_bytes()
            for s in secrets:
                assert s.encode() not in data, f"a credential is in {f}"
    for t in texts:
        for s in secrets:
            assert s not in t


def _pip_install_corp_util(env: dict[str, str], target: Path) -> subprocess.CompletedProcess[str]:
    """pip installs the private index's package into ``target`` through the proxy in ``env``."""
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--target", str(target),
         "corp-util==1.0"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert (target / "corp_util.py").read_text() == "VALUE = 42\n"
    return pip


def test_setup_pip_and_npm_through_brokered_credentials(tmp_path: Path, servers: object) -> None:
    srv = servers
    user_env = _user_home(tmp_path, srv)
    brokered = host_credentials(os.geteuid(), env=user_env)
    assert {r.origin for r in brokered.rules} == {"host-pip", "host-npm"}
    proxy = Proxy(tmp_path, srv, "setup", brokered)
    box_home = tmp_path / "box-home"
    box_home.mkdir()
    (box_home / ".npmrc").write_text(brokered.npmrc)
    try:
        env = proxy.env(box_home) | dict(brokered.env)
        target = tmp_path / "site"
        pip = _pip_install_corp_util(env, target)
        proj = tmp_path / "npmproj"
        proj.mkdir()
        (proj / "package.json").write_text('{"name": "p", "version": "1.0.0"}')
        npm = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--cache", str(tmp_path / "npmcache"),
             NPM_PACKAGE],
            cwd=proj, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert npm.returncode == 0, npm.stdout + npm.stderr
        assert (proj / "node_modules" / "@corp" / "greet" / "index.js").exists()
    finally:
        proxy.close()
    lines = proxy.lines()
    assert any(x.get("host") == PYPI_HOST and x.get("injected") for x in lines), lines
    assert any(x.get("host") == NPM_HOST and x.get("injected") for x in lines), lines
    _nowhere(
        srv.secrets(),  # type: ignore[attr-defined]
        box_home, target, proj, proxy.log,
        texts=(pip.stdout, pip.stderr, npm.stdout, npm.stderr, json.dumps(dict(brokered.env))),
    )  # fmt: skip


def test_setup_pip_with_the_password_in_the_users_keyring(tmp_path: Path, servers: object) -> None:
    """pip's keyring pattern: the index URL names the user, the user's keyring (the real
    library, a file backend chosen by keyringrc.cfg) holds the password; read as the
    user, injected by the proxy, nowhere in what the sandbox gets or sees."""
    srv = servers
    home = tmp_path / "home"
    (home / ".config" / "pip").mkdir(parents=True)
    (home / ".config" / "pip" / "pip.conf").write_text(
        f"[global]\nindex-url = https://{srv.user}@{PYPI_HOST}/simple/\n"  # type: ignore[attr-defined]
    )
    user_env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    keyring_home(user_env, {(f"https://{PYPI_HOST}/simple/", srv.user): srv.password})  # type: ignore[attr-defined]
    stored = (home / ".local/share/python_keyring/keyring_pass.cfg").read_bytes()
    assert base64.b64encode(srv.password.encode()) in stored  # type: ignore[attr-defined]
    brokered = host_credentials(os.geteuid(), env=user_env)
    assert [r.origin for r in brokered.rules] == ["host-keyring"]
    proxy = Proxy(tmp_path, srv, "setup", brokered)
    box_home = tmp_path / "box-home"
    box_home.mkdir()
    try:
        env = proxy.env(box_home) | dict(brokered.env)
        target = tmp_path / "site"
        pip = _pip_install_corp_util(env, target)
    finally:
        proxy.close()
    lines = proxy.lines()
    assert any(x.get("host") == PYPI_HOST and x.get("injected") for x in lines), lines
    _nowhere(
        srv.secrets(),  # type: ignore[attr-defined]
        box_home, target, proxy.log,
        texts=(pip.stdout, pip.stderr, json.dumps(dict(brokered.env)), " ".join(brokered.notes),
               repr(brokered.rules)),
    )  # fmt: skip


def test_git_fetch_through_the_proxy_and_push_refused(tmp_path: Path, servers: object) -> None:
    srv = servers
    user_env = _user_home(tmp_path, srv)
    host_repo = tmp_path / "host-repo"
    subprocess.run(["git", "init", "-q", str(host_repo)], check=True)
    subprocess.run(
        ["git", "-C", str(host_repo), "remote", "add", "origin", srv.git_url],  # type: ignore[attr-defined]
        check=True,
    )
    proxy_url = "http://127.0.0.1:0"  # replaced below: the port is the relay's
    brokered = git_fetch(host_repo, os.geteuid(), env=user_env, proxy_url=proxy_url)
    proxy = Proxy(tmp_path, srv, "agent", brokered)
    box_home = tmp_path / "box-home"
    box_home.mkdir()
    work = tmp_path / "work"
    try:
        genv = proxy.env(box_home) | dict(brokered.env)
        # The sandbox's git: http.proxy and sslCAInfo from the brokered config.
        for k, v in list(genv.items()):
            if v == proxy_url:
                genv[k] = proxy.url
            if v == "/run/agentbox/ca/ca.pem":
                genv[k] = str(proxy.ca)
        subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True, env=genv)
        fetch = subprocess.run(
            ["git", "-C", str(work), "fetch", "origin"], env=genv, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert fetch.returncode == 0, fetch.stderr
        log = subprocess.run(
            ["git", "-C", str(work), "log", "--format=%s", "origin/main"], env=genv,
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert log.stdout.strip() == "first commit"
        subprocess.run(["git", "-C", str(work), "checkout", "-q", "-b", "topic", "origin/main"],
                       env=genv, check=True)  # fmt: skip
        push = subprocess.run(
            ["git", "-C", str(work), "push", "origin", "HEAD:refs/heads/evil"], env=genv,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert push.returncode != 0
    finally:
        proxy.close()
    assert "refs/heads/evil" not in subprocess.run(
        ["git", "-C", str(srv.git_dir), "for-each-ref"],  # type: ignore[attr-defined]
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    lines = proxy.lines()
    refused = [x for x in lines if x.get("reason") == GIT_REFUSE_MESSAGE]
    assert refused and all(x["decision"] == "denied" and not x["injected"] for x in refused)
    assert all(x["decision"] == "allowed" for x in lines if x not in refused), lines
    assert GIT_REFUSE_MESSAGE.split(":")[0] in push.stderr or "403" in push.stderr, push.stderr
    _nowhere(
        srv.secrets(),  # type: ignore[attr-defined]
        box_home, work, proxy.log,
        texts=(fetch.stderr, push.stderr, json.dumps(dict(brokered.env))),
    )  # fmt: skip
