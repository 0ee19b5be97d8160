"""The one door to the Docker Engine: a guarded SDK client that sends only our calls.

Whoever can talk to ``docker.sock`` is root on the host (a container with ``/``
bind-mounted and ``--privileged`` is one request away). So the backend never
hands the SDK's client around: every request goes through
:class:`GuardedClient`, which refuses (before anything reaches the socket) any
method and path outside :data:`ALLOWED`, and records what it sent, so a test can
assert the set of endpoints a sandbox's life used. The options of
those calls are fixed by :mod:`._config`; no caller supplies Engine JSON.

The SDK (``docker``, ``requests``, ``urllib3``) costs 0.3-0.9 s of imports, and
every launcher start lists the docker sandboxes (reconcile), docker used or not.
So the SDK is imported on the first call that needs it, and listing containers
on a ``unix://`` daemon (:meth:`GuardedClient.containers`) is one allow-listed,
recorded ``GET /containers/json`` through the standard library's ``http.client``
(already loaded by the launcher); where no socket exists, nothing is listed
and nothing imported.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

from agentbox.core.log import get_logger
from agentbox.errors import SandboxError, UnsupportedError

log = get_logger(__name__)

#: Engine 20.10's API; newer daemons accept it, so no ``GET /version`` negotiation.
API_VERSION = "1.41"
#: The endpoints of one sandbox's life: create, start, wait, exec, inspect, kill, remove.
LIFE = frozenset({
    "POST /containers/create",
    "POST /containers/{id}/start",
    "POST /containers/{id}/wait",
    "POST /containers/{id}/exec",
    "POST /exec/{id}/start",
    "GET /exec/{id}/json",
    "GET /containers/{id}/json",
    "POST /containers/{id}/kill",
    "DELETE /containers/{id}",
})  # fmt: skip
#: A detached sandbox's (``launch``): its output, read from the start by each follower.
DETACHED = frozenset({"GET /containers/{id}/logs"})
#: Set-up (image import and inspect), doctor (ping, version, info) and the orphan sweep.
SETUP = frozenset({
    "POST /images/create",
    "GET /images/{id}/json",
    "GET /_ping",
    "GET /version",
    "GET /info",
    "GET /containers/json",
})  # fmt: skip
ALLOWED = LIFE | SETUP | DETACHED

_VERSION = re.compile(r"^/v\d+\.\d+")
_PATTERNS = (
    (re.compile(r"^/containers/(?!create$|json$)[^/]+$"), "/containers/{id}"),
    (re.compile(r"^/containers/(?!create$|json$)[^/]+/([a-z]+)$"),
     r"/containers/{id}/\1"),
    (re.compile(r"^/exec/[^/]+/([a-z]+)$"), r"/exec/{id}/\1"),
    (re.compile(r"^/images/(?!create$|json$).+/json$"), "/images/{id}/json"),
)  # fmt: skip


def endpoint_of(method: str, url: str) -> str:
    """``"POST /containers/{id}/start"`` for a request's method and URL."""
    path = url.split("://", 1)[-1]
    path = "/" + path.split("/", 1)[1] if "/" in path else "/"
    path = _VERSION.sub("", path.split("?", 1)[0])
    for pattern, repl in _PATTERNS:
        if pattern.match(path):
            path = pattern.sub(repl, path)
            break
    return f"{method.upper()} {path}"


def _api_client_class() -> type[Any]:
    try:
        import docker  # type: ignore[import-untyped]  # the official SDK (untyped)
    except ImportError as exc:  # pragma: no cover: a declared dependency
        raise UnsupportedError(
            "the docker SDK is not installed", fix="pip install 'docker>=7'"
        ) from exc
    base: type[Any] = docker.APIClient
    return base


class _Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[str] = []


def _guarded_class() -> type[Any]:
    base = _api_client_class()

    class _Guarded(base):  # type: ignore[misc,valid-type]
        """The SDK's APIClient, refusing any request outside :data:`ALLOWED`."""

        def request(self, method: str, url: str, *args: Any, **kw: Any) -> Any:
            ep = endpoint_of(method, url)
            if ep not in ALLOWED:
                log.error("refused an Engine call outside the allow-list", endpoint=ep)
                raise SandboxError(f"docker backend refused Engine call {ep}")
            rec: _Recorder = self._agentbox_recorder
            with rec.lock:
                rec.seen.append(ep)
            return super().request(method, url, *args, **kw)

    return _Guarded


_class_lock = threading.Lock()
_class: type[Any] | None = None


class GuardedClient:
    """A docker SDK ``APIClient`` behind the allow-list; ``api`` is the SDK object.

    ``endpoints`` lists, in order, every Engine call made through it.
    """

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.recorder = _Recorder()
        self._api: Any = None
        self._api_lock = threading.Lock()

    @property
    def api(self) -> Any:
        """The guarded SDK client, made (and the SDK imported) on first use."""
        global _class
        with self._api_lock:
            if self._api is None:
                with _class_lock:
                    if _class is None:
                        _class = _guarded_class()
                # A fixed API version: the SDK makes no request until we do.
                api = _class(base_url=self.base_url, version=API_VERSION, timeout=120)
                api._agentbox_recorder = self.recorder
                self._api = api
            return self._api

    @property
    def endpoints(self) -> list[str]:
        with self.recorder.lock:
            return list(self.recorder.seen)

    def containers(self, labels: Sequence[str], *, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Every container (running or not) with all of ``labels`` (``key=value``).

        On a ``unix://`` daemon without the SDK (see the module docstring); raises
        ``OSError`` when nobody answers there, :class:`SandboxError` for a bad answer.
        """
        filters = {"label": list(labels)}
        path = _unix_path(self.base_url)
        if path is None:
            got: Any = self.api.containers(all=True, filters=filters)
        else:
            query = urllib.parse.urlencode({"all": "1", "filters": json.dumps(filters)})
            got = self._light_get(path, f"/v{API_VERSION}/containers/json?{query}", timeout)
        if not isinstance(got, list):
            raise SandboxError(f"docker ps: the daemon answered a {type(got).__name__}, not a list")
        return [c for c in got if isinstance(c, dict)]

    def _light_get(self, sock_path: str, url: str, timeout: float) -> Any:
        ep = endpoint_of("GET", url)
        if ep not in ALLOWED:  # the same door as the SDK's requests
            raise SandboxError(f"docker backend refused Engine call {ep}")
        with self.recorder.lock:
            self.recorder.seen.append(ep)
        conn = _UnixConnection(sock_path, timeout)
        try:
            conn.request("GET", url, headers={"Host": "docker"})
            resp = conn.getresponse()
            body = resp.read(_MAX_ANSWER + 1)
        finally:
            conn.close()
        if resp.status != 200 or len(body) > _MAX_ANSWER:
            raise SandboxError(
                f"docker {ep}: HTTP {resp.status}, {len(body)} bytes: {body[:200]!r}"
            )
        try:
            return json.loads(body)
        except ValueError as exc:
            raise SandboxError(f"docker {ep}: the answer is not JSON ({exc})") from exc

    def close(self) -> None:
        with self._api_lock:
            if self._api is not None:
                self._api.close()


#: The largest container list we read (a host with ~100k containers).
_MAX_ANSWER = 64 << 20


def _unix_path(base_url: str) -> str | None:
    """The socket path of a ``unix://`` daemon URL; None for any other scheme."""
    for scheme in ("unix://", "http+unix://"):
        if base_url.startswith(scheme):
            rest = base_url[len(scheme) :]
            return rest if rest.startswith("/") else "/" + rest
    return None


class _UnixConnection(http.client.HTTPConnection):
    """``http.client`` to a unix socket; the socket is closed when the connect fails."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("docker", timeout=timeout)
        self._sock_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._sock_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def connect(base_url: str) -> GuardedClient:
    """A guarded client for the daemon at ``base_url`` (no request made yet)."""
    return GuardedClient(base_url)
