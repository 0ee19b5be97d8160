"""Request-level egress rules through the real proxy process, against a real TLS upstream.

The upstream (``tests/tls_upstream.py``) runs in a network namespace this module makes
(``ip netns`` + veth, 10.x addresses), with a certificate from a CA the test makes and
gives the proxy as ``egress_upstream_ca``; the names ``up.test`` and ``other.test``
resolve through the ``egress_hosts`` setting. The proxy is :func:`spawn_proxy`, dropped
to the gateway's identity; the client is the test, speaking to the proxy's unix socket
as a sandbox's relay would, trusting only the task CA the proxy made. The upstream logs
every request it receives, so "no header was sent" is checked where it would arrive.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.client
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agentbox.config import Settings
from agentbox.egress import EgressPolicy, ProxyHandle, spawn_proxy
from agentbox.egress.rules import Inject, NetworkRule
from agentbox.errors import EgressError
from agentbox.gateway import gateway_identity
from private_servers import in_netns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ip netns, drop)")

SECRET = "s3cr3t-" + secrets.token_hex(12)
SERVER = Path(__file__).resolve().parents[1] / "tls_upstream.py"
RULES = (
    NetworkRule(
        host="up.test",
        paths=("/headers", "/echo", "/redirect", "/size", "/then-drop", "/then-close"),
        inject=Inject("Authorization", "Bearer ${secret:UP_TOKEN}"),
        origin="test",
    ),
    NetworkRule(
        host="up.test",
        methods=("POST",),
        paths=("/*/git-receive-pack",),
        refuse_message="results are published from the host",
        origin="test",
    ),
    NetworkRule(
        host="up.test",
        methods=("POST",),
        paths=("/upload/*",),
        inject=Inject("Authorization", "Bearer ${secret:UP_TOKEN}"),
        origin="test",
    ),
    NetworkRule(host="other.test", paths=("/*",), origin="test"),
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def _netns() -> Iterator[tuple[str, str]]:
    """(netns, the server's address in it), a veth pair to this host's namespace."""
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"abeg-{tag}", f"abe{tag}h", f"abe{tag}n"
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    n = next(i for i in range(2, 250) if f"10.214.{i}." not in routes)
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"10.214.{n}.1/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"10.214.{n}.2/24", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, f"10.214.{n}.2"
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _test_ca(d: Path) -> tuple[Path, Path, Path]:
    """(CA cert, server cert, server key) for up.test and other.test."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "egress test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(1)
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                       critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "up.test")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(2)
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("up.test"), x509.DNSName("other.test")]), False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = d / "ca.pem", d / "server.pem", d / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(_pem_key(key))
    return paths


@dataclass
class Env:
    proxy: ProxyHandle
    sock: Path
    log: Path
    upstream_log: Path
    ca: bytes
    dir: Path
    settings: Settings

    def upstream(self) -> list[dict[str, Any]]:
        if not self.upstream_log.exists():
            return []
        return [json.loads(x) for x in self.upstream_log.read_text().splitlines()]

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.log.read_text().splitlines()]

    def record(self, pred: Any) -> dict[str, Any]:
        """The last log record ``pred`` accepts (the proxy logs a request as it ends it)."""
        for _ in range(100):
            found = [x for x in self.records() if pred(x)]
            if found:
                return found[-1]
            time.sleep(0.05)
        raise AssertionError("no such egress log record")


def _wait_listen(ns: str, addr: str, proc: subprocess.Popen[bytes]) -> None:
    probe = f"import socket; socket.create_connection(({addr!r}, 443), timeout=1).close()"
    end = time.monotonic() + 30
    while time.monotonic() < end:
        assert proc.poll() is None, "the TLS upstream exited"
        if subprocess.run([*in_netns(ns), sys.executable, "-c", probe],
                          capture_output=True).returncode == 0:  # fmt: skip
            return
        time.sleep(0.2)
    raise AssertionError("the TLS upstream does not listen")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    d = tmp_path_factory.mktemp("intercept")
    task = d / "task"
    task.mkdir(mode=0o700)
    ca, cert, key = _test_ca(d)
    upstream_log = d / "upstream.jsonl"
    with _netns() as (ns, addr):
        argv = [sys.executable, str(SERVER), "--addr", addr, "--cert", str(cert), "--key",
                str(key), "--log", str(upstream_log)]  # fmt: skip
        srv = subprocess.Popen([*in_netns(ns), *argv], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            _wait_listen(ns, addr, srv)
            settings = Settings(
                egress_hosts={"up.test": addr, "other.test": addr},
                egress_upstream_ca=(ca,),
                data_dir=d / "data",
            )
            policy = EgressPolicy.for_phase(settings, rules=RULES)
            identity = gateway_identity(settings)
            sock, log = task / "egress.sock", task / "egress.log"
            with spawn_proxy(
                sock, policy, log, identity, stderr_file=task / "egress.stderr",
                secret_values={"UP_TOKEN": SECRET},
            ) as proxy:  # fmt: skip
                assert proxy.ca_cert is not None
                yield Env(proxy, sock, log, upstream_log, proxy.ca_cert, task, settings)
        finally:
            os.killpg(srv.pid, signal.SIGTERM)
            srv.wait(10)


class _Kept:
    """The connection's reader, which http.client may not close (keep-alive)."""

    def __init__(self, fp: Any) -> None:
        self._fp = fp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fp, name)

    def close(self) -> None:
        pass


class _Conn:
    """A sandbox-side client: CONNECT through the proxy's socket, then TLS, then requests."""

    def __init__(self, env: Env, host: str, *, sni: str | None = None,
                 alpn: list[str] | None = None, sock: Path | None = None,
                 cafile: Path | None = None) -> None:  # fmt: skip
        raw = socket.socket(socket.AF_UNIX)
        raw.settimeout(30)
        raw.connect(str(sock or env.sock))
        raw.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = raw.recv(1)
            assert chunk, "proxy closed during CONNECT"
            head += chunk
        assert head.startswith(b"HTTP/1.1 200"), head
        ctx = ssl.create_default_context(cadata=env.ca.decode())
        if alpn:
            ctx.set_alpn_protocols(alpn)
        if cafile is not None:
            ctx = ssl.create_default_context(cafile=str(cafile))
        self.tls = ctx.wrap_socket(raw, server_hostname=sni or host)
        self.fp = self.tls.makefile("rb")

    def makefile(self, *_a: object, **_k: object) -> Any:  # http.client reads from this
        return _Kept(self.fp)

    def ask(self, raw: bytes, method: str = "GET") -> http.client.HTTPResponse:
        self.tls.sendall(raw)
        resp = http.client.HTTPResponse(self, method=method)  # type: ignore[arg-type]
        resp.begin()
        resp.body = resp.read()  # type: ignore[attr-defined]
        return resp

    def close(self) -> None:
        self.fp.close()
        self.tls.close()


def _get(path: str, host: str = "up.test", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


def test_injects_and_strips_what_the_sandbox_sent(env: Env) -> None:
    c = _Conn(env, "up.test")
    before = len(env.upstream())
    extra = "Authorization: Bearer agentbox-brokered\r\nauthorization: Basic c2FuZGJveA==\r\n"
    r = c.ask(_get("/headers?x=1", extra=extra))
    assert r.status == 200
    seen = env.upstream()[before:]
    assert len(seen) == 1
    auths = [v for k, v in seen[0]["headers"] if k.lower() == "authorization"]
    assert auths == [f"Bearer {SECRET}"]
    assert SECRET.encode() not in r.body  # the echoed header value is redacted
    # The connection is kept: a second request on it is injected too.
    r2 = c.ask(_get("/headers"))
    assert r2.status == 200
    last = env.upstream()[-1]
    assert [v for k, v in last["headers"] if k.lower() == "authorization"] == [f"Bearer {SECRET}"]
    c.close()
    env.record(lambda x: x.get("path") == "/headers")
    recs = [x for x in env.records() if x.get("path", "").startswith("/headers")]
    assert recs[0]["path"] == "/headers?x=…" and recs[0]["injected"] is True
    assert recs[0]["decision"] == "allowed" and recs[0]["status"] == 200
    assert recs[0]["rule"].startswith("test:up.test GET,HEAD")


def test_echoed_secret_is_redacted_in_headers_and_body(env: Env) -> None:
    c = _Conn(env, "up.test")
    r = c.ask(_get("/echo"))
    c.close()
    assert r.status == 200
    assert SECRET not in (r.getheader("X-Echo") or "")
    assert "*" * len(SECRET) in (r.getheader("X-Echo") or "")
    assert SECRET.encode() not in r.body
    # The same length (Content-Length holds), three occurrences, one straddling 64 KiB.
    assert r.body.count(b"*" * len(SECRET)) == 3
    assert r.body.startswith(b"start *") and r.body.endswith(b"* end")


def test_redirect_to_another_host_carries_nothing(env: Env) -> None:
    c = _Conn(env, "up.test")
    r = c.ask(_get("/redirect?to=https://other.test/landing"))
    c.close()
    assert r.status == 302 and r.getheader("Location") == "https://other.test/landing"
    # The proxy did not follow it; the client does, with a new CONNECT to other.test.
    before = len(env.upstream())
    o = _Conn(env, "other.test")
    r2 = o.ask(_get("/landing", host="other.test",
                    extra="Authorization: Bearer agentbox-brokered\r\n"))  # fmt: skip
    o.close()
    assert r2.status == 200
    (seen,) = env.upstream()[before:]
    assert seen["path"] == "/landing"
    values = [v for _, v in seen["headers"]]
    assert not any(SECRET in v for v in values)
    rec = env.record(lambda x: x.get("host") == "other.test")
    assert rec["injected"] is False


def test_host_header_and_absolute_form_must_name_the_tunnel_host(env: Env) -> None:
    before = len(env.upstream())
    c = _Conn(env, "up.test")
    r = c.ask(_get("/headers", host="other.test"))
    assert r.status == 421 and r.getheader("X-Agentbox-Egress") == "host-mismatch"
    c.close()
    c = _Conn(env, "up.test")
    r = c.ask(b"GET https://other.test/headers HTTP/1.1\r\nHost: other.test\r\n\r\n")
    assert r.status == 400 and r.getheader("X-Agentbox-Egress") == "absolute-form"
    c.close()
    c = _Conn(env, "up.test")
    r = c.ask(b"GET /headers HTTP/1.1\r\nHost: up.test\r\nHost: other.test\r\n\r\n")
    assert r.status in (400, 421)
    c.close()
    assert env.upstream()[before:] == []


def test_sni_must_name_the_connect_host(env: Env) -> None:
    with pytest.raises(ssl.SSLError):
        _Conn(env, "up.test", sni="other.test")
    env.record(lambda x: x.get("rule") == "sni-mismatch")


def test_upgrade_and_http2_get_nothing(env: Env) -> None:
    before = len(env.upstream())
    c = _Conn(env, "up.test")
    r = c.ask(_get("/headers", extra="Connection: Upgrade\r\nUpgrade: websocket\r\n"))
    assert r.status == 403 and r.getheader("X-Agentbox-Egress") == "upgrade"
    c.close()
    c = _Conn(env, "up.test", alpn=["h2"])
    assert c.tls.selected_alpn_protocol() in (None, "http/1.1")
    c.tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    answer = c.fp.read()
    c.close()
    assert answer.startswith(b"HTTP/1.1 400")
    assert env.upstream()[before:] == []


def test_refusals_deny_rule_and_suggestion(env: Env) -> None:
    before = len(env.upstream())
    c = _Conn(env, "up.test")
    body = b"0000"
    r = c.ask(b"POST /org/repo.git/git-receive-pack HTTP/1.1\r\nHost: up.test\r\n"
              b"Content-Length: 4\r\n\r\n" + body, method="POST")  # fmt: skip
    c.close()
    assert r.status == 403 and b"results are published from the host" in r.body
    c = _Conn(env, "up.test")
    r = c.ask(_get("/admin/users?token=abc"))
    c.close()
    assert r.status == 403 and b"[[network.rule]]" in r.body
    assert b'host = "up.test"' in r.body and b'paths = ["/admin/*"]' in r.body
    c = _Conn(env, "up.test")
    r = c.ask(_get("/headers/../admin"))
    c.close()
    assert r.status == 400
    assert env.upstream()[before:] == []
    env.record(lambda x: x.get("path", "").startswith("/headers/"))
    recs = env.records()
    deny = next(x for x in recs if "git-receive-pack" in x.get("path", ""))
    assert deny["decision"] == "denied" and "git-receive-pack" in deny["rule"]
    miss = next(x for x in recs if x.get("path", "").startswith("/admin"))
    assert miss["rule"] == "no-rule" and "[[network.rule]]" in miss["suggest"]
    assert miss["path"] == "/admin/users?token=…"


def test_post_body_is_relayed_with_injection(env: Env) -> None:
    c = _Conn(env, "up.test")
    data = os.urandom(200_000)
    r = c.ask(b"POST /upload/pkg HTTP/1.1\r\nHost: up.test\r\nContent-Length: "
              + str(len(data)).encode() + b"\r\n\r\n" + data, method="POST")  # fmt: skip
    c.close()
    assert r.status == 200 and r.body == b"got 200000"
    seen = env.upstream()[-1]
    assert seen["body"] == 200_000
    assert [v for k, v in seen["headers"] if k.lower() == "authorization"] == [f"Bearer {SECRET}"]


def test_secret_is_nowhere_but_the_proxy_memory(env: Env) -> None:
    # After the other tests of this module: the log, stderr, CA file, argv, environment.
    for f in env.dir.iterdir():
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f
    pid = env.proxy.pid
    assert SECRET.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert SECRET.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    assert not list(Path(f"/proc/{pid}/fd").glob("*")) or all(
        "secret" not in os.readlink(p) for p in Path(f"/proc/{pid}/fd").iterdir()
    )


def test_a_missing_secret_stops_the_start(tmp_path: Path) -> None:
    policy = EgressPolicy().with_rules(RULES)
    with pytest.raises(EgressError, match="UP_TOKEN") as err:
        spawn_proxy(tmp_path / "s.sock", policy, tmp_path / "l.log", secret_values={})
    assert SECRET not in str(err.value)
    with pytest.raises(EgressError, match="line break"):
        spawn_proxy(tmp_path / "s.sock", policy, tmp_path / "l.log",
                    secret_values={"UP_TOKEN": "a\r\nX-Evil: 1"})  # fmt: skip


def test_start_egress_resolves_the_secret_and_trusts_the_task_ca(env: Env, tmp_path: Path) -> None:
    """The launcher's path: the store's secret for the task's owner, the CA in the bundle."""
    from agentbox.egress import host_ca_bundle
    from agentbox.env._egress import rule_secrets, start_egress
    from agentbox.secrets import SecretStore

    SecretStore(env.settings).set("UP_TOKEN", SECRET, owner_uid=0)
    root = tmp_path / "task"
    root.mkdir(mode=0o711)
    (root / "net").mkdir()
    policy = EgressPolicy.for_phase(env.settings, rules=RULES, phase="setup")
    values = rule_secrets(env.settings, policy.network_rules, 0)
    assert values == {"UP_TOKEN": SECRET}
    identity = gateway_identity(env.settings)
    eg = start_egress(env.settings, policy, root / "net", root / "egress.jsonl", identity,
                      secret_values=values)  # fmt: skip
    try:
        bundle = (root / "egress-ca" / "ca.pem").read_bytes()
        assert eg.proxy.ca_cert is not None and bundle.endswith(eg.proxy.ca_cert)
        assert bundle.startswith(host_ca_bundle(env.settings).read_bytes().rstrip(b"\n"))
        assert eg.env["SSL_CERT_FILE"] == "/run/agentbox/ca/ca.pem"
        before = len(env.upstream())
        c = _Conn(env, "up.test", sock=root / "net" / "egress.sock",
                  cafile=root / "egress-ca" / "ca.pem")  # fmt: skip
        r = c.ask(_get("/headers"))
        c.close()
        assert r.status == 200
        (seen,) = env.upstream()[before:]
        assert [v for k, v in seen["headers"] if k.lower() == "authorization"] == [
            f"Bearer {SECRET}"
        ]
    finally:
        eg.proxy.stop()
    for f in root.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


class _HostBox:
    """The escape probe's client run on this host (the suite runs it in a sandbox)."""

    def exec(self, argv: list[str], *, timeout: float | None = None, **_: object) -> Any:
        assert argv[0] == "python3"
        return subprocess.run([sys.executable, *argv[1:]], capture_output=True, timeout=timeout)


def test_escape_probe_injection_scope_and_its_control(tmp_path: Path) -> None:
    from agentbox.escape._inject import inject_probe

    class _Res:
        def __init__(self, p: subprocess.CompletedProcess[bytes]) -> None:
            self.stdout, self.exit_code = p.stdout, p.returncode

    class Box(_HostBox):
        def exec(self, argv: list[str], **kw: Any) -> Any:  # type: ignore[override]
            return _Res(super().exec(argv, **kw))

    shared = tmp_path / "gw"
    shared.mkdir()
    status, seen = inject_probe(Box(), shared, str(shared), run_as=None)
    assert status == "pass", seen
    assert "redirect was not followed" not in seen
    # The control: the injecting rule widened to *.invalid; the redirect carries the header.
    status, seen = inject_probe(Box(), shared, str(shared), run_as=None, widened=True)
    assert status == "fail", seen
    assert "other-probe.invalid" in seen


def test_escape_probe_push_refused_and_its_control(tmp_path: Path) -> None:
    """``host.egress_push_refused``: under a task's ``[git] fetch`` rules (the same builder)
    the fetch arrives with the credential and no route to ``git-receive-pack`` reaches the
    remote; its control (one rule letting everything through) must fire."""
    from agentbox.escape._inject import push_probe

    class _Res:
        def __init__(self, p: subprocess.CompletedProcess[bytes]) -> None:
            self.stdout, self.exit_code = p.stdout, p.returncode

    class Box(_HostBox):
        def exec(self, argv: list[str], **kw: Any) -> Any:  # type: ignore[override]
            return _Res(super().exec(argv, **kw))

    shared = tmp_path / "gw"
    shared.mkdir()
    status, seen = push_probe(Box(), shared, str(shared), run_as=None)
    assert status == "pass", seen
    assert "7 push requests were refused" in seen, seen
    status, seen = push_probe(Box(), shared, str(shared), run_as=None, widened=True)
    assert status == "fail", seen
    assert "git-receive-pack" in seen.lower(), seen
