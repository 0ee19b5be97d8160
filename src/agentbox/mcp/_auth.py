"""The HTTP transport's gate: loopback-only bind, a bearer token, Host and Origin checks.

Threats answered: another local user or a web page reaching the server
(``127.0.0.1`` only; any other bind address is refused at start), a browser
tricked by DNS rebinding into talking to it (``Host`` and ``Origin`` must name
the loopback address and our port: 403 otherwise), and anything without the
token (401, compared in constant time). The token is generated once and
stored 0600 in the data dir; a token file with another owner, a wider mode or a
link in its place is refused rather than read.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import stat
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from agentbox.core.listen import check_loopback, parse_loopback
from agentbox.errors import PathRefused

TOKEN_BYTES = 32


def token_path(data_dir: Path) -> Path:
    """Where the MCP HTTP bearer token lives: ``<data_dir>/mcp/token``."""
    return data_dir / "mcp" / "token"


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) → (host, port), loopback only."""
    return parse_loopback(value, flag="--http", who="the MCP server")


def check_bind(host: str) -> None:
    """Refuse any bind address that is not a loopback IP literal (names too)."""
    check_loopback(host, who="the MCP server")


def load_or_create_token(path: Path) -> str:
    """Read the token at ``path`` or create it (0600, in a 0700 directory)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    pst = path.parent.lstat()
    if not stat.S_ISDIR(pst.st_mode) or pst.st_uid != os.geteuid() or pst.st_mode & 0o077:
        raise PathRefused("token directory must be ours and mode 0700", path=path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise PathRefused(f"cannot open the token file ({exc.strerror})", path=path) from exc
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PathRefused("token file must be a regular file of ours with mode 0600", path=path)
        token = f.read(1024).strip()
    if len(token) < 32:
        raise PathRefused("token file holds no usable token (delete it to regenerate)", path=path)
    return token


def _loopback_host(value: str) -> tuple[str, int | None] | None:
    """Split a Host header into (host, port); None when unparsable."""
    host, port = value, None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1 :]
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                return None
            port = int(rest[1:])
    elif value.count(":") == 1:
        host, _, p = value.partition(":")
        if not p.isdigit():
            return None
        port = int(p)
    return host.lower(), port


class GateMiddleware:
    """ASGI middleware in front of the MCP app: Host/Origin (403), then the token (401).

    ``port`` is the port we listen on; the Host header must name a loopback
    host (127.0.0.1, ::1 or localhost) with that port, and an Origin, if sent,
    must be ``http://`` one of those with that port.
    """

    def __init__(self, app: ASGIApp, *, token: str, port: int) -> None:
        self.app = app
        self._token = token.encode()
        self._port = port
        hosts = ("127.0.0.1", "localhost", "[::1]")
        self._origins = {f"http://{h}:{port}" for h in hosts}

    def _host_ok(self, value: str | None) -> bool:
        if not value:
            return False
        parsed = _loopback_host(value)
        if parsed is None:
            return False
        host, port = parsed
        return host in ("127.0.0.1", "localhost", "::1") and port == self._port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no websockets: nothing here speaks them
            await send({"type": "websocket.close", "code": 1008})
            return
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", []):
            name = k.decode("latin-1").lower()
            if name in headers:  # a repeated Host/Origin/Authorization is refused
                headers[name] = "\x00dup"
            else:
                headers[name] = v.decode("latin-1")
        if not self._host_ok(headers.get("host")):
            await _deny(send, 403, "forbidden: Host must be this server's loopback address")
            return
        origin = headers.get("origin")
        if origin is not None and origin not in self._origins:
            await _deny(send, 403, "forbidden: Origin not allowed")
            return
        auth = headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token)
        if not ok:
            await _deny(send, 401, "unauthorized: a valid bearer token is required", bearer=True)
            return
        await self.app(scope, receive, send)


async def _deny(send: Send, status: int, message: str, *, bearer: bool = False) -> None:
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if bearer:
        headers.append((b"www-authenticate", b'Bearer realm="agentbox"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
