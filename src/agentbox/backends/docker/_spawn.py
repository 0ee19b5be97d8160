"""Commands under gVisor start from inside the sandbox, so they inherit its seccomp filter.

runsc applies the OCI seccomp profile to the container's init and its descendants
only: a process started by ``docker exec`` (``runsc exec``) runs *without* it
(measured: ``Seccomp: 0`` in its status, ``unshare(CLONE_NEWUSER)`` succeeded, the
escape suite's ``privs.seccomp``, ``net.socket_families`` and ``ns.userns_creation``
failed). So under runsc the container's main process is :data:`SPAWNER`, a child of
tini that holds the filter. A ``docker exec`` runs only :data:`CLIENT`, which makes
itself non-dumpable (the agent's uid cannot ptrace it), hands its stdin, stdout and
stderr, argv, environment and working directory to the spawner over an abstract
unix socket (per network namespace: the container's own; bound before any agent
code runs, so nothing else can take the name), and exits with the command's code.
The spawner forks, and the command runs filtered. Under runc, ``runc exec`` applies
the filter itself and commands are exec'd directly.
"""

from __future__ import annotations

#: Abstract socket name (leading NUL), in the container's own network namespace.
SOCKET = "agentbox-spawn"

#: The container's main process under runsc: ``python3 -I -S -c SPAWNER LIFE``.
SPAWNER = r"""
import json, os, socket, sys, threading
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind("\0" + "NAME")
srv.listen(64)
threading.Timer(float(sys.argv[1]), lambda: os._exit(0)).start()
def serve(conn):
    fds = []
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
        while not msg.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                return
            msg += more
        req = json.loads(msg)
        argv = [str(a) for a in req["argv"]]
        env = {str(k): str(v) for k, v in req["env"].items()}
        cwd = str(req["cwd"])
        if len(fds) != 3 or not argv:
            return
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                for i, fd in enumerate(fds):
                    os.dup2(fd, i)
                os.closerange(3, 4096)
                os.chdir(cwd)
                os.execvpe(argv[0], argv, env)
            except OSError as e:
                os.write(2, ("agentbox: cannot run %s: %s\n" % (argv[0], e.strerror)).encode())
                os._exit(127 if isinstance(e, FileNotFoundError) else 126)
        for fd in fds:
            os.close(fd)
        fds = []
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        conn.sendall(str(code if code >= 0 else 128 - code).encode())
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
""".replace("NAME", SOCKET)

#: What ``docker exec`` runs under runsc: ``python3 -I -S -c CLIENT -- ARGV...``.
CLIENT = r"""
import ctypes, json, os, socket, sys
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
import time
end = time.monotonic() + 60
while True:  # the spawner may still be starting (a fresh sandbox's first command)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("\0" + "NAME")
        break
    except OSError:
        s.close()
        if time.monotonic() > end:
            raise
        time.sleep(0.02)
req = json.dumps({"argv": sys.argv[2:], "env": dict(os.environ), "cwd": os.getcwd()}) + "\n"
socket.send_fds(s, [req.encode()], [0, 1, 2])
got = b""
while True:
    chunk = s.recv(64)
    if not chunk:
        break
    got += chunk
os._exit(int(got) if got.strip().isdigit() else 137)
""".replace("NAME", SOCKET)
