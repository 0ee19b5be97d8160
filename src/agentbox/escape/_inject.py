"""The escape suite's injection-scope probe: an injected header goes only where its rule says.

The host starts a TLS upstream of its own on 127.0.0.1 (a certificate from a CA made
for the probe) that records, for every request it receives, the TLS name, the
``Host`` header, the path and whether the probe's header arrived; and a real egress
proxy (dropped like a task's) with a request rule that injects a fresh random value
(``X-Agentbox-Probe: ${secret:ABX_INJECT_PROBE}``) into ``GET`` requests to
``inject-probe.invalid``, and a rule without injection for ``other-probe.invalid``
(both names resolved to the upstream by the ``egress_hosts`` mechanism). Inside, a
standard-library client, trusting only the task CA, tries to make the proxy send the
header elsewhere: it follows the rule host's redirect to the other host, asks for the
rule host with the other name in SNI, in ``Host`` and in an absolute-form URL, with
``Upgrade: websocket`` and over HTTP/2 (ALPN ``h2``, its preface). One ``GET /ok`` to
the rule host, carrying the placeholder ``agentbox-brokered`` in the header, is the
positive case (the placeholder must be replaced, not kept).

The probe fails when the upstream saw the header on any request but the rule host's
own (SNI and ``Host`` both the rule host, path ``/ok`` or ``/redirect``), or saw a
request the proxy should have refused (the refused checks use paths of their own);
errors when the positive case did not arrive with the header (nothing was exercised);
passes otherwise. Its control (on the weak container) is the same proxy with the
injecting rule widened to ``*.invalid``: the redirect's second request then carries
the header to the other host, and the probe must fire.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import secrets
import shutil
import ssl
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox.config import Settings
from agentbox.egress import AllowRule, EgressLimits, EgressPolicy, spawn_proxy
from agentbox.egress.rules import Inject, NetworkRule
from agentbox.errors import AgentboxError
from agentbox.escape._probeio import _Execs

if TYPE_CHECKING:
    from agentbox.escape import Outcome

PROBE_ID = "host.egress_injection_scope"
_SOCKET = "inject-probe.sock"
RULE_HOST = "inject-probe.invalid"
OTHER_HOST = "other-probe.invalid"
#: The push probe (:data:`PUSH_PROBE_ID`): a smart-HTTP remote under ``[git] fetch`` rules.
PUSH_PROBE_ID = "host.egress_push_refused"
GIT_HOST = "git-probe.invalid"
GIT_REPO = "/team/repo.git"
_HEADER = "X-Agentbox-Probe"
_SECRET = "ABX_INJECT_PROBE"  # noqa: S105 (a secret's name, not a value)
#: Paths the checks the proxy must refuse use: none may reach the upstream.
_REFUSED_PATHS = ("/sni", "/hostmm", "/absolute", "/upgrade", "/h2")

#: Runs inside the sandbox (``python3 -I -S -c``): standard library only.
_CLIENT_LIB = r"""
import json, socket, ssl, sys
cfg = json.loads(sys.argv[1])
port, rule, other = cfg["port"], cfg["rule_host"], cfg["other_host"]
out = []

def tunnel(host, sni, alpn=None):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(cfg["socket"])
    s.sendall(("CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (host, port, host, port)).encode())
    head = b""
    while b"\r\n\r\n" not in head:
        c = s.recv(1)
        if not c:
            raise OSError("closed during CONNECT")
        head += c
    if not head.startswith(b"HTTP/1.1 200"):
        raise OSError("CONNECT answered " + head.split(b"\r\n")[0].decode("latin-1"))
    ctx = ssl.create_default_context(cadata=cfg["ca"])
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx.wrap_socket(s, server_hostname=sni)

def ask(t, raw):
    t.sendall(raw)
    data = b""
    while True:
        try:
            c = t.recv(65536)
        except (OSError, ssl.SSLError):
            break
        if not c:
            break
        data += c
        if b"\r\n\r\n" in data:
            head, _, body = data.partition(b"\r\n\r\n")
            n = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    n = int(v.strip() or 0)
            if len(body) >= n:
                break
    t.close()
    line = data.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split()
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    loc = None
    for l in data.split(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        k, _, v = l.partition(b":")
        if k.strip().lower() == b"location":
            loc = v.strip().decode("latin-1")
    return status, loc

def get(path, host, extra=""):
    head = "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n" % (path, host)
    return (head + extra + "\r\n").encode()

def step(name, fn):
    rec = {"step": name}
    try:
        rec["status"], rec["location"] = fn()
    except Exception as exc:
        rec["error"] = (type(exc).__name__ + ": " + str(exc))[:200]
    out.append(rec)
    return rec

"""

CLIENT_SOURCE = (
    _CLIENT_LIB
    + r"""
step("ok", lambda: ask(tunnel(rule, rule),
     get("/ok", rule, "%s: agentbox-brokered\r\n" % cfg["header"])))
red = step("redirect", lambda: ask(tunnel(rule, rule), get("/redirect", rule)))
step("follow", lambda: ask(tunnel(other, other),
     get("/landing", other, "%s: agentbox-brokered\r\n" % cfg["header"])))
step("sni", lambda: ask(tunnel(rule, other), get("/sni", rule)))
step("hostmm", lambda: ask(tunnel(rule, rule), get("/hostmm", other)))
step("absolute", lambda: ask(tunnel(rule, rule), get("https://%s/absolute" % other, other)))
step("upgrade", lambda: ask(tunnel(rule, rule),
     get("/upgrade", rule, "Connection: Upgrade\r\nUpgrade: websocket\r\n")))
step("h2", lambda: ask(tunnel(rule, rule, ["h2"]),
     b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + get("/h2", rule)))
print(json.dumps({"results": out}))
"""
)

#: The push probe's client: a fetch (must arrive, with the credential), then every way
#: to a push it can think of (none may reach the remote).
GIT_CLIENT_SOURCE = (
    _CLIENT_LIB
    + r"""
g, r = cfg["git_host"], cfg["repo"]

def post(path, body=b"0000"):
    head = ("POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/x-git-receive-pack-request"
            "\r\nContent-Length: %d\r\nConnection: close\r\n\r\n") % (path, g, len(body))
    return head.encode() + body

step("fetch", lambda: ask(tunnel(g, g), get(r + "/info/refs?service=git-upload-pack", g)))
step("push_refs", lambda: ask(tunnel(g, g), get(r + "/info/refs?service=git-receive-pack", g)))
step("push", lambda: ask(tunnel(g, g), post(r + "/git-receive-pack")))
step("push_two_queries", lambda: ask(tunnel(g, g),
     get(r + "/info/refs?service=git-upload-pack&service=git-receive-pack", g)))
step("push_case", lambda: ask(tunnel(g, g), post(r + "/GIT-RECEIVE-PACK")))
step("push_encoded", lambda: ask(tunnel(g, g), post(r + "/git%2dreceive-pack")))
step("push_dots", lambda: ask(tunnel(g, g), post(r + "/git-upload-pack/../git-receive-pack")))
step("push_slashes", lambda: ask(tunnel(g, g), post(r + "//git-receive-pack")))
print(json.dumps({"results": out}))
"""
)


class _Seen:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()


def _make_certs(d: Path) -> tuple[Path, Path, Path]:
    """(CA file, server certificate, server key) for both probe names."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agentbox escape probe CA")])
    ca = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(hours=6))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, RULE_HOST)]))
        .issuer_name(name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(hours=6))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(RULE_HOST), x509.DNSName(OTHER_HOST), x509.DNSName(GIT_HOST)]),
            critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    paths = d / "ca.pem", d / "server.pem", d / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


@contextlib.contextmanager
def _upstream(d: Path, seen: _Seen) -> Any:
    """A TLS server on 127.0.0.1 that records each request; yields its port."""
    _ca, cert, key = _make_certs(d)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(min(n, 1 << 16))
            self.do_GET()

        def do_GET(self) -> None:
            rec = {
                "method": self.command,
                "host": self.headers.get("Host", ""),
                "path": self.path,
                "header": self.headers.get(_HEADER),
            }
            with seen.lock:
                seen.requests.append(rec)
            if self.path == "/redirect":
                body = b""
                self.send_response(302)
                self.send_header("Location", f"https://{OTHER_HOST}:{port}/landing")
            else:
                body = b"ok"
                self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    port = srv.server_address[1]
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        srv.shutdown()
        srv.server_close()


def probe_policy(port: int, ca_file: Path, *, widened: bool = False) -> EgressPolicy:
    """The probe's proxy: the rule host injects, the other host only passes."""
    allows = tuple(
        AllowRule(pattern=h, source="test", tls_ports=frozenset({port}))
        for h in (RULE_HOST, OTHER_HOST)
    )
    inject = Inject(_HEADER, "${secret:" + _SECRET + "}")
    rules = (
        NetworkRule(host="*.invalid" if widened else RULE_HOST, inject=inject, origin="test"),
        NetworkRule(host=OTHER_HOST, origin="test"),
    )
    limits = EgressLimits(connect_timeout=5.0, header_timeout=10.0, idle_timeout=10.0)
    return EgressPolicy(
        rules=allows,
        limits=limits,
        trusted_ranges=("127.0.0.0/8",),
        hosts_map={RULE_HOST: "127.0.0.1", OTHER_HOST: "127.0.0.1"},
        upstream_ca=(str(ca_file),),
    ).with_rules(rules)


def _verdict(requests: list[dict[str, Any]], value: str, results: Any) -> tuple[str, str]:
    """(status, seen) from what the upstream recorded (the host's own record)."""
    fired, ok = [], False
    for r in requests:
        path = str(r.get("path"))
        carried = r.get("header") == value
        own = str(r.get("host", "")).split(":")[0] == RULE_HOST and path in ("/ok", "/redirect")
        if path.startswith(_REFUSED_PATHS) or "absolute" in path:
            fired.append(f"{path} reached the upstream (host {r.get('host')!r})")
        elif carried and not own:
            fired.append(f"the header reached {r.get('host')!r}{path}")
        elif own and path == "/ok" and carried:
            ok = True
        if own and r.get("header") != value:
            fired.append(f"the rule host's {path} arrived without the injected value")
    if fired:
        return "fail", "; ".join(fired)
    if not ok:
        steps = json.dumps(results)[:200] if results is not None else "no results"
        return "error", f"the rule host's own request did not arrive with the header: {steps}"
    follow = any(r.get("path") == "/landing" for r in requests)
    note = "" if follow else " (the redirect was not followed to the other host)"
    return "pass", (
        "the header reached only the rule host's own requests; SNI, Host and absolute-form "
        f"mismatches, Upgrade and h2 never reached the upstream{note}"
    )


def inject_probe(
    box: _Execs,
    shared_dir: Path,
    inside_dir: str,
    *,
    run_as: tuple[int, int] | None,
    widened: bool = False,
) -> tuple[str, str]:
    """Run the probe against ``box``: (``pass``/``fail``/``error``, what was seen)."""
    return _run(box, shared_dir, inside_dir, run_as=run_as, source=CLIENT_SOURCE,
                policy=lambda port, ca: probe_policy(port, ca, widened=widened),
                verdict=_verdict)  # fmt: skip


def push_probe(
    box: _Execs,
    shared_dir: Path,
    inside_dir: str,
    *,
    run_as: tuple[int, int] | None,
    widened: bool = False,
) -> tuple[str, str]:
    """The push probe against ``box``: (``pass``/``fail``/``error``, what was seen)."""
    return _run(box, shared_dir, inside_dir, run_as=run_as, source=GIT_CLIENT_SOURCE,
                policy=lambda port, ca: git_policy(port, ca, widened=widened),
                verdict=_push_verdict)  # fmt: skip


def git_policy(port: int, ca_file: Path, *, widened: bool = False) -> EgressPolicy:
    """The push probe's proxy: the ``[git] fetch`` rules of a task (the same builder),
    injecting the probe's value; ``widened`` (the control): one rule letting every
    request to the remote through, with the value."""
    from agentbox.egress import git_fetch_rules

    inject = Inject(_HEADER, "${secret:" + _SECRET + "}")
    wide = NetworkRule(host=GIT_HOST, methods=("GET", "POST"), inject=inject, origin="test")
    rules = (wide,) if widened else git_fetch_rules(GIT_HOST, GIT_REPO, inject)
    return EgressPolicy(
        rules=(AllowRule(pattern=GIT_HOST, source="test", tls_ports=frozenset({port})),),
        limits=EgressLimits(connect_timeout=5.0, header_timeout=10.0, idle_timeout=10.0),
        trusted_ranges=("127.0.0.0/8",),
        hosts_map={GIT_HOST: "127.0.0.1"},
        upstream_ca=(str(ca_file),),
    ).with_rules(rules)


def _push_verdict(requests: list[dict[str, Any]], value: str, results: Any) -> tuple[str, str]:
    """(status, seen): a push that reached the remote fires; a fetch that did not arrive
    with the credential means nothing was exercised."""
    from urllib.parse import unquote

    pushed = [
        f"{r.get('method')} {r.get('path')}"
        for r in requests
        if "receive-pack" in unquote(str(r.get("path", ""))).lower()
    ]
    if pushed:
        return "fail", "a push reached the remote: " + "; ".join(pushed)[:300]
    fetched = [r for r in requests if "service=git-upload-pack" in str(r.get("path", ""))]
    if not any(r.get("header") == value for r in fetched):
        steps = json.dumps(results)[:200] if results is not None else "no results"
        return "error", f"the fetch did not arrive with the credential: {steps}"
    refused = [r.get("status") for r in results or [] if str(r.get("step", "")).startswith("push")]
    return "pass", (
        f"the fetch arrived with the credential; {len(refused)} push requests were refused "
        f"(statuses {sorted({str(x) for x in refused})}) and none reached the remote"
    )


def _run(
    box: _Execs,
    shared_dir: Path,
    inside_dir: str,
    *,
    run_as: tuple[int, int] | None,
    source: str,
    policy: Any,
    verdict: Any,
) -> tuple[str, str]:
    sock = shared_dir / _SOCKET
    tmp = Path(tempfile.mkdtemp(prefix="agentbox-inject-probe-"))
    value = "abx-" + secrets.token_hex(16)
    seen = _Seen()
    try:
        with _upstream(tmp, seen) as port:  # noqa: SIM117 - the proxy needs the port
            with spawn_proxy(sock, policy(port, tmp / "ca.pem"), tmp / "egress.log", run_as,
                             secret_values={_SECRET: value}) as proxy:  # fmt: skip
                sock.chmod(0o666)
                assert proxy.ca_cert is not None
                cfg = {
                    "socket": f"{inside_dir}/{_SOCKET}",
                    "port": port,
                    "rule_host": RULE_HOST,
                    "other_host": OTHER_HOST,
                    "git_host": GIT_HOST,
                    "repo": GIT_REPO,
                    "header": _HEADER,
                    "ca": proxy.ca_cert.decode(),
                }
                res = box.exec(["python3", "-I", "-S", "-c", source, json.dumps(cfg)], timeout=180)
        raw = res.stdout[-65536:].decode(errors="replace").strip().splitlines()
        try:
            data = json.loads(raw[-1]) if raw else None
        except ValueError:
            data = None
        results = data.get("results") if isinstance(data, dict) else None
        if (
            isinstance(results, list)
            and results
            and all(
                "No such file" in str(r.get("error", "")) for r in results if isinstance(r, dict)
            )
        ):
            return "n/a", "the proxy's socket is not visible inside: no shared gateway dir"
        with seen.lock:
            requests = list(seen.requests)
        status, seen_text = verdict(requests, value, results)
        return str(status), str(seen_text)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()


def suite_outcome(
    box: _Execs,
    gateway_dir: Path,
    *,
    settings: Settings | None = None,
    vm: bool = False,
    control: bool = False,
    probe: str = PROBE_ID,
) -> Outcome:
    """The suite's ``probe`` outcome on ``box`` (:data:`PROBE_ID` or :data:`PUSH_PROBE_ID`;
    ``control``: the widened rule)."""
    from agentbox.backends.base import GATEWAY_DIR_IN_SANDBOX
    from agentbox.escape import PROBES, Outcome
    from agentbox.gateway import gateway_identity

    spec = next(p for p in PROBES if p.id == probe)

    def done(status: str, seen: str) -> Outcome:
        return Outcome(spec.id, spec.where, spec.tried, spec.expected, seen[:400], status)  # type: ignore[arg-type]

    if vm:
        return done("n/a", "a microVM has no host socket directory to put the proxy's socket in")
    run_as = None
    if settings is not None and os.geteuid() == 0:
        run_as = gateway_identity(settings)
    try:
        run = push_probe if probe == PUSH_PROBE_ID else inject_probe
        status, seen = run(box, gateway_dir, GATEWAY_DIR_IN_SANDBOX, run_as=run_as, widened=control)
    except AgentboxError as exc:
        status, seen = "error", f"the probe could not run: {exc}"
    return done(status, seen)
