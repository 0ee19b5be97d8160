"""Real private servers for credential brokering tests: a PyPI index, an npm registry, a git remote.

:func:`private_servers` starts, in a network namespace of its own (``ip netns`` and a
veth pair on a ``10.213.N.0/24`` link; never loopback, which the egress proxy always
refuses), one nginx terminating TLS with a certificate from a CA made for the run, in
front of:

- ``pypi.corp.example``: ``pypiserver`` with an htpasswd file (``-a download,list``),
  holding a small wheel built here (``corp-util 1.0``, module ``corp_util``);
- ``npm.corp.example``: ``verdaccio`` 6.8 with htpasswd auth, holding ``@corp/greet``
  1.0.0 (published to it here), plus a bearer token got by logging in;
- ``git.corp.example``: ``git http-backend`` through ``fcgiwrap``, nginx's basic auth,
  one bare repo ``proj.git`` (push allowed for the authenticated user).

Every server asks for the same user and password. The host reaches the names at
:attr:`PrivateServers.addresses` (``egress_hosts``), and trusts :attr:`ca_path`
(``egress_upstream_ca``). Needs root, ``nginx``, ``fcgiwrap``, ``pypi-server`` in the
venv and verdaccio under :data:`VERDACCIO_DIR` (``scripts/setup.sh`` installs them);
:func:`missing` says what is absent.

``python tests/private_servers.py DIR`` runs them until SIGTERM and prints their facts
as JSON (the tutorial's background step).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import io
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

VERDACCIO_DIR = Path("/opt/agentbox-test/verdaccio")
VERDACCIO = VERDACCIO_DIR / "node_modules" / "verdaccio" / "bin" / "verdaccio"
PYPI_SERVER = Path(sys.executable).parent / "pypi-server"
GIT_HTTP_BACKEND = Path("/usr/lib/git-core/git-http-backend")
PYPI_HOST = "pypi.corp.example"
NPM_HOST = "npm.corp.example"
GIT_HOST = "git.corp.example"
WHEEL_NAME = "corp-util"
NPM_PACKAGE = "@corp/greet"


def missing(*, npm: bool = True) -> list[str]:
    """What this host lacks for :func:`private_servers` (empty: all there)."""
    out = []
    if os.geteuid() != 0:
        out.append("root (ip netns)")
    for tool in ("nginx", "fcgiwrap", "ip", "git"):
        if shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin") is None:
            out.append(tool)
    if not PYPI_SERVER.exists():
        out.append("pypi-server (pip install pypiserver passlib)")
    if not GIT_HTTP_BACKEND.exists():
        out.append(str(GIT_HTTP_BACKEND))
    if npm and not VERDACCIO.exists():
        out.append(f"verdaccio under {VERDACCIO_DIR} (scripts/setup.sh)")
    return out


@dataclass
class PrivateServers:
    """What a test needs to know about the running servers."""

    root: Path
    ca_path: Path
    user: str
    password: str
    addresses: dict[str, str]
    """name -> address (the ``egress_hosts`` setting)."""
    git_dir: Path
    """The bare repo behind ``https://git.corp.example/proj.git``."""
    npm_token: str | None = None
    netns: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def pypi_url(self) -> str:
        return f"https://{PYPI_HOST}/simple/"

    @property
    def npm_url(self) -> str:
        return f"https://{NPM_HOST}/"

    @property
    def git_url(self) -> str:
        return f"https://{GIT_HOST}/proj.git"

    @property
    def basic(self) -> str:
        """The ``Authorization`` value with the user and password."""
        raw = f"{self.user}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()

    @property
    def egress_hosts_env(self) -> str:
        """``AGENTBOX_EGRESS_HOSTS``'s value."""
        return ",".join(f"{n}={a}" for n, a in self.addresses.items())

    def secrets(self) -> list[str]:
        """Every credential value a test must find nowhere: password, basic, token."""
        vals = [self.password, self.basic.split()[1]]
        if self.npm_token:
            vals.append(self.npm_token)
        return vals

    def facts(self) -> dict[str, object]:
        return {
            "ca": str(self.ca_path),
            "user": self.user,
            "password": self.password,
            "addresses": self.addresses,
            "egress_hosts": self.egress_hosts_env,
            "pypi": self.pypi_url,
            "npm": self.npm_url,
            "git": self.git_url,
            "git_dir": str(self.git_dir),
            "npm_token": self.npm_token,
        }

    def shell_env(self) -> str:
        """``export`` lines: the host settings the proxy needs, and the user's credentials."""
        lines = {
            "AGENTBOX_EGRESS_HOSTS": self.egress_hosts_env,
            "AGENTBOX_EGRESS_UPSTREAM_CA": str(self.ca_path),
            "CORP_USER": self.user,
            "CORP_PASSWORD": self.password,
            "CORP_CA": str(self.ca_path),
            "CORP_GIT_DIR": str(self.git_dir),
            "CORP_GIT_ADDR": self.addresses[GIT_HOST],
            "CORP_PYPI_ADDR": self.addresses[PYPI_HOST],
        }
        return "".join(f"export {k}='{v}'\n" for k, v in lines.items())

    def get(self, host: str, path: str, *, auth: str | None = None) -> tuple[int, bytes]:
        """A GET from the host to ``host`` (verified against the CA), for checks."""
        ctx = ssl.create_default_context(cafile=str(self.ca_path))
        with (
            socket.create_connection((self.addresses[host], 443), timeout=10) as raw,
            ctx.wrap_socket(raw, server_hostname=host) as tls,
        ):
            head = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
            if auth:
                head += f"Authorization: {auth}\r\n"
            tls.sendall((head + "\r\n").encode())
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
        status = int(data.split(b" ", 2)[1])
        return status, data.partition(b"\r\n\r\n")[2]


# ---------------------------------------------------------------- TLS


def make_ca(root: Path, names: list[str]) -> tuple[Path, Path, Path]:
    """A CA (``ca.pem``) and a server certificate for ``names`` signed by it: (ca, cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agentbox test corp CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    tls = root / "tls"
    tls.mkdir(mode=0o755)
    ca_path, cert_path, key_path = tls / "ca.pem", tls / "server.pem", tls / "server.key"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    ca_path.chmod(0o644)
    return ca_path, cert_path, key_path


# ---------------------------------------------------------------- contents


def build_wheel(out_dir: Path, name: str = WHEEL_NAME, version: str = "1.0") -> Path:
    """A pure-Python wheel with one module (``corp_util.VALUE = 42``)."""
    mod = name.replace("-", "_")
    dist = f"{mod}-{version}"
    files = {
        f"{mod}.py": b"VALUE = 42\n",
        f"{dist}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            "Summary: a private package of the test corp\n"
        ).encode(),
        f"{dist}.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: agentbox-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"{dist}-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    wheel.write_bytes(buf.getvalue())
    return wheel


def _htpasswd(path: Path, user: str, password: str) -> None:
    """An apr1 (Apache MD5) htpasswd line: nginx, pypiserver (passlib) and verdaccio read it."""
    res = subprocess.run(
        ["openssl", "passwd", "-apr1", "-stdin"],
        input=password.encode(),
        capture_output=True,
        check=True,
    )
    path.write_text(f"{user}:{res.stdout.decode().strip()}\n")
    path.chmod(0o644)


def _git(*args: str, cwd: Path | None = None) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


def _bare_repo(root: Path) -> Path:
    """``root/git/proj.git`` with one commit on ``main`` (README and requirements)."""
    seed = root / "git-seed"
    seed.mkdir()
    (seed / "README.md").write_text("# proj\n\nA project of the test corp.\n")
    (seed / "requirements.txt").write_text(f"{WHEEL_NAME}==1.0\n")
    ident = ["-c", "user.name=Corp Dev", "-c", "user.email=dev@corp.example"]
    _git("init", "-q", "-b", "main", str(seed))
    _git("add", "-A", cwd=seed)
    _git(*ident, "commit", "-q", "-m", "first commit", cwd=seed)
    bare = root / "git" / "proj.git"
    bare.parent.mkdir()
    _git("clone", "-q", "--bare", str(seed), str(bare))
    _git("config", "http.receivepack", "true", cwd=bare)
    shutil.rmtree(seed)
    return bare


# ---------------------------------------------------------------- namespace


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _free_subnet() -> int:
    """N of a ``10.213.N.0/24`` no route on this host covers yet."""
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    for _ in range(50):
        n = secrets.randbelow(250) + 2
        if f"10.213.{n}." not in routes:
            return n
    raise RuntimeError("no free 10.213.N.0/24 subnet")


def in_netns(ns: str) -> list[str]:
    """The argv prefix that runs a command in network namespace ``ns`` and no other.

    Not ``ip netns exec``: that also unshares a mount namespace, a copy of every mount
    the host has at that moment (this host's root is private, so nothing unmounted
    later reaches the copy). A server started that way pinned another test's
    workspace disk (a loop mount) for as long as it ran (CI, stop 37).
    """
    return ["nsenter", f"--net=/run/netns/{ns}", "--"]


def reap_stale_netns() -> list[str]:
    """Remove the namespaces (their servers, their veth) of runs whose process is gone.

    Each namespace is named ``abpriv-<pid>-<tag>`` after the process that made it; a run
    killed before its cleanup (a tutorial's background helper past its grace) left one
    with fcgiwrap and nginx still in it (CI, stop 36). A live process's are not touched.
    """
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    reaped = []
    for line in listed.splitlines():
        name = line.split(" ", 1)[0]
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "abpriv" or not parts[1].isdigit():
            continue
        if Path(f"/proc/{parts[1]}").exists():
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "link", "del", f"abp{parts[2]}h"], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        reaped.append(name)
    return reaped


@contextlib.contextmanager
def _netns() -> Iterator[tuple[str, str, list[str]]]:
    """(netns name, host-side address, three server addresses in the namespace)."""
    reap_stale_netns()
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"abpriv-{os.getpid()}-{tag}", f"abp{tag}h", f"abp{tag}n"
    n = _free_subnet()
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"10.213.{n}.1/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        addrs = [f"10.213.{n}.{i}" for i in (2, 3, 4)]
        for a in addrs:
            _ip("-n", ns, "addr", "add", f"{a}/24", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, f"10.213.{n}.1", addrs
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _die_with_parent() -> None:
    """In the child: SIGTERM when the process that started it dies (even by SIGKILL)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start(
    ns: str, argv: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [*in_netns(ns), *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env or {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(log.parent)},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def _wait_tcp(ns: str, addr: str, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until ``addr:port`` in ``ns`` accepts (probed from inside the namespace)."""
    probe = (
        "import socket,sys\n"
        "try:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()\n"
        "except OSError: sys.exit(1)\n"
    )
    end = time.monotonic() + 90
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited: {log.read_text(errors='replace')[-2000:]}")
        res = subprocess.run(
            [*in_netns(ns), sys.executable, "-c", probe, addr, str(port)],
            capture_output=True,
        )
        if res.returncode == 0:
            return
        time.sleep(0.3)
    raise RuntimeError(f"nothing listens on {addr}:{port} in {ns}: {log.read_text()[-2000:]}")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in reversed(procs):
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        # What is left of its group: fcgiwrap's preforked children outlive their master's
        # TERM (they were found orphaned after a run).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


_NGINX = """\
user root;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/logs/nginx-error.log warn;
events {{ worker_connections 256; }}
http {{
  access_log {root}/logs/nginx-access.log;
  client_body_temp_path {root}/nginx-tmp/body;
  proxy_temp_path {root}/nginx-tmp/proxy;
  fastcgi_temp_path {root}/nginx-tmp/fastcgi;
  uwsgi_temp_path {root}/nginx-tmp/uwsgi;
  scgi_temp_path {root}/nginx-tmp/scgi;
  client_max_body_size 0;
  ssl_certificate {cert};
  ssl_certificate_key {key};
  server {{
    listen {pypi_addr}:443 ssl;
    server_name {pypi_host};
    location / {{
      proxy_pass http://127.0.0.1:8080;
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-Proto https;
      proxy_set_header X-Forwarded-Host $host;
    }}
  }}
  server {{
    listen {npm_addr}:443 ssl;
    server_name {npm_host};
    location / {{
      proxy_pass http://127.0.0.1:4873;
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-Proto https;
    }}
  }}
  server {{
    listen {git_addr}:443 ssl;
    server_name {git_host};
    location / {{
      auth_basic "corp git";
      auth_basic_user_file {root}/htpasswd;
      include /etc/nginx/fastcgi_params;
      fastcgi_param SCRIPT_FILENAME {backend};
      fastcgi_param GIT_PROJECT_ROOT {root}/git;
      fastcgi_param GIT_HTTP_EXPORT_ALL "";
      fastcgi_param PATH_INFO $uri;
      fastcgi_param REMOTE_USER $remote_user;
      fastcgi_pass unix:{root}/fcgiwrap.sock;
    }}
  }}
}}
"""

_VERDACCIO = """\
storage: {root}/verdaccio/storage
auth:
  htpasswd:
    file: {root}/htpasswd
    max_users: -1
uplinks: {{}}
packages:
  '@*/*':
    access: $authenticated
    publish: $authenticated
  '**':
    access: $authenticated
    publish: $authenticated
listen: 127.0.0.1:4873
web:
  enable: false
log: {{ type: stdout, format: pretty, level: warn }}
"""


def _verdaccio(
    ns: str, root: Path, user: str, password: str, procs: list[subprocess.Popen[bytes]]
) -> str:
    """Start verdaccio, publish :data:`NPM_PACKAGE` to it, return a bearer token for ``user``."""
    vdir = root / "verdaccio"
    (vdir / "storage").mkdir(parents=True)
    cfg = vdir / "config.yaml"
    cfg.write_text(_VERDACCIO.format(root=root))
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(vdir), "NODE_ENV": "production"}
    log = root / "logs" / "verdaccio.log"
    proc = _start(ns, ["node", str(VERDACCIO), "-c", str(cfg)], log, env)
    procs.append(proc)
    _wait_tcp(ns, "127.0.0.1", 4873, proc, log)
    # Log in (the registry's own login: a token it issued), then publish with it.
    login = (
        "import base64,json,sys,urllib.request\n"
        "u,p=sys.argv[1],sys.argv[2]\n"
        "r=urllib.request.Request('http://127.0.0.1:4873/-/user/org.couchdb.user:'+u,"
        "data=json.dumps({'name':u,'password':p}).encode(),method='PUT',"
        "headers={'Content-Type':'application/json','Authorization':'Basic '+"
        "base64.b64encode((u+':'+p).encode()).decode()})\n"
        "print(json.load(urllib.request.urlopen(r,timeout=30))['token'])\n"
    )
    # The password on the argv of a short process in the test's own namespace: test-only.
    res = subprocess.run(
        [*in_netns(ns), sys.executable, "-c", login, user, password],
        capture_output=True,
        text=True,
        check=True,
    )
    token = res.stdout.strip()
    pkg = vdir / "pkg"
    pkg.mkdir()
    (pkg / "package.json").write_text(
        json.dumps({"name": NPM_PACKAGE, "version": "1.0.0", "main": "index.js"})
    )
    (pkg / "index.js").write_text("module.exports = () => 'hello from corp';\n")
    (pkg / ".npmrc").write_text(f"//127.0.0.1:4873/:_authToken={token}\n")
    subprocess.run(
        [
            *in_netns(ns), "npm", "publish", "--registry", "http://127.0.0.1:4873/",
            "--userconfig", str(pkg / ".npmrc"), "--no-audit",
        ],
        cwd=pkg,
        capture_output=True,
        check=True,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(vdir)},
    )  # fmt: skip
    shutil.rmtree(pkg)
    return token


@contextlib.contextmanager
def private_servers(root: Path, *, npm: bool = True) -> Iterator[PrivateServers]:
    """Start the servers under ``root`` (an empty directory); stop and remove them after."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    (root / "logs").mkdir()
    tmp = root / "nginx-tmp"
    tmp.mkdir()
    user, password = "corpdev", "pw-" + secrets.token_urlsafe(18)
    ca, cert, key = make_ca(root, [PYPI_HOST, NPM_HOST, GIT_HOST])
    _htpasswd(root / "htpasswd", user, password)
    build_wheel(root / "packages")
    bare = _bare_repo(root)
    procs: list[subprocess.Popen[bytes]] = []
    with _netns() as (ns, _host_addr, (pypi_addr, npm_addr, git_addr)):
        try:
            logs = root / "logs"
            p = _start(
                ns,
                [
                    str(PYPI_SERVER), "run", "-i", "127.0.0.1", "-p", "8080",
                    "-P", str(root / "htpasswd"), "-a", "download,list,update",
                    "--disable-fallback", str(root / "packages"),
                ],
                logs / "pypiserver.log",
            )  # fmt: skip
            procs.append(p)
            _wait_tcp(ns, "127.0.0.1", 8080, p, logs / "pypiserver.log")
            sock = root / "fcgiwrap.sock"
            p = _start(ns, ["fcgiwrap", "-c", "2", "-s", f"unix:{sock}"], logs / "fcgiwrap.log")
            procs.append(p)
            token = _verdaccio(ns, root, user, password, procs) if npm else None
            conf = root / "nginx.conf"
            conf.write_text(
                _NGINX.format(
                    root=root, cert=cert, key=key, backend=GIT_HTTP_BACKEND,
                    pypi_addr=pypi_addr, npm_addr=npm_addr, git_addr=git_addr,
                    pypi_host=PYPI_HOST, npm_host=NPM_HOST, git_host=GIT_HOST,
                )
            )  # fmt: skip
            p = _start(
                ns,
                ["nginx", "-p", str(root), "-e", str(logs / "nginx-error.log"), "-c", str(conf),
                 "-g", "daemon off;"],
                logs / "nginx.log",
            )  # fmt: skip
            procs.append(p)
            for addr in (pypi_addr, npm_addr, git_addr):
                _wait_tcp(ns, addr, 443, p, logs / "nginx.log")
            yield PrivateServers(
                root=root,
                ca_path=ca,
                user=user,
                password=password,
                addresses={PYPI_HOST: pypi_addr, NPM_HOST: npm_addr, GIT_HOST: git_addr},
                git_dir=bare,
                npm_token=token,
                netns=ns,
                procs=procs,
            )
        finally:
            _stop(procs)


def main() -> None:
    """``python3 tests/private_servers.py DIR [--no-npm]``: serve until SIGTERM or SIGINT
    (``DIR.pid`` holds this process's pid while it serves)."""
    root = Path(sys.argv[1])
    stop = {"now": False}

    def _on(sig: int, _frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, _on)
    signal.signal(signal.SIGINT, _on)
    pid = root.parent / f"{root.name}.pid"
    pid.write_text(f"{os.getpid()}\n")
    try:
        with private_servers(root, npm="--no-npm" not in sys.argv) as srv:
            (root / "facts.json").write_text(json.dumps(srv.facts(), indent=2))
            (root / "env.sh").write_text(srv.shell_env())
            print("private servers ready", flush=True)
            while not stop["now"]:
                time.sleep(0.5)
    finally:
        pid.unlink(missing_ok=True)
    print("private servers stopped", flush=True)


if __name__ == "__main__":
    main()
