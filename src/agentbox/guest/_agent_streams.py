"""The guest agent's streams: commands (exec, signal), files (tar in and out)
and gateway connections (part of :mod:`agentbox.guest.agent`)."""

from __future__ import annotations

# ruff: noqa: SIM105 - try/except/pass instead of contextlib.suppress: no contextlib import
import _thread
import os

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only; never imported in the guest
    import socket
    from _queue import SimpleQueue

if __package__:
    from .wire import (
        FILE,
        GW,
        GW_WINDOW,
        MAX_PAYLOAD,
        STDERR,
        STDOUT,
        ProtocolError,
        encode_frame,
    )
else:  # pragma: no cover - the guest's layout: top-level modules next to agent.py
    from wire import (  # type: ignore[import-not-found,no-redef]
        FILE,
        GW,
        GW_WINDOW,
        MAX_PAYLOAD,
        STDERR,
        STDOUT,
        ProtocolError,
        encode_frame,
    )
if __package__:
    from ._agent_sys import (
        GATEWAY_PORT,
        SIGRTMAX,
        SOCKET_DIR,
        UNTAR,
        Channel,
        _Credit,
        _spawn,
    )
else:  # pragma: no cover - the guest's layout: top-level modules next to agent.py
    from _agent_sys import (  # type: ignore[import-not-found,no-redef]
        GATEWAY_PORT,
        SIGRTMAX,
        SOCKET_DIR,
        UNTAR,
        Channel,
        _Credit,
        _spawn,
    )


class Streams(Channel):
    """Everything the host runs or moves on a stream of its own."""

    # -- exec
    def op_exec(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        argv = [str(a) for a in msg["argv"]]
        if not argv:
            raise ProtocolError("empty argv")
        env = {str(k): str(v) for k, v in dict(msg.get("env") or {}).items()}
        uid = int(msg.get("uid", self.uid))
        cwd = str(msg.get("cwd") or "/")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        if msg.get("stdin"):
            in_r, in_w = os.pipe()
        else:
            in_r, in_w = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC), -1
        try:
            # no_new_privs is already set on the agent (inherited).
            pid = _spawn(argv, env, cwd, uid if uid != 0 else None, (in_r, out_w, err_w))
        except OSError as exc:
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            self.ctrl({"op": "exit", "code": 127, "error": str(exc)}, stream)
            return
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        self.procs[stream] = pid
        if in_w >= 0:
            from _queue import SimpleQueue

            q: SimpleQueue[bytes | None] = SimpleQueue()
            self.stdin_q[stream] = q
            _thread.start_new_thread(self._feed, (in_w, q))
        done = [_thread.allocate_lock(), _thread.allocate_lock()]
        for lock in done:
            lock.acquire()
        _thread.start_new_thread(self._pump, (out_r, STDOUT, stream, done[0]))
        _thread.start_new_thread(self._pump, (err_r, STDERR, stream, done[1]))
        _thread.start_new_thread(self._reap, (pid, done, stream))
        self.ctrl({"op": "started", "pid": pid}, stream)

    def _feed(self, fd: int, q: SimpleQueue[bytes | None]) -> None:
        try:
            while (chunk := q.get()) is not None:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
        except OSError:
            pass
        finally:
            os.close(fd)

    def _pump(self, fd: int, ftype: int, stream: int, done: _thread.LockType) -> None:
        try:
            while chunk := os.read(fd, MAX_PAYLOAD):
                self.send(encode_frame(ftype, stream, chunk))
            self.send(encode_frame(ftype, stream, b""))
        finally:
            os.close(fd)
            done.release()

    def _reap(self, pid: int, done: list[_thread.LockType], stream: int) -> None:
        _, status = os.waitpid(pid, 0)
        for lock in done:
            lock.acquire()
        self.procs.pop(stream, None)
        q = self.stdin_q.pop(stream, None)
        if q is not None:
            q.put(None)
        self.ctrl({"op": "exit", "code": os.waitstatus_to_exitcode(status)}, stream)

    def op_signal(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        pid = self.procs.get(stream)
        sig = int(msg["sig"])
        if pid is not None and 0 < sig <= SIGRTMAX:
            try:
                os.killpg(pid, sig)
            except OSError:
                pass

    # -- files: tar streams, extracted/created by the image's python in-guest
    def op_put(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        r, w = os.pipe()
        dest = str(msg["dest"])
        self.puts[stream] = (w, dest)
        _thread.start_new_thread(self._untar, (r, dest, stream))

    def put_chunk(self, stream: int, chunk: bytes) -> None:
        ent = self.puts.get(stream)
        if ent is None:
            return
        w = ent[0]
        if not chunk:
            os.close(w)
            self.puts.pop(stream, None)
            return
        try:
            os.write(w, chunk)
        except OSError:
            pass

    def _untar(self, r: int, dest: str, stream: int) -> None:
        # The workload owns where a copy lands (/workspace, /tmp) and may have planted
        # links there: extracting as root would write through them. So a child
        # extracts as the sandbox uid (it can write only where the workload could),
        # with the rules of tarfile's "data" filter (see UNTAR).
        import sys

        err = ""
        err_r, err_w = os.pipe()
        try:
            uid = self.uid if self.uid != 0 else None
            env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
            argv = [sys.executable or "python3", "-I", "-S", "-c", UNTAR, dest]
            pid = _spawn(argv, env, "/", uid, (r, err_w, err_w))
        except OSError as exc:
            pid, err = 0, f"cannot start the extraction: {exc}"
        finally:
            os.close(r)
            os.close(err_w)
        out = b""
        try:
            while chunk := os.read(err_r, 65536):
                out = (out + chunk)[-2000:]
        finally:
            os.close(err_r)
        if pid:
            _, status = os.waitpid(pid, 0)
            if status != 0:
                lines = out.decode(errors="replace").strip().splitlines()
                code = os.waitstatus_to_exitcode(status)
                err = lines[-1] if lines else f"the extraction exited with {code}"
        self.ctrl({"op": "put_ok", "error": err}, stream)

    def op_get(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        _thread.start_new_thread(self._tar, (str(msg["src"]), stream))

    def _tar(self, src: str, stream: int) -> None:
        import tarfile

        class Sink:
            def write(s, b: bytes) -> int:
                for i in range(0, len(b), MAX_PAYLOAD):
                    self.send(encode_frame(FILE, stream, bytes(b[i : i + MAX_PAYLOAD])))
                return len(b)

        err = ""
        try:
            if not os.path.lexists(src):
                raise FileNotFoundError(src)
            arc = os.path.basename(src.rstrip("/")) or "."
            # A copy-on-write mount (a frozen environment) is not the workspace's:
            # its files never travel back with it.
            top = src.rstrip("/") + "/"
            skip = {arc + "/" + t[len(top) :] for t in self.cow_targets if t.startswith(top)}

            def keep(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
                return None if ti.name in skip else ti

            with tarfile.open(fileobj=Sink(), mode="w|", format=tarfile.PAX_FORMAT) as tf:  # type: ignore[call-overload]
                tf.add(src, arcname=arc, recursive=True, filter=keep)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
        self.send(encode_frame(FILE, stream, b""))
        self.ctrl({"op": "get_ok", "error": err}, stream)

    # -- gateway streams
    def start_gateway(self) -> None:
        if self.gateway_started:
            return
        import socket

        self.gateway_started = True
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", GATEWAY_PORT))
        srv.listen(64)
        _thread.start_new_thread(self._accept, (srv,))

    def start_sockets(self, names: list) -> None:  # type: ignore[type-arg]
        # Extra host sockets of the gateway dir (the egress proxy's ``egress.sock``):
        # each a unix socket at SOCKET_DIR/<name>, the sandbox uid's only, whose
        # connections ride the channel as gateway streams opened ``to`` that name.
        if not names:
            return  # no import: socket (and enum's classes) cost a cold hello ~0.13 s (TCG)
        import socket

        for name in names:
            ok = isinstance(name, str) and 6 <= len(name) <= 32 and name.endswith(".sock")
            if not ok or not set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789-."):
                raise ProtocolError(f"bad socket name {name!r:.40}")
            os.makedirs(SOCKET_DIR, 0o755, exist_ok=True)
            path = f"{SOCKET_DIR}/{name}"
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(path)
            os.chown(path, self.uid, self.uid)
            os.chmod(path, 0o600)
            srv.listen(64)
            _thread.start_new_thread(self._accept, (srv, name))

    def _accept(self, srv: socket.socket, to: str | None = None) -> None:
        from _queue import SimpleQueue

        while True:
            conn, _ = srv.accept()
            with self.lock:
                sid = self.next_gw
                self.next_gw += 2
            q: SimpleQueue[bytes | None] = SimpleQueue()
            self.gw[sid] = q
            credit = self.gw_credit[sid] = _Credit(GW_WINDOW)
            self.ctrl({"op": "gw_open"} if to is None else {"op": "gw_open", "to": to}, sid)
            down = _thread.allocate_lock()
            down.acquire()
            _thread.start_new_thread(self._gw_down, (conn, sid, q, down))
            _thread.start_new_thread(self._gw_up, (conn, sid, credit, down))

    def op_gw_credit(self, stream: int, msg: dict) -> None:  # type: ignore[type-arg]
        n = msg.get("n")
        if type(n) is not int or not 0 < n <= GW_WINDOW:
            raise ProtocolError(f"bad gateway credit {n!r}")
        credit = self.gw_credit.get(stream)
        if credit is not None:
            credit.add(n)

    def _gw_up(
        self, conn: socket.socket, sid: int, credit: _Credit, down: _thread.LockType
    ) -> None:
        # Read from the workload only what the host has room for: when the host
        # (the gateway) stops draining, the workload's own send blocks in here.
        try:
            while (room := credit.wait()) > 0:
                chunk = conn.recv(min(room, MAX_PAYLOAD))
                if not chunk:
                    break
                credit.spend(len(chunk))
                self.send(encode_frame(GW, sid, chunk))
        except OSError:
            pass
        self.send(encode_frame(GW, sid, b""))
        down.acquire()
        conn.close()
        self.gw_credit.pop(sid, None)

    def _gw_down(
        self, conn: socket.socket, sid: int, q: SimpleQueue[bytes | None], down: _thread.LockType
    ) -> None:
        import socket

        try:
            while (chunk := q.get()) is not None:
                conn.sendall(chunk)
        except OSError:
            pass
        try:
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.gw.pop(sid, None)
        down.release()
