"""The one door to the Docker Engine: a guarded SDK client that sends only our calls.

Whoever can talk to ``docker.sock`` is root on the host (a container with ``/``
bind-mounted and ``--privileged`` is one request away). So the backend never
hands the SDK's client around: every request goes through
:class:`GuardedClient`, which refuses (before anything reaches the socket) any
method and path outside :data:`ALLOWED`, and records what it sent, so a test can
assert the set of endpoints a sandbox's life used (issue 17). The options of
those calls are fixed by :mod:`._config`; no caller supplies Engine JSON.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from agentbox._log import get_logger
from agentbox.errors import SandboxError, UnsupportedError

__all__ = [
    "ALLOWED",
    "API_VERSION",
    "LIFE",
    "GuardedClient",
    "connect",
    "endpoint_of",
]

log = get_logger("docker")

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
#: Set-up (image import and inspect), doctor (ping, version, info) and the orphan sweep.
SETUP = frozenset({
    "POST /images/create",
    "GET /images/{id}/json",
    "GET /_ping",
    "GET /version",
    "GET /info",
    "GET /containers/json",
})  # fmt: skip
ALLOWED = LIFE | SETUP

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
        global _class
        with _class_lock:
            if _class is None:
                _class = _guarded_class()
        self.base_url = base_url
        self.recorder = _Recorder()
        # A fixed API version: the SDK makes no request until we do.
        api = _class(base_url=base_url, version=API_VERSION, timeout=120)
        api._agentbox_recorder = self.recorder
        self.api: Any = api

    @property
    def endpoints(self) -> list[str]:
        with self.recorder.lock:
            return list(self.recorder.seen)

    def close(self) -> None:
        self.api.close()


def connect(base_url: str) -> GuardedClient:
    """A guarded client for the daemon at ``base_url`` (no request made yet)."""
    return GuardedClient(base_url)
