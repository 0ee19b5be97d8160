"""What keeps a Ray cluster of agentbox nodes closed: its secrets, its users, its proofs.

Two secrets, made once by ``agentbox node keygen`` and copied (root-only) to every
node host and every driver host, in ``/etc/agentbox/cluster/`` (or the directory
``AGENTBOX_CLUSTER_SECRETS`` names):

``ray-token``
    Ray's own token authentication (``RAY_AUTH_MODE=token``): every Ray process
    (GCS, raylets, workers, drivers) must present it, so a host that can reach the
    head's port but lacks the token is refused before it can run anything.
    Ray's processes hold it (they run as the node user, :data:`NODE_USER`).
``cluster.key``
    Never given to Ray. From it ``agentbox node start`` (root) derives the node's
    own key (:func:`node_key`, bound to the node's name) and leaves it to the node
    actor in a file only the node user reads. The driver, holding ``cluster.key``,
    challenges every node actor with a fresh nonce (:func:`proof`) before it sends
    it anything: an actor some Ray peer registered under an agentbox name, without
    the key, gets no task.

Both files must be owned by the reading user and private (mode ``0600`` or
stricter); anything else is refused with the fix.

Ray's processes on a node (raylet, object store, workers, the node actor) run as
:data:`NODE_USER`, a system user in the group ``agentbox``: it reaches the root
launcher only through the launcher's socket, with that group's rights (its own
tasks, repos it owns). The user runs Ray from :data:`NODE_VENV`, a venv of the
system's ``python3`` that sees agentbox's own install (the project venv may be
made by an interpreter only root can run).
"""

from __future__ import annotations

import grp
import hashlib
import hmac
import os
import pwd
import secrets
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from agentbox.errors import ConfigError, RefusedError, UnsupportedError

#: The unprivileged user every Ray process of a node runs as (group ``agentbox``).
NODE_USER = "agentbox-node"
#: Its home (0700): the node keys and Ray's temp dir live here.
NODE_HOME = Path("/var/lib/agentbox-node")
#: The venv it runs Ray and the node actor from (root-owned, world-readable).
NODE_VENV = Path("/opt/agentbox/node-venv")
TOKEN_NAME = "ray-token"  # noqa: S105 (a file name)
KEY_NAME = "cluster.key"
_FIX = "run `agentbox node keygen` on one host and copy /etc/agentbox/cluster/ to every node and driver host (docs/how-to/add-a-cluster-node.md)"  # noqa: E501


def secrets_dir() -> Path:
    """Where the cluster's secrets are: ``AGENTBOX_CLUSTER_SECRETS`` or /etc/agentbox/cluster."""
    return Path(os.environ.get("AGENTBOX_CLUSTER_SECRETS") or "/etc/agentbox/cluster")


class ClusterSecrets:
    """The Ray token and the cluster key, read from a private directory."""

    def __init__(self, token: str, key: bytes, where: Path) -> None:
        self.token, self.key, self.where = token, key, where

    @property
    def token_file(self) -> Path:
        return self.where / TOKEN_NAME


def _read_private(path: Path) -> bytes:
    # A Kubernetes Secret volume links each file into a ..data dir: follow the links of
    # a directory only root writes (checked below: the file must be the reader's, 0600).
    path = path.resolve()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise RefusedError(f"no {path.name} at {path}: Ray's token authentication "
                           f"needs it ({_FIX})") from exc  # fmt: skip
    except OSError as exc:
        raise RefusedError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise RefusedError(
                f"{path} must be a file owned by uid {os.geteuid()} with mode 0600 (it is "
                f"uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): "
                f"chown {os.geteuid()} {path} && chmod 600 {path}"
            )
        return os.read(fd, 4096).strip()
    finally:
        os.close(fd)


def load_secrets(where: Path | None = None) -> ClusterSecrets:
    """The cluster's secrets; RefusedError naming the fix when missing or not private."""
    where = where or secrets_dir()
    token = _read_private(where / TOKEN_NAME).decode("ascii", "replace")
    key = _read_private(where / KEY_NAME)
    if len(token) < 32 or len(key) < 32:
        raise RefusedError(f"the secrets in {where} are too short (made by hand?): {_FIX}")
    return ClusterSecrets(token, key, where)


def keygen(where: Path | None = None) -> Path:
    """Make the Ray token and the cluster key in ``where`` (0700 dir, 0600 files) unless
    they exist; returns the directory."""
    where = where or secrets_dir()
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    where.chmod(0o700)
    for name, value in ((TOKEN_NAME, secrets.token_hex(32)), (KEY_NAME, secrets.token_hex(32))):
        path = where / name
        if path.exists():
            continue
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(value)
    load_secrets(where)  # what we made must pass our own checks
    return where


def ray_env(sec: ClusterSecrets) -> dict[str, str]:
    """The environment a Ray process of this cluster needs (token auth on, the token)."""
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": sec.token,
        # Nodes run the system's python3; a driver's venv may be another patch release
        # of the same minor version (Ray's default refuses any patch difference).
        "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL": "minor",
    }


def node_key(cluster_key: bytes, name: str) -> bytes:
    """The key of the node named ``name``: only holders of ``cluster.key`` can compute it."""
    return hmac.new(cluster_key, b"agentbox-node\0" + name.encode(), hashlib.sha256).digest()


def proof(key: bytes, nonce: str, node_id: str, name: str) -> str:
    """A node's answer to the driver's ``nonce``: binds its name and Ray node id."""
    msg = f"agentbox-prove\0{nonce}\0{node_id}\0{name}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def check_proof(cluster_key: bytes, nonce: str, node_id: str, name: str, got: object) -> bool:
    """Whether ``got`` is the node ``name``'s proof for ``nonce`` on ``node_id``."""
    want = proof(node_key(cluster_key, name), nonce, node_id, name)
    return isinstance(got, str) and hmac.compare_digest(want, got)


_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    c = GcsClient(address=sys.argv[1])
    c.internal_kv_get(b"agentbox-probe", b"agentbox", timeout=10)
except Exception as exc:
    print(type(exc).__name__, str(exc)[:200])
    sys.exit(3 if "uthenticat" in f"{type(exc).__name__} {exc}" else 4)
"""


def cluster_is_open(address: str) -> bool:
    """Whether the Ray cluster at ``address`` answers a client that has no token.

    Asked from a child process with token authentication off and no token anywhere
    (an empty HOME): its GCS either refuses it (the cluster is closed: False) or
    answers (True). ConfigError when the address does not answer at all.
    """
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=10).close()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"nothing listens at {address}: {exc}") from exc
    # Everything Ray's but its TLS settings (a TLS cluster is asked over TLS, tokenless).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RAY_") or k == "RAY_USE_TLS" or k.startswith("RAY_TLS_")
    }
    with tempfile.TemporaryDirectory(prefix="agentbox-rayprobe-") as home:
        env.update(HOME=home, RAY_AUTH_MODE="disabled")
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, address],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    if proc.returncode == 0:
        return True
    if proc.returncode == 3:
        return False
    raise ConfigError(
        f"no Ray cluster answers at {address} ({proc.stdout.strip()[:200] or proc.stderr[-200:]})"
    )


def site_dir() -> Path:
    """Where this agentbox and its Ray are installed (the running venv's site-packages)."""
    return Path(sysconfig.get_paths()["purelib"])


def ensure_node_user(venv: Path = NODE_VENV) -> pwd.struct_passwd:
    """Make :data:`NODE_USER` (group ``agentbox``, home 0700) and :data:`NODE_VENV` unless
    they exist; root only. Returns the user's entry."""
    if os.geteuid() != 0:
        raise RefusedError("making the node user needs root (run `agentbox node start` as root)")
    try:
        grp.getgrnam("agentbox")
    except KeyError:
        subprocess.run(["groupadd", "--system", "agentbox"], check=True)
    try:
        pw = pwd.getpwnam(NODE_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--gid", "agentbox", "--home-dir", str(NODE_HOME),
             "--create-home", "--shell", "/usr/sbin/nologin", NODE_USER],
            check=True,
        )  # fmt: skip
        pw = pwd.getpwnam(NODE_USER)
    home = Path(pw.pw_dir)
    home.mkdir(mode=0o700, exist_ok=True)
    os.chown(home, pw.pw_uid, pw.pw_gid)
    home.chmod(0o700)
    python = venv / "bin" / "python"
    pth = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    line = f"import site; site.addsitedir({str(site_dir())!r})\n"
    if not python.exists():
        base = Path("/usr/bin/python3")
        if not base.exists():
            raise UnsupportedError("no /usr/bin/python3 for the node user's venv",
                                   fix="apt-get install python3 python3-venv")  # fmt: skip
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
    pth.mkdir(parents=True, exist_ok=True)
    target = pth / "agentbox-site.pth"
    if not target.is_file() or target.read_text() != line:
        target.write_text(line)
    return pw


def write_node_key(cluster_key: bytes, name: str, pw: pwd.struct_passwd) -> Path:
    """Leave the node's key where only the node user reads it; returns its path."""
    keys = Path(pw.pw_dir) / "keys"
    keys.mkdir(mode=0o700, exist_ok=True)
    os.chown(keys, pw.pw_uid, pw.pw_gid)
    keys.chmod(0o700)
    path = keys / f"{hashlib.sha256(name.encode()).hexdigest()[:16]}.key"
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
    try:
        os.write(fd, node_key(cluster_key, name).hex().encode())
        os.fchown(fd, pw.pw_uid, pw.pw_gid)
    finally:
        os.close(fd)
    tmp.replace(path)
    return path


def read_node_key(path: Path) -> bytes:
    """The node actor's key, from the file ``agentbox node start`` left it."""
    try:
        return bytes.fromhex(_read_private(path).decode("ascii"))
    except ValueError as exc:
        raise RefusedError(f"{path} holds no node key") from exc
