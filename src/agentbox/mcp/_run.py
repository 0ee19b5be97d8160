"""Running the MCP server: stdio, streamable HTTP, and ``agentbox serve`` (launcher + MCP).

Start-up order matters for the privilege split. While still root, the server
(1) reads its bearer token (the file is 0600 in the data dir), (2) opens the
launcher's socket *directory* (``run/``) with ``O_PATH`` so it can later connect
through ``/proc/self/fd/N/launcher.sock`` without being able to traverse the data
dir, and only then (3) drops to an ordinary uid with no capabilities. The
directory, not the socket: a restarted launcher binds a new socket there, and the
server reaches it without being restarted. Nothing from a client is
read before the drop. The launcher records that uid as the caller of every task
the server submits (it reads it from the kernel, ``SO_PEERCRED``), and answers
this server about those tasks only.

``agentbox serve`` binds the MCP HTTP port itself, before it starts anything: a
port that is taken is an error naming the address, and the bound socket is handed
to the MCP child (``--listen-fd``). It says "serving" only once the child has
answered an HTTP request on that socket.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.core.proc import kill_group
from agentbox.core.wait import socket_accepts, wait_until
from agentbox.errors import ConfigError, PathRefused, SandboxError, UnsupportedError
from agentbox.mcp._auth import GateMiddleware, load_or_create_token, parse_listen, token_path
from agentbox.mcp._confine import confine_filesystem
from agentbox.mcp._privdrop import Identity, drop_privileges, resolve_identity
from agentbox.mcp._server import DEFAULT_MAX_PENDING, ServerConfig, build_server

log = get_logger(__name__)


def launcher_socket(settings: Settings) -> Path:
    """The launcher's unix socket as clients name it: ``<data_dir>/launcher.sock`` (a link
    into ``run/``, the ``root:agentbox 0750`` directory the launcher binds it in)."""
    return settings.data_dir / "launcher.sock"


@dataclass(frozen=True)
class Prepared:
    """What the server holds after start-up: its config, its token, who it now is."""

    config: ServerConfig
    token: str | None
    identity: Identity | None


def prepare(
    settings: Settings,
    *,
    user: str | None = None,
    want_token: bool = False,
    max_pending: int = DEFAULT_MAX_PENDING,
) -> Prepared:
    """Read the token, pin the launcher socket, drop privileges; in that order."""
    token = load_or_create_token(token_path(settings.data_dir)) if want_token else None
    sock = launcher_socket(settings)
    sock_path = sock
    identity: Identity | None = None
    if os.geteuid() == 0:
        identity = resolve_identity(user, settings.repos_root, sock)
        try:
            # The socket's directory, kept open for the life of the process: the only
            # way back to the socket once the data dir (0700 root) is out of reach, and
            # still the way to a restarted launcher's new socket (same directory).
            real = Path(os.path.realpath(sock))
            st = real.stat()
            fd = os.open(real.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise UnsupportedError(
                f"the launcher is not running (no socket at {sock}: {exc.strerror})",
                fix="start it first: agentbox launcher serve (or run agentbox serve)",
            ) from exc
        sock_path = Path(f"/proc/self/fd/{fd}") / real.name
        _check_socket_access(st, identity, sock)
        confine_filesystem(
            identity.uid, {identity.gid, *identity.groups}, writable=[settings.repos_root]
        )
    drop_privileges(identity)
    config = ServerConfig(
        repos_root=settings.repos_root,
        data_dir=settings.data_dir,
        socket_path=sock_path,
        max_pending=max_pending,
    )
    return Prepared(config=config, token=token, identity=identity)


def _check_socket_access(st: os.stat_result, identity: Identity, sock: Path) -> None:
    """Refuse to start if the dropped server could not connect to the launcher at all."""
    if st.st_uid == identity.uid:
        ok = bool(st.st_mode & stat.S_IWUSR)
    elif st.st_gid in (identity.gid, *identity.groups):
        ok = bool(st.st_mode & stat.S_IWGRP)
    else:
        ok = bool(st.st_mode & stat.S_IWOTH)
    if not ok:
        raise UnsupportedError(
            f"uid {identity.uid} could not connect to the launcher socket {sock} "
            f"(mode {st.st_mode & 0o777:o}, group {st.st_gid})",
            fix="groupadd --system agentbox, then restart the launcher (it gives its socket "
            "to that group, and the MCP server joins it)",
        )


def run_stdio(prepared: Prepared) -> None:
    """Serve MCP over stdin/stdout until the client closes it."""
    server = build_server(prepared.config)
    anyio.run(server.run_stdio_async)


def claude_add_command(host: str, port: int, token: str) -> str:
    """The exact ``claude mcp add`` line for the HTTP server."""
    return (
        f"claude mcp add --transport http agentbox {mcp_url(host, port)} "
        f'--header "Authorization: Bearer {token}"'
    )


def mcp_url(host: str, port: int) -> str:
    """The MCP endpoint URL for ``host:port``."""
    h = f"[{host}]" if ":" in host else host
    return f"http://{h}:{port}/mcp"


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port``; :class:`ConfigError` naming it when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Only lets a port in TIME_WAIT be reused; a live listener still refuses the bind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {_addr(host, port)}: {exc.strerror} "
            "(is another server using that port? choose another with --http)"
        ) from exc
    return sock


def adopt_listener(fd: int, host: str, port: int) -> socket.socket:
    """The listening socket ``agentbox serve`` handed down as ``fd``, checked to be
    a TCP listener on exactly ``host:port``."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ConfigError(f"--listen-fd {fd} is not a socket: {exc.strerror}") from exc
    try:
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        name = sock.getsockname()
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--listen-fd {fd}: {exc.strerror}") from exc
    if (
        sock.type != socket.SOCK_STREAM
        or not listening
        or not isinstance(name, tuple)
        or (name[0], name[1]) != (host, port)
    ):
        sock.close()
        raise ConfigError(f"--listen-fd {fd} is not a TCP listener on {_addr(host, port)}")
    return sock


def run_http(prepared: Prepared, host: str, port: int, *, listen_fd: int | None = None) -> None:
    """Serve MCP over streamable HTTP on ``host:port`` (loopback, checked again here).

    The port is bound (or, with ``listen_fd``, the inherited listener checked) before
    the URL is printed, so the line appears only when the server can be reached.
    """
    import uvicorn

    parse_listen(_addr(host, port))
    if prepared.token is None:
        raise PathRefused("the HTTP transport needs a bearer token")
    sock = bind_listener(host, port) if listen_fd is None else adopt_listener(listen_fd, host, port)
    server = build_server(prepared.config)
    inner = server.streamable_http_app(host=host)
    app = GateMiddleware(inner, token=prepared.token, port=port)
    print(f"agentbox MCP server: {mcp_url(host, port)}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False)
    anyio.run(uvicorn.Server(config).serve, [sock])


def _agentbox_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentbox", *args]


#: The launcher's single-instance lock under the data dir; it holds the pid of the
#: launcher that serves (``agentbox.launcher._server``: ``RUN_DIR / LOCK_NAME``).
LAUNCHER_LOCK = Path("run") / "launcher.lock"


def _lock_holder(lock: Path) -> int | None:
    try:
        text = lock.read_text()[:32].strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _wait_for_socket(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    # Connectable, not merely present: a stale socket from an earlier run may still
    # be there until the new launcher replaces it, and the MCP server pins the inode.
    # And served by *our* child: another launcher already serving this data dir also
    # answers there, and our child then refuses to start (its lock is taken).
    lock = path.parent / LAUNCHER_LOCK

    def ours_listening() -> bool:
        if proc.poll() is not None:
            raise SandboxError(f"the launcher exited with {proc.returncode} before it listened")
        return _lock_holder(lock) == proc.pid and socket_accepts(path)

    wait_until(
        ours_listening,
        timeout=timeout,
        interval=0.1,
        on_timeout=lambda: SandboxError(
            f"the launcher did not listen on {path} within {timeout:g}s"
        ),
    )


def _wait_for_http(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    # The listener is ours (bound above, shared only with the child), so any HTTP
    # answer on it comes from the MCP child: it is serving, not merely started.
    request = f"GET /mcp HTTP/1.1\r\nHost: {_addr(host, port)}\r\nConnection: close\r\n\r\n"

    def answering() -> bool:
        if proc.poll() is not None:
            raise SandboxError(
                f"the MCP server exited with {proc.returncode} before it served {_addr(host, port)}"
            )
        with contextlib.suppress(OSError), socket.create_connection((host, port), 2.0) as s:
            s.sendall(request.encode())
            if s.recv(16).startswith(b"HTTP/1."):
                return True
        return False

    wait_until(
        answering,
        timeout=timeout,
        interval=0.1,
        on_timeout=lambda: SandboxError(
            f"the MCP server did not answer on {_addr(host, port)} within {timeout:g}s"
        ),
    )


def serve(
    settings: Settings,
    listen: str,
    *,
    user: str | None,
    max_pending: int,
    metrics: str | None = None,
    ui: str | None = None,
) -> int:
    """Run the launcher and the MCP HTTP server together until SIGINT/SIGTERM.

    Binds the HTTP port first (:class:`ConfigError` naming it when taken: nothing
    is started), then the launcher, then the MCP child on that socket; prints the
    URL, the token file and the ``claude mcp add`` line only once the MCP server
    answers. Returns the exit code (0 after a clean stop).
    """
    host, port = parse_listen(listen)
    tok_file = token_path(settings.data_dir)
    token = load_or_create_token(tok_file)
    listener = bind_listener(host, port)
    stop = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        extra = ["--metrics", metrics] if metrics else []
        launcher = subprocess.Popen(
            _agentbox_argv("launcher", "serve", *extra), start_new_session=True
        )
        procs.append(launcher)
        _wait_for_socket(launcher_socket(settings), launcher, 60.0)
        fd = listener.fileno()
        mcp_args = ["mcp", "--http", listen, "--max-pending", str(max_pending)]
        mcp_args += ["--listen-fd", str(fd)]
        if user:
            mcp_args += ["--user", user]
        mcp = subprocess.Popen(_agentbox_argv(*mcp_args), start_new_session=True, pass_fds=(fd,))
        procs.insert(0, mcp)
        _wait_for_http(host, port, mcp, 60.0)
        listener.close()  # the child holds it now
        web = ""
        if ui:
            view = subprocess.Popen(_agentbox_argv("ui", "--listen", ui), start_new_session=True,
                                    stdout=subprocess.PIPE)  # fmt: skip
            procs.insert(0, view)
            assert view.stdout is not None
            web = f"  web view:   {view.stdout.readline().decode(errors='replace').strip()}\n"
        print(
            f"agentbox is serving.\n  MCP URL:    {mcp_url(host, port)}\n"
            f"  token file: {tok_file}\n  launcher:   {launcher_socket(settings)}\n{web}\n"
            f"Add it to Claude Code with:\n  {claude_add_command(host, port, token)}\n",
            flush=True,
        )
        code = 0
        while not stop:
            for p in procs:
                if p.poll() is not None:
                    log.error("child exited", argv=p.args, code=p.returncode)
                    stop, code = True, p.returncode or 1
            time.sleep(0.2)
        return code
    finally:
        listener.close()
        # MCP first (no new requests), then the launcher, which stops its tasks itself.
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                kill_group(p)
        for s, h in old.items():
            signal.signal(s, h)
