"""What the host plants for the probes to look for, and tears down afterwards.

* listening TCP ports on the host's 127.0.0.1 and 0.0.0.0 and an abstract unix
  socket: no probe may reach them;
* a marker file at a host path outside every declared mount, a marker next to
  the workspace, and symlinks in the workspace pointing at the host marker;
* a fake agent token in this process's environment and in a launcher-side file,
  next to a fake launcher socket: none may be visible inside;
* a decoy host process whose command line carries a nonce: it must be invisible
  and un-ptraceable;
* a read-only declared mount with a file in it.

The positive controls reuse the same fixture and mount some of it in on purpose.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from agentbox.backends.base import GATEWAY_DIR_IN_SANDBOX, GATEWAY_SOCKET_NAME
from agentbox.backends.podman import SANDBOX_CAPS
from agentbox.core.log import get_logger

log = get_logger(__name__)

#: The fake token's shape: the probe searches for the pattern, so the token itself
#: never has to be sent into the sandbox.
TOKEN_PREFIX = "abxfake"  # noqa: S105 (a fake token, planted on purpose)
TOKEN_REGEX = TOKEN_PREFIX + "[0-9a-f]{40}"
#: Where the host plants the token in its own environment (the launcher side).
TOKEN_ENV = "ANTHROPIC_API_KEY"  # noqa: S105 (a variable name)
RO_TARGET = "/opt/declared"


@dataclass
class Fixture:
    """The host side of one suite run; a context manager that removes everything it made."""

    uid: int
    """The host uid the sandbox uid maps to: the workspace must be owned by it."""
    root: Path = field(init=False)
    token: str = field(init=False)
    marker_nonce: str = field(init=False)
    decoy_nonce: str = field(init=False)
    abstract_name: str = field(init=False)
    ports: list[int] = field(default_factory=list)
    _socks: list[socket.socket] = field(default_factory=list)
    _decoy: subprocess.Popen[bytes] | None = None
    _old_env: str | None = None

    def __enter__(self) -> Self:
        self.token = TOKEN_PREFIX + secrets.token_hex(20)
        self.marker_nonce = "abxmarker" + secrets.token_hex(16)
        self.decoy_nonce = "abxdecoy" + secrets.token_hex(16)
        self.abstract_name = "agentbox-escape-" + secrets.token_hex(8)
        self.root = Path(tempfile.mkdtemp(prefix="agentbox-escape-"))
        try:
            self._plant_files()
            self._listen()
            self._start_decoy()
            self._old_env = os.environ.get(TOKEN_ENV)
            os.environ[TOKEN_ENV] = self.token
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- paths ---------------------------------------------------------------
    @property
    def workspace(self) -> Path:
        return self.root / "ws"

    @property
    def control_workspace(self) -> Path:
        """The weak control's own workspace: the real run may rewrite the first one
        (a microVM syncs /workspace back), and the control needs the links intact."""
        return self.root / "ws-control"

    @property
    def marker_dir(self) -> Path:
        return self.root / "host-only"

    @property
    def marker(self) -> Path:
        return self.marker_dir / "marker"

    @property
    def ro_dir(self) -> Path:
        return self.root / "declared"

    @property
    def gateway_dir(self) -> Path:
        return self.root / "gw"

    @property
    def launcher_dir(self) -> Path:
        return self.root / "launcher"

    @property
    def weak_dir(self) -> Path:
        """Material only the positive controls mount: fake tools, setuid file, engine socket."""
        return self.root / "weak"

    def _plant_files(self) -> None:
        self.root.chmod(0o755)
        for d in (self.workspace, self.marker_dir, self.ro_dir, self.gateway_dir):
            d.mkdir(mode=0o755)
        self.launcher_dir.mkdir(mode=0o700)
        self.marker.write_text(self.marker_nonce + "\n")
        (self.root / "parent-marker").write_text(self.marker_nonce + "\n")
        (self.ro_dir / "readme").write_text("declared read-only mount\n")
        (self.launcher_dir / "token").write_text(self.token + "\n")
        for ws in (self.workspace, self.control_workspace):
            ws.mkdir(mode=0o755, exist_ok=True)
            (ws / "link-marker").symlink_to(self.marker)
            (ws / "link-dir").symlink_to(self.marker_dir)
            (ws / "hello.txt").write_text("workspace file\n")
            for p in [ws, *ws.iterdir()]:
                os.lchown(p, self.uid, self.uid)
        weak_bin = self.weak_dir / "bin"
        weak_bin.mkdir(parents=True)
        for tool in ("apt", "su"):
            (weak_bin / tool).write_text("#!/bin/sh\nexit 1\n")
            (weak_bin / tool).chmod(0o755)
        (weak_bin / "setuid-helper").write_text("#!/bin/sh\nexit 1\n")
        (weak_bin / "setuid-helper").chmod(0o4755)
        opt = self.weak_dir / "opt"
        opt.mkdir()
        (opt / "probe.py").write_text("# writable copy for the control\n")

    def _listen(self) -> None:
        for addr in ("127.0.0.1", "127.0.0.1", "0.0.0.0"):  # noqa: S104 (a decoy on purpose)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((addr, 0))
            s.listen(8)
            self._socks.append(s)
            self.ports.append(s.getsockname()[1])
        a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        a.bind("\0" + self.abstract_name)
        a.listen(8)
        self._socks.append(a)
        for path in (self.launcher_dir / "launcher.sock", self.gateway_dir / GATEWAY_SOCKET_NAME):
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.bind(str(path))
            u.listen(8)
            self._socks.append(u)
        fake_engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fake_engine.bind(str(self.weak_dir / "podman.sock"))
        fake_engine.listen(1)
        self._socks.append(fake_engine)
        # The sandbox uid must be able to connect, as to the real gateway socket.
        (self.gateway_dir / GATEWAY_SOCKET_NAME).chmod(0o666)

    def _start_decoy(self) -> None:
        self._decoy = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(3600)", self.decoy_nonce],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    # -- the probe's configuration -------------------------------------------
    def probe_config(
        self,
        *,
        uid: int,
        pids_max: int,
        runtime: str = "runc",
        own_kernel: bool = False,
        workspace: str = "/workspace",
        extra_mounts: tuple[str, ...] = (),
    ) -> dict[str, object]:
        """The JSON the in-sandbox probe reads on stdin (nonces, ports, expectations).

        ``own_kernel``: a container whose runtime brings its own kernel (gVisor), as its
        backend says (``shares_host_kernel``); the probe asks that, never the runtime's name.
        """
        allowed = [
            "/", "/proc", "/dev", "/sys", "/tmp", "/run", "/var/tmp", "/home/agent",
            "/dev/pts", "/dev/mqueue", "/dev/shm", "/sys/fs/cgroup",
            "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run/.containerenv",
            workspace, GATEWAY_DIR_IN_SANDBOX, RO_TARGET, "/opt/agentbox", *extra_mounts,
        ]  # fmt: skip
        missing = [
            p
            for p in (
                "/proc/kcore",
                "/proc/sched_debug",
                "/proc/sys/kernel/modprobe",
                "/sys/kernel/uevent_helper",
                "/proc/sysrq-trigger",
            )
            if not Path(p).exists()
        ]
        return {
            "uid": uid,
            "runtime": runtime,
            "own_kernel": own_kernel,
            "pids_max": pids_max,
            "workspace": workspace,
            "host_ports": self.ports,
            "host_names": [
                "127.0.0.1",
                "localhost",
                "host.containers.internal",
                "host.docker.internal",
                "10.88.0.1",
                "10.0.2.2",
                "10.0.2.100",
                "169.254.1.1",
            ],
            "abstract_name": self.abstract_name,
            "host_marker": str(self.marker),
            "marker_nonce": self.marker_nonce,
            "parent_marker_name": "parent-marker",
            "workspace_links": [f"{workspace}/link-marker", f"{workspace}/link-dir/marker"],
            "ro_mount": RO_TARGET,
            "allowed_mounts": allowed,
            "allowed_mount_prefixes": ["/proc/", "/sys/", "/dev/", "/opt/agentbox/"],
            "allowed_sockets": [f"{GATEWAY_DIR_IN_SANDBOX}/{GATEWAY_SOCKET_NAME}"],
            "launcher_socket": str(self.launcher_dir / "launcher.sock"),
            "decoy_nonce": self.decoy_nonce,
            "token_regex": TOKEN_REGEX,
            "host_missing": missing,
            "userns_caps": dict(SANDBOX_CAPS),
            # The sandbox's disk limit (the runner sets the spec's); this small one is the
            # controls': their /workspace is a host directory, far larger, so the probe
            # fires on statvfs alone and never writes there.
            "disk": {"size": 64 * 1024**2, "inodes": 4096},
        }

    def close(self) -> None:
        """Stop listeners and the decoy, restore the environment, remove the files."""
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
        self._socks.clear()
        if self._decoy is not None:
            self._decoy.kill()
            self._decoy.wait()
            self._decoy = None
        if getattr(self, "token", None) is not None and os.environ.get(TOKEN_ENV) == self.token:
            if self._old_env is None:
                os.environ.pop(TOKEN_ENV, None)
            else:
                os.environ[TOKEN_ENV] = self._old_env
        root = getattr(self, "root", None)
        if root is not None and root.exists():
            shutil.rmtree(root, ignore_errors=True)
