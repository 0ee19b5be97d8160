"""``agentbox node start``: make this host a node of the cluster, Ray unprivileged.

As root, in order (nothing joins when a step refuses):

1. the host's own checks (podman, the runtime, Claude Code, the image) and the
   cluster's secrets (:func:`~agentbox.cluster._secure.load_secrets`);
2. the node user and its venv (:func:`~agentbox.cluster._secure.ensure_node_user`),
   its repos directory (inside the launcher's repos root, reachable by it), the
   host's launcher answering on its socket;
3. the node's key, derived from the cluster key, left in a file only the node
   user reads;
4. ``ray start`` (``--head`` or ``--address``) **as the node user**, with
   ``RAY_AUTH_MODE=token`` and the token in its environment (never on a command
   line): the GCS, raylet, object store and every worker run unprivileged;
5. this process connects with the token (refusing a cluster that answers without
   it) and starts the node actor pinned to the new Ray node.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

from agentbox.cluster import _secure
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.errors import CommandError, ConfigError, RefusedError

log = get_logger(__name__)

_TLS_VARS = ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")

#: Where Ray keeps the node user's sessions (``RAY_TMPDIR`` + ``/ray``), by default.
NODE_RAY_TMP = _secure.NODE_HOME / "tmp" / "ray"


def node_tmp(pw: pwd.struct_passwd) -> Path:
    """Ray's temp dir of the node user (``RAY_TMPDIR``): sockets, logs, spilled objects."""
    return Path(pw.pw_dir) / "tmp"


def _reachable(path: Path, pw: pwd.struct_passwd) -> Path | None:
    """The first directory on the way to ``path`` the node user cannot traverse, or None."""
    groups = {pw.pw_gid, *(g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem)}
    for d in [*reversed(path.parents), path]:
        st = d.stat()
        if st.st_uid == pw.pw_uid:
            ok = bool(st.st_mode & stat.S_IXUSR)
        elif st.st_gid in groups:
            ok = bool(st.st_mode & stat.S_IXGRP)
        else:
            ok = bool(st.st_mode & stat.S_IXOTH)
        if not ok:
            return d
    return None


def _repos_dir(settings: Settings, pw: pwd.struct_passwd) -> Path:
    repos = settings.repos_root / "agentbox-cluster"
    repos.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chown(repos, pw.pw_uid, pw.pw_gid)
    repos.chmod(0o700)
    closed = _reachable(repos, pw)
    if closed is not None:
        raise RefusedError(
            f"the node user {pw.pw_name} cannot reach its repos directory {repos} ({closed} "
            "is closed to it): set AGENTBOX_REPOS_ROOT (the launcher's too) to a directory "
            "it can traverse, e.g. /var/lib/agentbox-repos"
        )
    return repos


def _ray_start(
    pw: pwd.struct_passwd,
    sec: _secure.ClusterSecrets | None,
    args: list[str],
    venv: Path,
    *,
    command: str = "start",
) -> None:
    tmp = node_tmp(pw)
    tmp.mkdir(mode=0o700, exist_ok=True)
    os.chown(tmp, pw.pw_uid, pw.pw_gid)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": pw.pw_dir,
        "LANG": "C.UTF-8",
        "RAY_TMPDIR": str(tmp),
        **(_secure.ray_env(sec) if sec is not None else {}),
        # Ray's TLS between hosts, when the caller turned it on (docs: add-a-cluster-node).
        **{k: v for k, v in os.environ.items() if k in _TLS_VARS},
    }
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    argv = [runuser, "-u", pw.pw_name, "--", str(venv / "bin" / "python"), "-m",
            "ray.scripts.scripts", command, *args]  # fmt: skip
    proc = subprocess.run(
        argv, env=env, cwd=pw.pw_dir, capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        raise CommandError(
            argv[:8] + args, proc.returncode, proc.stderr[-2000:], proc.stdout[-2000:]
        )


def join(
    settings: Settings,
    *,
    slots: int,
    name: str | None,
    address: str | None,
    head_port: int | None,
    ray_args: list[str],
    venv: Path = _secure.NODE_VENV,
) -> tuple[str, str]:
    """Join this host (``address``) or start the cluster's head here (``head_port``);
    returns (the node's name, the cluster's address)."""
    from agentbox.cluster._node import node_problems

    problems = node_problems(settings)
    if problems:
        raise RefusedError("this host cannot be a node: " + "; ".join(problems))
    sec = _secure.load_secrets()
    pw = _secure.ensure_node_user(venv)
    repos = _repos_dir(settings, pw)
    sock = settings.data_dir / "launcher.sock"
    if not sock.exists():
        raise RefusedError(
            f"no launcher socket at {sock}: start this host's launcher first "
            "(`agentbox launcher serve`, e.g. as a systemd service)"
        )
    marker = f"agentbox_node_{secrets.token_hex(4)}"
    resources = json.dumps({"agentbox_slot": slots, marker: 1})
    if head_port is not None:
        _ray_start(
            pw,
            sec,
            ["--head", f"--port={head_port}", "--include-dashboard=false", "--disable-usage-stats",
             f"--resources={resources}", *ray_args],
            venv,
        )  # fmt: skip
        address = f"127.0.0.1:{head_port}"
    elif address:
        args = [f"--address={address}", f"--resources={resources}", "--disable-usage-stats"]
        _ray_start(pw, sec, [*args, *ray_args], venv)
    else:
        raise ConfigError("say where the cluster is (--address HEAD:6379) or start it (--head)")
    import ray

    from agentbox.cluster._ray import connect, start_node

    connect(address, sec=sec)
    try:
        listed: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        ids = [n["NodeID"] for n in listed if n["Alive"] and marker in n["Resources"]]
        if not ids:
            raise ConfigError(f"joined {address}, but the new Ray node is not listed")
        node_id = ids[0]
        name = name or f"{os.uname().nodename}-{node_id[:6]}"
        key_file = _secure.write_node_key(sec.key, name, pw)
        start_node(
            node_id,
            slots=slots,
            name=name,
            key_file=key_file,
            socket_path=sock,
            repos=repos,
        )
    finally:
        ray.shutdown()
    log.info("node joined", node=name, address=address, user=pw.pw_name)
    return name, address


def leave(venv: Path = _secure.NODE_VENV) -> None:
    """Stop every Ray process of this host's node user (``ray stop`` as that user): its
    node actor's running attempts are lost to their batches; the launcher settles them."""
    try:
        pw = pwd.getpwnam(_secure.NODE_USER)
    except KeyError as exc:
        raise ConfigError(f"this host has no {_secure.NODE_USER}: it is not a node") from exc
    _ray_start(pw, None, [], venv, command="stop")
