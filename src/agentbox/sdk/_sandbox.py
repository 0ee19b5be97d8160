"""``Sandbox``: a hardened sandbox driven from Python, through the launcher.

::

    with Sandbox.create() as sb:
        r = sb.commands.run("python3 -c 'print(6*7)'")   # r.exit_code, r.stdout, r.stderr
        for chunk in sb.commands.run("pytest -q", stream=True):
            print(chunk.stream, chunk.data, end="")
        h = sb.commands.run("sleep 30", background=True); h.kill()
        sb.files.write("/workspace/a.py", "print(1)\\n")
        sb.upload(local_dir, "/workspace"); sb.download("/workspace/out", local_dir)

The sandbox lives in the launcher (``agentbox launcher serve``), not in this
process: it is removed when the ``with`` block ends, at its deadline (``timeout``),
or once no process holding it (the one that created it, any that connected to it)
is alive any more.
"""

from __future__ import annotations

import builtins
import io
import os
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Literal, Self, overload

from agentbox.errors import SandboxError
from agentbox.launcher.boxapi import (
    ExecEvent,
    ExecRequest,
    ExecState,
    FileEntry,
    SandboxInfo,
    SandboxRequest,
)
from agentbox.launcher.client import LauncherClient
from agentbox.sdk._transport import connect

#: Size caps of a download unpacked on this host.
MAX_DOWNLOAD_FILE = 64 * 1024 * 1024
MAX_DOWNLOAD_TOTAL = 256 * 1024 * 1024


@dataclass(frozen=True)
class CommandResult:
    """How a command ended, and what it printed."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False


@dataclass(frozen=True)
class OutputChunk:
    """A piece of a streamed command's output, as it came."""

    stream: Literal["stdout", "stderr"]
    data: str


class CommandStream:
    """The chunks of a command as they come (iterate it); then :attr:`result`."""

    def __init__(self, events: Iterator[ExecEvent]) -> None:
        self._events = events
        self._out: list[str] = []
        self._err: list[str] = []
        self.result: CommandResult | None = None
        """Set once the iteration has ended."""

    def __iter__(self) -> Iterator[OutputChunk]:
        for ev in self._events:
            if ev.kind == "stdout":
                self._out.append(ev.data)
                yield OutputChunk("stdout", ev.data)
            elif ev.kind == "stderr":
                self._err.append(ev.data)
                yield OutputChunk("stderr", ev.data)
            elif ev.kind == "exit":
                self.result = CommandResult(ev.exit_code if ev.exit_code is not None else -1,
                                            "".join(self._out), "".join(self._err),
                                            ev.timed_out)  # fmt: skip
            else:
                raise SandboxError(f"the command could not run: {ev.data}")

    def wait(self) -> CommandResult:
        """Drain what is left; the result."""
        for _ in self:
            pass
        if self.result is None:
            raise SandboxError("the command's stream ended without its exit")
        return self.result


class CommandHandle:
    """A command running in the background: :meth:`kill` it, or :meth:`wait` for it."""

    def __init__(self, client: LauncherClient, sandbox_id: str, state: ExecState) -> None:
        self._client, self._sid, self.exec_id = client, sandbox_id, state.exec_id
        self._state = state

    def state(self) -> ExecState:
        """Whether it runs, its exit code and its output so far (the tail)."""
        self._state = self._client.sandbox_exec_state(self._sid, self.exec_id)
        return self._state

    def kill(self) -> ExecState:
        """SIGKILL its process group in the sandbox."""
        self._state = self._client.sandbox_kill(self._sid, self.exec_id)
        return self._state

    def wait(self, timeout: float | None = None, *, poll: float = 0.2) -> CommandResult:
        """Until it ended; its result (:class:`TimeoutError` past ``timeout``)."""
        from agentbox.core.wait import wait_until

        st = wait_until(lambda: s if not (s := self.state()).running else None,
                        timeout=float("inf") if timeout is None else timeout,
                        on_timeout=lambda: TimeoutError(f"still running after {timeout}s"),
                        interval=poll)  # fmt: skip
        return CommandResult(st.exit_code if st.exit_code is not None else -1, st.stdout, st.stderr)


class Commands:
    """``sb.commands``: run commands in the sandbox (as its uid, in /workspace)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    @overload
    def run(self, cmd: str | Sequence[str], *, stream: Literal[False] = False,
            background: Literal[False] = False, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float | None = None,
            stdin: str | None = None) -> CommandResult: ...  # fmt: skip
    @overload
    def run(self, cmd: str | Sequence[str], *, stream: Literal[True],
            background: Literal[False] = False, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float | None = None,
            stdin: str | None = None) -> CommandStream: ...  # fmt: skip
    @overload
    def run(self, cmd: str | Sequence[str], *, stream: bool = False,
            background: Literal[True], env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float | None = None,
            stdin: str | None = None) -> CommandHandle: ...  # fmt: skip

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        stream: bool = False,
        background: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        stdin: str | None = None,
    ) -> CommandResult | CommandStream | CommandHandle:
        """Run ``cmd`` (a string: through ``sh -c``; a list: as argv).

        Returns its :class:`CommandResult` once it ended; with ``stream=True`` a
        :class:`CommandStream` of :class:`OutputChunk` as they come; with
        ``background=True`` a :class:`CommandHandle` at once. A non-zero exit is a
        result, not an exception.
        """
        req = ExecRequest(cmd=cmd if isinstance(cmd, str) else list(cmd), env=dict(env or {}),
                          cwd=cwd, timeout=timeout, stdin=stdin,
                          background=background)  # fmt: skip
        client, sid = self._sb._client, self._sb.id
        if background:
            return CommandHandle(client, sid, client.sandbox_start(sid, req))
        s = CommandStream(client.sandbox_exec(sid, req))
        return s if stream else s.wait()


class Files:
    """``sb.files``: read, write and list files in the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def write(self, path: str, data: str | bytes) -> FileEntry:
        """Write ``data`` at absolute ``path`` (parents made), as the sandbox's uid."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        return self._sb._client.sandbox_write(self._sb.id, path, raw)

    def read(self, path: str) -> str:
        """The text of the file at ``path`` (UTF-8, errors replaced); :meth:`read_bytes`."""
        return self.read_bytes(path).decode(errors="replace")

    def read_bytes(self, path: str) -> bytes:
        return self._sb._client.sandbox_read(self._sb.id, path)

    def list(self, path: str = "/workspace") -> builtins.list[FileEntry]:
        """The entries of directory ``path`` (not recursive), by name."""
        return self._sb._client.sandbox_list_dir(self._sb.id, path)


class Sandbox:
    """A live sandbox in the launcher: :meth:`create` one, or :meth:`connect` to one."""

    def __init__(
        self,
        client: LauncherClient,
        info: SandboxInfo,
        *,
        owned: bool,
        address: str | os.PathLike[str] | None = None,
    ) -> None:
        self._client = client
        self.info = info
        self._owned = owned
        self._address = address
        self.commands = Commands(self)
        self.files = Files(self)

    @property
    def id(self) -> str:
        return self.info.id

    @classmethod
    def create(
        cls,
        image: str | None = None,
        backend: str | None = None,
        boxfile: str | os.PathLike[str] | None = None,
        timeout: float = 600,
        *,
        address: str | os.PathLike[str] | None = None,
    ) -> Sandbox:
        """Start a sandbox (a Boxfile's hardening; ``timeout`` seconds at most).

        ``boxfile`` is a path this process reads (the launcher opens no path of yours).
        """
        text = Path(boxfile).read_text() if boxfile is not None else None
        client = connect(address)
        try:
            req = SandboxRequest(image=image, backend=backend, boxfile=text, timeout=float(timeout))
            return cls(client, client.sandbox_create(req), owned=True, address=address)
        except BaseException:
            client.close()
            raise

    @classmethod
    def connect(cls, sandbox_id: str, *, address: str | os.PathLike[str] | None = None) -> Sandbox:
        """Attach to a live sandbox of yours; this process holds it too from now on
        (leaving the ``with`` block does not remove it: :meth:`kill` does)."""
        client = connect(address)
        try:
            return cls(client, client.sandbox_connect(sandbox_id), owned=False, address=address)
        except BaseException:
            client.close()
            raise

    @classmethod
    def list(cls, *, address: str | os.PathLike[str] | None = None) -> list[SandboxInfo]:
        """Your live sandboxes (root: everyone's)."""
        with connect(address) as client:
            return client.sandbox_list()

    def refresh(self) -> SandboxInfo:
        self.info = self._client.sandbox_get(self.id)
        return self.info

    def fork(self, n: int = 1, *, timeout: float = 600) -> builtins.list[Sandbox]:
        """``n`` (1..8) new sandboxes whose files start as this one's are now: the
        workspace (on podman and docker this sandbox is paused while it is copied on the
        host, copy-on-write where the filesystem allows; packed and unpacked inside on
        a microVM) and the tmpfs
        (``/tmp``, ``$HOME``); not its processes or memory. Each is a full
        :class:`Sandbox` of the same Boxfile and hardening, yours, held by this process,
        with its own deadline (``timeout`` seconds); ``with`` or :meth:`kill` each."""
        infos = self._client.sandbox_fork(self.id, n, timeout=timeout)
        out = []
        for info in infos:
            client = connect(self._address)
            out.append(Sandbox(client, info, owned=True, address=self._address))
        return out

    def kill(self) -> None:
        """Remove the sandbox now (idempotent)."""
        import contextlib

        from agentbox.errors import SandboxGone

        with contextlib.suppress(SandboxGone):
            self._client.sandbox_remove(self.id)

    def close(self) -> None:
        """Remove it if this object created it, and close the connection pool."""
        try:
            if self._owned:
                self.kill()
        finally:
            self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- trees ------------------------------------------------------------------------

    def upload(
        self, local_dir: str | os.PathLike[str], dest: str = "/workspace"
    ) -> builtins.list[FileEntry]:
        """Copy the *contents* of ``local_dir`` into directory ``dest`` in the sandbox.

        Links are sent as links (never followed here); devices, FIFOs and sockets are
        refused. What lands is unpacked by the sandbox's own uid.
        """
        root = Path(local_dir)
        if not root.is_dir():
            raise NotADirectoryError(str(root))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for entry in sorted(root.iterdir()):
                tar.add(entry, arcname=entry.name, filter=_plain)
        return self._client.sandbox_upload(self.id, dest, buf.getvalue())

    def download(self, path: str, local_dir: str | os.PathLike[str]) -> Path:
        """Copy ``path`` (a file or a directory) out of the sandbox into ``local_dir``;
        returns the local path (``local_dir / basename(path)``, which must not exist).

        The launcher copies it out as collection does (tarfile's ``data`` filter: a link
        pointing out of it does not survive); here it is unpacked through
        :class:`agentbox.safepath.SafeWriter`: no link is ever followed, links are made
        as links, nothing is overwritten, files over 64 MiB (256 MiB in all) are refused.
        """
        from agentbox.safepath import SafeWriter

        data = self._client.sandbox_download(self.id, path)
        dest = Path(local_dir)
        dest.mkdir(parents=True, exist_ok=True)
        name = PurePosixPath(path).name
        with (
            tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar,
            SafeWriter(
                dest, max_file_size=MAX_DOWNLOAD_FILE, max_total_size=MAX_DOWNLOAD_TOTAL
            ) as w,  # fmt: skip
        ):
            for m in tar:
                if m.isdir():
                    w.mkdir(m.name)
                elif m.isreg():
                    f = tar.extractfile(m)
                    assert f is not None
                    w.write_file(m.name, f, mode=m.mode)
                elif m.issym():
                    w.symlink(m.name, m.linkname)
                # hard links, devices, FIFOs: never made here
        return dest / name


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if not (info.isreg() or info.isdir() or info.issym()):
        raise SandboxError(f"upload: {info.name} is not a file, directory or link")
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info
