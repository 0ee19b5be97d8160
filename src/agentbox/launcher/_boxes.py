"""Sandboxes driven from Python (:mod:`agentbox.sdk`): the launcher's half.

:class:`BoxKeeper` holds the live sandboxes the SDK made through the launcher's
socket, each with:

* **its owner**, the uid the kernel gave for the connection that created it
  (``SO_PEERCRED``): a non-root caller reaches only its own (another's id is
  :class:`~agentbox.errors.SandboxGone`, as an unknown one);
* **its holders**, a pidfd on each process that created or connected to it (the
  peer pid of that request, from the kernel). The keeper's reaper polls them: once
  none is alive (the script ended, was killed, crashed) the sandbox is removed, as a
  task's sandbox is when its owner is gone. No heartbeat, no connection to keep open;
* **its deadline** (``timeout``, from creation): past it the sandbox is removed
  whatever it is doing. The backend's own watchdog is armed too (a second line).

Each sandbox is the backend's :meth:`~agentbox.backends.base.Backend.create` (the
same hardening as ``agentbox exec``), with a uid slot and a scratch workspace of its
own. With a warm pool configured (``pool_size`` > 0), the keeper keeps one spare
sandbox of the default shape started ahead: a ``Sandbox.create()`` with no image,
backend or Boxfile takes it, and the next spare is started in the background.

Files never cross a host path of the sandbox's making unguarded: writes and uploads
are unpacked *inside* the sandbox by its own uid; reads run ``head -c`` inside it;
downloads are copied out by the backend's ``copy_out`` (tarfile's ``data`` filter,
bounded), then re-packed with links kept as links, and the client unpacks them
through :class:`agentbox.safepath.SafeWriter`.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import secrets
import select
import shutil
import tarfile
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from agentbox.backends import backend_class
from agentbox.backends.base import OWNER_DATA_LABEL, Sandbox, data_dir_label
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, ConfigError, RefusedError, SandboxError, SandboxGone
from agentbox.launcher._primed import Primed
from agentbox.launcher.boxapi import (
    MAX_ARCHIVE,
    MAX_FILE,
    ExecRequest,
    ExecState,
    FileEntry,
    FileList,
    SandboxInfo,
    SandboxRequest,
)

log = get_logger(__name__)

#: How often the reaper looks at deadlines and holders.
REAP_EVERY = 0.5
#: Output kept per background command (the tail).
MAX_KEPT = 1024 * 1024
#: Live sandboxes one non-root uid may hold at once.
MAX_PER_USER = 16
#: How long a spare may wait before it is replaced (its backend deadline is a day).
SPARE_TTL = 3600.0
_EXEC_DIR = "/tmp/.agentbox-exec"


@dataclass
class _Exec:
    id: str
    running: bool = True
    killed: bool = False
    exit_code: int | None = None
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)

    def keep(self, buf: bytearray, chunk: bytes) -> None:
        buf += chunk
        if len(buf) > MAX_KEPT:
            del buf[: len(buf) - MAX_KEPT]

    def state(self) -> ExecState:
        return ExecState(
            exec_id=self.id,
            running=self.running,
            exit_code=self.exit_code,
            stdout=self.out.decode(errors="replace"),
            stderr=self.err.decode(errors="replace"),
        )


@dataclass
class _Box:
    id: str
    box: Sandbox
    stack: contextlib.ExitStack
    backend: str
    image: str
    created_at: float
    uid: int = 0
    deadline_at: float = 0.0
    warm: bool = False
    spec: Any = None
    primed: Primed | None = None
    """A first command's exec started ahead (a podman spare); see :mod:`._primed`."""
    boxfile: Any = None
    """The Boxfile it was made from (its forks are made from it too)."""
    host_uid: int = -1
    """The host uid its sandbox uid is (its uid slot's); the owner of its workspace."""
    holders: dict[int, int] = field(default_factory=dict)  # pid -> pidfd
    execs: dict[str, _Exec] = field(default_factory=dict)

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            id=self.id,
            uid=self.uid,
            backend=self.backend,
            image=self.image,
            created_at=self.created_at,
            deadline_at=self.deadline_at,
            holders=len(self.holders),
            warm=self.warm,
        )


def _check_path(path: str, what: str = "path") -> PurePosixPath:
    p = PurePosixPath(path)
    if not p.is_absolute() or ".." in p.parts or "\0" in path or p == PurePosixPath("/"):
        raise ConfigError(f"{what} must be an absolute path in the sandbox: {path!r:.80}")
    return p


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return None


class BoxKeeper:
    """The SDK's live sandboxes, their owners, holders and deadlines (see the module doc)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._boxes: dict[str, _Box] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._spare: _Box | None = None
        self._spare_wanted = False
        self._filling = threading.Lock()
        self._fillers: list[threading.Thread] = []
        if os.geteuid() == 0:  # what a launcher that died left mounted (before we make any)
            from agentbox.backends.microvm import remove_stale_frozen
            from agentbox.launcher._fork import settle_fork_layers

            settle_fork_layers(settings.data_dir / "scratch")
            remove_stale_frozen(settings.data_dir / "microvm")
        self._reaper = threading.Thread(target=self._reap_loop, name="agentbox-sdk-reaper",
                                        daemon=True)  # fmt: skip
        self._reaper.start()
        if settings.pool_size > 0:  # the warm spare, from the start
            self._fill_in_background()

    def _fill_in_background(self) -> None:
        t = threading.Thread(target=self._fill_spare, name="agentbox-sdk-spare", daemon=True)
        with self._lock:
            self._fillers = [f for f in self._fillers if f.is_alive()] + [t]
        t.start()

    # -- making and removing --------------------------------------------------------------

    def _boxfile(self, req: SandboxRequest, caller: int) -> Any:
        from agentbox.boxfile import Boxfile, loads_boxfile

        data: dict[str, Any] = {}
        if req.boxfile:
            try:
                tomllib.loads(req.boxfile)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"the Boxfile is not TOML: {exc}") from exc
            box = loads_boxfile(req.boxfile, path=Path("<sdk Boxfile>"))
            data = box.model_dump(exclude_unset=True, mode="json")
        if req.image is not None:
            data["image"] = req.image
        if req.backend is not None:
            data["backend"] = req.backend
        if caller != 0 and data.get("mounts"):
            raise RefusedError("a sandbox from the SDK takes no host mounts (root only)")
        box = Boxfile.from_dict(data, path=None, settings=self.settings)
        if box.image_build is not None:
            raise RefusedError("build the image first (`agentbox image build`), then name it")
        return box

    def _start(
        self,
        box: Any,
        deadline: float,
        prepare: Callable[[Path, Settings, contextlib.ExitStack], Path | None] | None = None,
        make: Callable[[Any, Any], Sandbox] | None = None,
    ) -> _Box:
        """A sandbox of ``box`` with its uid slot and scratch workspace (``prepare`` fills
        that first, or returns another workspace, undone by the stack it is given);
        ``make(backend, spec)`` instead of ``backend.create(spec)``."""
        from agentbox.backends import get_backend, uid_slot
        from agentbox.sandbox import spec_from_boxfile

        stack = contextlib.ExitStack()
        try:
            settings = stack.enter_context(uid_slot(self.settings, box.backend, "sdk"))
            root = settings.data_dir / "scratch"
            root.mkdir(parents=True, exist_ok=True, mode=0o711)
            ws = Path(tempfile.mkdtemp(prefix="sdk-", dir=root))
            stack.callback(shutil.rmtree, ws, ignore_errors=True)
            if os.geteuid() == 0:
                os.chown(ws, settings.sandbox_host_uid, settings.sandbox_host_uid)
            if prepare is not None:  # a fork: its parent's files, before anything sees them
                ws = prepare(ws, settings, stack) or ws
            spec = spec_from_boxfile(box, settings, workspace=ws).replace(deadline=deadline)
            # Labelled with the data dir, as a task's: a launcher that starts after this one
            # was killed lists it among its orphans and reaps it (and settles its disk).
            mine = {OWNER_DATA_LABEL: data_dir_label(self.settings.data_dir)}
            spec = spec.replace(labels={**spec.labels, **mine})
            be = get_backend(box.backend, settings)
            be.check(spec)
            sb = be.create(spec) if make is None else make(be, spec)
            stack.callback(sb.destroy)
        except BaseException:
            stack.close()
            raise
        sid = f"sb-{secrets.token_hex(8)}"
        return _Box(sid, sb, stack, box.backend, spec.image, time.time(), spec=spec,
                    boxfile=box, host_uid=settings.sandbox_host_uid)  # fmt: skip

    def create(self, req: SandboxRequest, *, caller: int, pid: int) -> SandboxInfo:
        """Start a sandbox for ``caller``, held by process ``pid``."""
        box = self._boxfile(req, caller)
        if caller != 0 and len(self.list(caller=caller)) >= MAX_PER_USER:
            raise RefusedError(f"{MAX_PER_USER} sandboxes of yours are live; remove one first")
        default = not (req.image or req.backend or req.boxfile)
        made: _Box | None = None
        if default and self.settings.pool_size > 0:
            with self._lock:
                made, self._spare = self._spare, None
                self._spare_wanted = True
            if made is not None:
                made.warm = True
            self._fill_in_background()
        if made is None:
            made = self._start(box, req.timeout + 30)
        made.uid = caller
        made.deadline_at = time.time() + req.timeout
        fd = _pidfd(pid)
        if fd is not None:
            made.holders[pid] = fd
        with self._lock:
            self._boxes[made.id] = made
        log.info("sdk sandbox created", sandbox=made.id, uid=caller, pid=pid, warm=made.warm)
        if fd is None:  # the client is gone already
            self._remove(made.id)
        return made.info()

    def fork(self, sid: str, n: int, timeout: float, *, caller: int, pid: int) -> list[SandboxInfo]:
        """``n`` new sandboxes of ``caller``'s, held by ``pid``, each starting from sandbox
        ``sid``'s files (:mod:`._fork`), each with its own deadline (``timeout``)."""
        from agentbox.launcher._fork import (
            TMPFS_PARTS,
            Lower,
            host_copy,
            overlay_workspace,
            pack_inside,
            paused,
            unpack_inside,
        )

        parent = self._get(sid, caller)
        if caller != 0 and len(self.list(caller=caller)) + n > MAX_PER_USER:
            raise RefusedError(f"{MAX_PER_USER} sandboxes of yours may be live at once")
        if hasattr(getattr(parent.box, "backend", None), "freeze"):  # a VM: memory too
            return self._register_forks(sid, self._fork_vm(parent, n, timeout), timeout,
                                        caller=caller, pid=pid)  # fmt: skip
        on_host = (isinstance(getattr(parent.box, "engine", None), str)  # an OCI engine's
                   and parent.spec is not None
                   and parent.spec.workspace is not None and os.geteuid() == 0)  # fmt: skip
        tmpfs = pack_inside(parent.box, TMPFS_PARTS)
        snap: Path | None = None
        if on_host:
            # One copy taken while the parent is frozen (see _fork); each fork copies that.
            snap = Path(tempfile.mkdtemp(prefix="sdk-fork-", dir=parent.spec.workspace.parent))
            try:
                with paused(parent.box):
                    host_copy(parent.spec.workspace, snap, src_uid=parent.host_uid,
                              dst_uid=parent.host_uid)  # fmt: skip
            except SandboxError as exc:
                log.warning("fork: copying inside instead", sandbox=sid, error=str(exc))
                shutil.rmtree(snap, ignore_errors=True)
                snap = None
        work = None if snap is not None else pack_inside(parent.box, (".",), under="/workspace")

        lower = Lower(snap) if snap is not None else None
        limit = parent.spec.resources.disk_limit(self.settings)

        def layer(ws: Path, settings: Settings, stack: contextlib.ExitStack) -> Path:
            assert lower is not None
            return overlay_workspace(lower, ws, uid=settings.sandbox_host_uid, limit=limit,
                                     stack=stack)  # fmt: skip

        made: list[_Box] = []
        try:
            for _ in range(n):
                child = self._start(parent.boxfile, timeout + 30, layer if lower else None)
                made.append(child)
                unpack_inside(child.box, tmpfs)
                if work is not None:
                    unpack_inside(child.box, work, under="/workspace")
        except BaseException:
            for child in made:
                child.stack.close()
            raise
        finally:
            if lower is not None:
                lower.drop()  # the forks' overlays hold it until the last is gone
        return self._register_forks(sid, made, timeout, caller=caller, pid=pid)

    def _fork_vm(self, parent: _Box, n: int, timeout: float) -> builtins.list[_Box]:
        """``n`` forks of a microVM sandbox from a snapshot of its live VM, memory and
        processes included, ``/data`` copy-on-write (backends/microvm/_fork.py)."""
        be = parent.box.backend  # type: ignore[attr-defined]
        from agentbox.backends.microvm import FROZEN_PREFIX

        vm_root = parent.box.vm_dir.parent  # type: ignore[attr-defined]
        into = Path(tempfile.mkdtemp(prefix=FROZEN_PREFIX, dir=vm_root))
        made: list[_Box] = []
        frozen = None
        try:
            t0 = time.monotonic()
            frozen = be.freeze(parent.box, into)
            took = round(time.monotonic() - t0, 2)
            log.info("fork: parent saved", sandbox=parent.id, seconds=took)
            for _ in range(n):
                made.append(self._start(parent.boxfile, timeout + 30,
                                        make=lambda fb, spec: fb.fork(spec, frozen)))  # fmt: skip
        except BaseException:
            for child in made:
                child.stack.close()
            raise
        finally:
            if frozen is not None:
                frozen.close()  # the forks keep their mappings of its RAM
            shutil.rmtree(into, ignore_errors=True)  # each fork links the base it uses
        return made

    def _register_forks(
        self, sid: str, made: builtins.list[_Box], timeout: float, *, caller: int, pid: int
    ) -> builtins.list[SandboxInfo]:
        out = []
        for child in made:
            child.uid = caller
            child.deadline_at = time.time() + timeout
            if (fd := _pidfd(pid)) is not None:
                child.holders[pid] = fd
            with self._lock:
                self._boxes[child.id] = child
            log.info("sdk sandbox forked", sandbox=child.id, parent=sid, uid=caller, pid=pid)
            out.append(child.info())
        return out

    def _fill_spare(self) -> None:
        if not self._filling.acquire(blocking=False):
            return
        try:
            with self._lock:
                if self._spare is not None or self._stop.is_set():
                    return
            from agentbox.boxfile import Boxfile

            shape = Boxfile.from_dict({}, path=None, settings=self.settings)
            spare: _Box | None = self._start(shape, SPARE_TTL + 24 * 3600)
            if spare is not None and getattr(backend_class(spare.backend), "primes_exec", False):
                tmp = self.settings.data_dir / "tmp"
                tmp.mkdir(mode=0o700, exist_ok=True)
                primed = Primed(spare.box.name, spare.spec.uid, spare.spec.workdir, tmp)
                spare.primed = primed
                spare.stack.callback(primed.close)  # before the sandbox goes (LIFO)
            with self._lock:
                if self._spare is None and not self._stop.is_set():
                    self._spare, spare = spare, None
            if spare is not None:
                spare.stack.close()
        except (AgentboxError, OSError) as exc:
            log.warning("the SDK's warm spare could not start", error=str(exc))
        finally:
            self._filling.release()

    def _remove(self, sid: str) -> _Box | None:
        with self._lock:
            b = self._boxes.pop(sid, None)
        if b is None:
            return None
        for fd in b.holders.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        b.holders.clear()
        try:
            b.stack.close()
        except (AgentboxError, OSError) as exc:
            log.warning("sdk sandbox removal failed", sandbox=sid, error=str(exc))
        log.info("sdk sandbox removed", sandbox=sid)
        return b

    def _reap_loop(self) -> None:
        while not self._stop.wait(REAP_EVERY):
            now = time.time()
            with self._lock:
                boxes = list(self._boxes.values())
                spare = self._spare
            for b in boxes:
                for pid, fd in list(b.holders.items()):
                    ready, _, _ = select.select([fd], [], [], 0)
                    if ready:  # a pidfd is readable once its process has exited
                        os.close(fd)
                        b.holders.pop(pid, None)
                if not b.holders:
                    log.warning("sdk sandbox reaped: its owner is gone", sandbox=b.id)
                    self._remove(b.id)
                elif now >= b.deadline_at:
                    log.warning("sdk sandbox reaped: deadline reached", sandbox=b.id)
                    self._remove(b.id)
            if spare is not None and now - spare.created_at > SPARE_TTL:
                with self._lock:
                    stale, self._spare = self._spare, None
                if stale is not None:
                    stale.stack.close()

    def stop(self) -> None:
        """Remove every sandbox (the launcher is going away); idempotent. A spare being
        started is waited for (it removes itself once it sees the stop), so the launcher
        never exits with half a sandbox behind it."""
        self._stop.set()
        with self._lock:
            fillers = list(self._fillers)
        for t in fillers:
            t.join(timeout=120)
        with self._lock:
            ids = list(self._boxes)
            spare, self._spare = self._spare, None
        for sid in ids:
            self._remove(sid)
        if spare is not None:
            spare.stack.close()

    # -- lookups ------------------------------------------------------------------------

    def _get(self, sid: str, caller: int) -> _Box:
        with self._lock:
            b = self._boxes.get(sid)
        if b is None or (caller != 0 and b.uid != caller):
            raise SandboxGone(f"no sandbox {sid[:40]!r}")  # another's: as an unknown one
        return b

    def get(self, sid: str, *, caller: int) -> SandboxInfo:
        return self._get(sid, caller).info()

    @property
    def spare_ready(self) -> bool:
        with self._lock:
            return self._spare is not None

    def list(self, *, caller: int) -> list[SandboxInfo]:
        with self._lock:
            boxes = list(self._boxes.values())
        return [b.info() for b in boxes if caller == 0 or b.uid == caller]

    def connect(self, sid: str, *, caller: int, pid: int) -> SandboxInfo:
        """Add process ``pid`` to the sandbox's holders."""
        b = self._get(sid, caller)
        if pid not in b.holders and (fd := _pidfd(pid)) is not None:
            b.holders[pid] = fd
        return b.info()

    def remove(self, sid: str, *, caller: int) -> SandboxInfo:
        info = self._get(sid, caller).info()
        self._remove(sid)
        return info

    # -- commands -----------------------------------------------------------------------

    def run(
        self,
        sid: str,
        req: ExecRequest,
        *,
        caller: int,
        on_stdout: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None],
    ) -> tuple[int, bool]:
        """Run one command (foreground), streaming its output; (exit code, timed out)."""
        b = self._get(sid, caller)
        with self._lock:
            primed, b.primed = b.primed, None
        if primed is not None and primed.alive() and not req.env:
            argv = self._argv(req)
            if req.timeout is not None:  # as the backend's exec: coreutils timeout, inside
                argv = ["timeout", "--kill-after=2", f"{max(req.timeout, 0.1):g}", *argv]
            started = time.monotonic()
            rc = primed.run(argv, stdin=None if req.stdin is None else req.stdin.encode(),
                            on_stdout=on_stdout, on_stderr=on_stderr)  # fmt: skip
            late = req.timeout is not None and time.monotonic() - started >= req.timeout
            return rc, late and rc in (124, 137)
        if primed is not None:
            primed.close()
        res = b.box.exec(self._argv(req), env=req.env, timeout=req.timeout,
                         stdin=None if req.stdin is None else req.stdin.encode(),
                         on_stdout=on_stdout, on_stderr=on_stderr)  # fmt: skip
        return res.exit_code, res.timed_out

    def _argv(self, req: ExecRequest, exec_id: str | None = None) -> builtins.list[str]:
        argv = ["sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
        if not argv:
            raise ConfigError("exec needs a command")
        if req.cwd is not None:
            argv = ["sh", "-c", 'cd -- "$0" && exec "$@"', str(_check_path(req.cwd, "cwd")), *argv]
        if exec_id is not None:  # its own process group, its pid where kill() finds it
            script = f'mkdir -p {_EXEC_DIR} && echo $$ > {_EXEC_DIR}/{exec_id} && exec "$@"'
            argv = ["setsid", "-w", "sh", "-c", script, "sh", *argv]
        return argv

    def start(self, sid: str, req: ExecRequest, *, caller: int) -> ExecState:
        """Run one command in the background; its state."""
        b = self._get(sid, caller)
        ex = _Exec(secrets.token_hex(8))
        b.execs[ex.id] = ex
        argv = self._argv(req, ex.id)

        def work() -> None:
            try:
                res = b.box.exec(argv, env=req.env, timeout=req.timeout,
                                 stdin=None if req.stdin is None else req.stdin.encode(),
                                 on_stdout=lambda c: ex.keep(ex.out, c),
                                 on_stderr=lambda c: ex.keep(ex.err, c))  # fmt: skip
                ex.exit_code = 137 if ex.killed else res.exit_code  # setsid says 9
                if ex.killed:  # setsid's own word on it is noise
                    kept = [x for x in ex.err.splitlines(keepends=True)
                            if not x.startswith(b"setsid: child ")]  # fmt: skip
                    ex.err[:] = b"".join(kept)
            except (AgentboxError, OSError) as exc:
                ex.keep(ex.err, f"agentbox: {exc}\n".encode())
                ex.exit_code = -1
            finally:
                ex.running = False

        threading.Thread(target=work, name=f"agentbox-sdk-exec-{ex.id}", daemon=True).start()
        return ex.state()

    def exec_state(self, sid: str, exec_id: str, *, caller: int) -> ExecState:
        ex = self._get(sid, caller).execs.get(exec_id)
        if ex is None:
            raise SandboxGone(f"no command {exec_id[:40]!r} in sandbox {sid}")
        return ex.state()

    def kill(self, sid: str, exec_id: str, *, caller: int) -> ExecState:
        """SIGKILL a background command's process group, inside the sandbox."""
        b = self._get(sid, caller)
        ex = b.execs.get(exec_id)
        if ex is None:
            raise SandboxGone(f"no command {exec_id[:40]!r} in sandbox {sid}")
        if ex.running:
            ex.killed = True
            f = f"{_EXEC_DIR}/{exec_id}"
            script = (
                f'p=$(cat {f} 2>/dev/null) && [ -n "$p" ] && '
                '{ pkill -KILL -g "$p" || kill -9 "$p"; }'  # the group: dash kill takes no -PGID
            )
            for _ in range(50):  # the pid file is written a moment after the start
                if b.box.exec(["sh", "-c", script], timeout=30).exit_code == 0 or not ex.running:
                    break
                time.sleep(0.1)
        return ex.state()

    # -- files --------------------------------------------------------------------------

    def write(self, sid: str, path: str, data: bytes, *, caller: int) -> FileEntry:
        """Write ``data`` at ``path`` in the sandbox, unpacked there by the sandbox's uid."""
        b = self._get(sid, caller)
        p = _check_path(path)
        if len(data) > MAX_FILE:
            raise RefusedError(f"a file of more than {MAX_FILE} bytes")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(p.name)
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(data))
        script = 'mkdir -p -- "$0" && exec tar -x --no-same-owner -C "$0" -f -'
        res = b.box.exec(["sh", "-c", script, str(p.parent)], stdin=buf.getvalue(), timeout=300)
        if res.exit_code != 0:
            raise SandboxError(f"write {path}: {res.stderr.decode(errors='replace')[-500:]}")
        return FileEntry(name=p.name, path=str(p), type="file", size=len(data), mode=0o644)

    def read(self, sid: str, path: str, *, caller: int) -> bytes:
        """The file at ``path`` (read inside the sandbox, at most :data:`MAX_FILE` bytes)."""
        b = self._get(sid, caller)
        p = _check_path(path)
        script = '[ -f "$0" ] || { echo "not a file: $0" >&2; exit 2; }; exec head -c "$1" -- "$0"'
        res = b.box.exec(["sh", "-c", script, str(p), str(MAX_FILE + 1)], timeout=300)
        if res.exit_code != 0:
            raise SandboxGone(f"read {path}: {res.stderr.decode(errors='replace')[-300:].strip()}")
        if len(res.stdout) > MAX_FILE:
            raise RefusedError(f"{path} is larger than {MAX_FILE} bytes")
        return res.stdout

    def listdir(self, sid: str, path: str, *, caller: int) -> FileList:
        b = self._get(sid, caller)
        p = _check_path(path) if path != "/" else PurePosixPath("/")
        fmt = r"%y\t%s\t%m\t%P\0"
        res = b.box.exec(["find", str(p), "-mindepth", "1", "-maxdepth", "1", "-printf", fmt],
                         timeout=120)  # fmt: skip
        if res.exit_code != 0:
            raise SandboxGone(f"list {path}: {res.stderr.decode(errors='replace')[-300:].strip()}")
        kinds = {"f": "file", "d": "dir", "l": "link"}
        out: list[FileEntry] = []
        for rec in res.stdout.split(b"\0"):
            parts = rec.decode(errors="replace").split("\t", 3)
            if len(parts) != 4:
                continue
            y, size, mode, name = parts
            out.append(FileEntry(name=name, path=str(p / name), type=kinds.get(y, "other"),  # type: ignore[arg-type]
                                 size=int(size), mode=int(mode, 8)))  # fmt: skip
        return FileList(entries=sorted(out, key=lambda e: e.name))

    def upload(self, sid: str, dest: str, archive: bytes, *, caller: int) -> FileList:
        """Unpack a tar under directory ``dest``, inside the sandbox as its uid."""
        b = self._get(sid, caller)
        d = _check_path(dest)
        if len(archive) > MAX_ARCHIVE:
            raise RefusedError(f"an archive of more than {MAX_ARCHIVE} bytes")
        entries: list[FileEntry] = []
        try:
            with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
                for m in tar.getmembers():
                    name = PurePosixPath(m.name)
                    if name.is_absolute() or ".." in name.parts or not (m.isreg() or m.isdir()
                                                                        or m.issym()):  # fmt: skip
                        raise RefusedError(f"upload: refused entry {m.name[:200]!r}")
                    kind = "file" if m.isreg() else "dir" if m.isdir() else "link"
                    entries.append(FileEntry(name=name.name, path=str(d / name), type=kind,  # type: ignore[arg-type]
                                             size=m.size, mode=m.mode & 0o777))  # fmt: skip
        except tarfile.TarError as exc:
            raise RefusedError(f"upload: not a tar: {exc}") from exc
        script = (
            'mkdir -p -- "$0" && exec tar -x --no-same-owner --no-same-permissions -C "$0" -f -'
        )
        res = b.box.exec(["sh", "-c", script, str(d)], stdin=archive, timeout=600)
        if res.exit_code != 0:
            raise SandboxError(f"upload to {dest}: {res.stderr.decode(errors='replace')[-500:]}")
        return FileList(entries=entries)

    def download(self, sid: str, path: str, *, caller: int) -> bytes:
        """A tar of ``path`` (links as links; none pointing out survives the copy-out)."""
        b = self._get(sid, caller)
        p = _check_path(path)
        tmp_root = self.settings.data_dir / "tmp"
        tmp_root.mkdir(mode=0o700, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=tmp_root, prefix="sdk-dl-") as tmp:
            got = Path(tmp) / "x"
            b.box.copy_out(str(p), got)  # bounded, tarfile's data filter
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                tar.add(got, arcname=p.name)  # lstat: a link is archived, never followed
            if buf.tell() > MAX_ARCHIVE:
                raise RefusedError(f"{path}: more than {MAX_ARCHIVE} bytes")
            return buf.getvalue()
