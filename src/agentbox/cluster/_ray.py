"""Ray's part: the node actor, the placement task, and the executor the driver uses.

Ray decides *where* an attempt runs and carries its inputs and outputs; nothing
else. A node advertises ``agentbox_slot`` (one per task it runs at once) when it
joins; the driver starts one tiny *placement task* per attempt asking for one
slot, so Ray puts it on a node with room; the placement task hands the attempt
to that node's actor (named ``agentbox-node-<ray node id>`` in the namespace
``agentbox``) and waits for its outcome, holding the slot meanwhile. The base
bundle travels through the object store once per repo per batch: the
placement task passes its reference on unread, and the actor's worker fetches it.

Nothing Ray carries is a model key: the attempt names a model, and each node's
launcher reads that model's key from the node's own environment or file. But task
texts and repos are other people's data, so nothing is sent to a node before it
proves it is a node actor ``agentbox node start`` made: the executor challenges
every actor with a fresh nonce (:func:`~agentbox.cluster._secure.proof`, keyed by
the node's key, which only holders of the cluster key can derive) and pins each
placement task to a node that answered; the placement task checks the actor it
finds on its node once more, against the answer the driver expects, before it
hands it the attempt. The cluster itself must have Ray's token authentication on
(:func:`connect` refuses one that answers a client without the token).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agentbox.cluster import _secure
from agentbox.cluster._node import NodeService
from agentbox.cluster._spec import Attempt
from agentbox.config import load_settings
from agentbox.core.log import get_logger
from agentbox.errors import ConfigError, RefusedError

log = get_logger(__name__)

#: Ray namespace of the node actors.
NAMESPACE = "agentbox"
#: The custom resource a node advertises, one per task it runs at once.
SLOT = "agentbox_slot"


class _NodeNotReady(RuntimeError):
    """A slot was found on a node that has no agentbox node actor (yet, or any more)."""


def actor_name(node_id: str) -> str:
    """The node actor's name for the Ray node ``node_id``."""
    return f"agentbox-node-{node_id}"


class NodeActor:
    """One per host: that host's :class:`~agentbox.cluster.NodeService`, a client of the
    host's root launcher over its socket.

    It runs as the node user (never root: it refuses), reads its node key from
    ``key_file`` (left by ``agentbox node start``), and makes the repos of its
    attempts under ``repos``. ``overrides`` are settings (the tests give each node
    its own data dir); every other setting comes from the node's own environment.
    """

    def __init__(
        self,
        overrides: dict[str, Any],
        slots: int,
        name: str,
        key_file: str,
        socket_path: str,
        repos: str,
    ) -> None:
        if os.geteuid() == 0:
            raise RefusedError(
                "the node actor runs as root: start the node with `agentbox node start`, "
                f"which runs Ray as the unprivileged {_secure.NODE_USER}"
            )
        self.node_id = ray.get_runtime_context().get_node_id()
        self.name = name
        self._key = _secure.read_node_key(Path(key_file))
        self.svc = NodeService.over_socket(
            load_settings(**overrides),
            Path(socket_path),
            slots=slots,
            name=name,
            repos=Path(repos),
        )

    def prove(self, nonce: str) -> dict[str, object]:
        """The node's info and its proof for ``nonce`` (the driver checks it)."""
        return {
            **self.info(),
            "proof": _secure.proof(self._key, nonce, self.node_id, self.name),
        }

    def run(self, attempt: dict[str, Any], bundle: bytes) -> dict[str, Any]:
        return self.svc.run(Attempt.model_validate(attempt), bundle).model_dump()

    def info(self) -> dict[str, object]:
        return {**self.svc.info(), "node_id": self.node_id, "pid": os.getpid()}

    def cancel(self, attempt_id: str) -> bool:
        return self.svc.cancel(attempt_id)

    def shutdown(self) -> None:
        self.svc.close()


def _place(attempt: dict[str, Any], bundle: list[Any], nonce: str, expected: str) -> dict[str, Any]:
    node_id = ray.get_runtime_context().get_node_id()
    try:
        actor = ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
    except ValueError as exc:
        raise _NodeNotReady(f"no agentbox node actor on Ray node {node_id[:12]}") from exc
    # The actor under this node's name now must be the one the driver checked.
    answer: Any = ray.get(actor.prove.remote(nonce))
    got = answer.get("proof") if isinstance(answer, dict) else None
    if not isinstance(got, str) or got != expected:
        raise _NodeNotReady(f"the node actor on Ray node {node_id[:12]} failed its proof")
    out: Any = ray.get(actor.run.remote(attempt, bundle[0]))
    return dict(out)


# max_retries=0: a placement task that died with its node is re-run by the driver
# with a new attempt id; Ray re-running it would reuse the old one (harmless, as the
# actor's submit is idempotent, but the driver must know the attempt was lost).
_remote_place = ray.remote(num_cpus=0, max_retries=0, resources={SLOT: 1})(_place)
_RemoteNode = ray.remote(num_cpus=0, max_restarts=0)(NodeActor)


def start_node(
    node_id: str,
    *,
    slots: int,
    key_file: Path,
    socket_path: Path,
    repos: Path,
    name: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """Start the node actor on Ray node ``node_id`` after the host's own checks pass.

    ``key_file`` holds the node's key (:func:`~agentbox.cluster._secure.write_node_key`,
    for ``name``), ``socket_path`` is the host's launcher socket, ``repos`` the node
    user's directory for the repos it makes (inside the launcher's repos root).
    The host's own checks (podman, the runtime, Claude Code, the image) are
    ``agentbox node start``'s, as root, before Ray starts. Raises
    :class:`~agentbox.errors.RefusedError` when the actor cannot start (root, no node
    key, the launcher not answering the node user). Returns the actor handle
    (detached: it lives until its node or the cluster stops).
    """
    overrides = overrides or {}
    name = name or f"{socket.gethostname()}-{node_id[:6]}"
    pin = NodeAffinitySchedulingStrategy(node_id, soft=False)
    actor: Any = _RemoteNode.options(
        name=actor_name(node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        max_concurrency=4 * slots + 8,
        scheduling_strategy=pin,
    ).remote(overrides, slots, name, str(key_file), str(socket_path), str(repos))
    try:
        ray.get(actor.info.remote())
    except RayError as exc:
        raise RefusedError(f"node {name} refused: {exc}") from exc
    log.info("node actor started", node=name, node_id=node_id, slots=slots)
    return actor


class RayExecutor:
    """The driver's :class:`~agentbox.cluster.Executor` over a Ray cluster.

    Sends attempts only to node actors that proved themselves with the cluster key
    (``cluster_key``; default: the host's secrets, :func:`~agentbox.cluster._secure.load_secrets`).
    Each placement is pinned to such a node, the least busy one by the driver's count.
    """

    def __init__(self, *, refresh: float = 1.0, cluster_key: bytes | None = None) -> None:
        self._refresh = refresh
        self._key = cluster_key if cluster_key is not None else _secure.load_secrets().key
        self._seen = 0.0
        self._where: dict[str, str] = {}
        self._node_ids: dict[str, str] = {}
        self._proven: dict[str, dict[str, Any]] = {}
        """Ray node id → the info of the node actor that proved itself there."""
        self.refused: dict[str, str] = {}
        """Actor name → why it gets nothing (a failed proof)."""
        self._busy: dict[str, int] = {}
        self._pinned: dict[str, str] = {}
        """Attempt id → the name of the node it is pinned to, while in flight."""
        self._lock = threading.Lock()

    def put(self, data: bytes) -> object:
        return ray.put(data)

    def _pick(self, node: str | None) -> str | None:
        """The Ray node id to pin an attempt to: ``node``'s if it proved itself, else the
        proven node with the most free slots. None when no node proved itself."""
        if node is not None:
            self.where()
            node_id = self._node_ids.get(node, "")
            # A node that is gone: a strategy Ray cannot satisfy fails the attempt as
            # lost, and the driver runs it again elsewhere under a new id.
            return node_id if node_id in self._proven else "0" * 56
        deadline = time.monotonic() + 60.0
        while True:
            self.where()
            with self._lock:
                proven = dict(self._proven)
                if proven:
                    return max(
                        proven,
                        key=lambda n: int(proven[n].get("slots", 1)) - self._busy.get(n, 0),
                    )
            if time.monotonic() > deadline:
                return None
            self._seen = 0.0
            time.sleep(1.0)

    def place(
        self, attempt: Attempt, bundle: object, *, node: str | None
    ) -> concurrent.futures.Future[dict[str, Any]]:
        node_id = self._pick(node)
        if node_id is None:
            raise RefusedError(
                "no agentbox node of this cluster proved itself: start nodes with "
                "`agentbox node start` on hosts holding this cluster's secrets"
                + (f" (refused: {'; '.join(self.refused.values())})" if self.refused else "")
            )
        nonce = secrets.token_hex(16)
        info = self._proven.get(node_id, {})
        expected = _secure.proof(
            _secure.node_key(self._key, str(info.get("node", ""))),
            nonce,
            node_id,
            str(info.get("node", "")),
        )
        opts = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
        ref = _remote_place.options(**opts).remote(attempt.model_dump(), [bundle], nonce, expected)
        fut: concurrent.futures.Future[dict[str, Any]] = ref.future()
        aid = attempt.attempt_id
        with self._lock:
            self._busy[node_id] = self._busy.get(node_id, 0) + 1
            self._pinned[aid] = str(info.get("node", ""))

        def done(f: concurrent.futures.Future[dict[str, Any]]) -> None:
            exc = None if f.cancelled() else f.exception()
            lost = exc is not None and self.is_lost(exc)
            with self._lock:
                self._busy[node_id] = self._busy.get(node_id, 1) - 1
                self._pinned.pop(aid, None)
                if lost:  # pin nothing more there until the node proves itself again
                    self._proven.pop(node_id, None)
                    self._seen = 0.0

        fut.add_done_callback(done)
        return fut

    def is_lost(self, exc: BaseException) -> bool:
        if isinstance(exc, RayTaskError):
            cause = exc.cause
            return isinstance(cause, RayError | _NodeNotReady) or "_NodeNotReady" in str(exc)
        return isinstance(exc, RayError)

    def actors(self) -> list[Any]:
        names = ray.util.list_named_actors(all_namespaces=True)
        out = []
        for entry in names:
            if entry.get("namespace") == NAMESPACE and entry["name"].startswith("agentbox-node-"):
                with contextlib.suppress(ValueError):
                    out.append(ray.get_actor(entry["name"], namespace=NAMESPACE))
        return out

    def nodes(self) -> list[dict[str, Any]]:
        """Every live node actor that proves itself: its info (name, slots, active
        attempts, Ray node id). Actors that fail the proof are left out (``refused``)."""
        nonce = secrets.token_hex(16)
        named = [(n, a) for n, a in self.named_actors()]
        refs = {a.prove.remote(nonce): n for n, a in named}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=5.0)
        out, proven = [], {}
        for ref in ready:
            try:
                info = ray.get(ref)
            except RayError as exc:
                self.refused[refs[ref]] = f"{refs[ref]}: {type(exc).__name__}"
                continue
            ok = isinstance(info, dict) and refs[ref] == actor_name(str(info.get("node_id")))
            if ok and _secure.check_proof(
                self._key, nonce, str(info["node_id"]), str(info.get("node")), info.get("proof")
            ):
                info.pop("proof", None)
                out.append(info)
                proven[str(info["node_id"])] = info
                self.refused.pop(refs[ref], None)
            else:
                if refs[ref] not in self.refused:
                    log.warning("a node actor failed its proof: it gets nothing", actor=refs[ref])
                self.refused[refs[ref]] = f"{refs[ref]}: failed the proof"
        with self._lock:
            self._proven = proven
        return out

    def named_actors(self) -> list[tuple[str, Any]]:
        """``(name, handle)`` of every actor named like a node actor (proven or not)."""
        out = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") == NAMESPACE and entry["name"].startswith("agentbox-node-"):
                with contextlib.suppress(ValueError):
                    out.append((entry["name"], ray.get_actor(entry["name"], namespace=NAMESPACE)))
        return out

    def where(self) -> dict[str, str]:
        """Attempt id → node: the node each in-flight attempt is pinned to, and what the
        proven node actors say they run."""
        if time.monotonic() - self._seen >= self._refresh:
            where: dict[str, str] = {}
            for info in self.nodes():
                self._node_ids[str(info["node"])] = str(info["node_id"])
                for aid in info["active"]:
                    where[aid] = str(info["node"])
            self._where, self._seen = where, time.monotonic()
        with self._lock:
            pinned = {a: n for a, n in self._pinned.items() if n}
        return {**pinned, **self._where}

    def cancel(self, attempt_id: str) -> None:
        for info in list(self._proven.values()):
            with contextlib.suppress(RayError, ValueError):
                actor = ray.get_actor(actor_name(str(info["node_id"])), namespace=NAMESPACE)
                actor.cancel.remote(attempt_id)


_NO_CLUSTER = (
    "no Ray cluster answers at {where}: start one first (on the head: `agentbox node start "
    "--head --slots N`; on every other host: `agentbox node start --address HEAD:6379`), "
    "or name it with --address HEAD:6379 (docs/tutorials/run-a-batch-on-a-cluster.md)"
)


def connect(address: str | None, *, sec: _secure.ClusterSecrets | None = None) -> None:
    """Connect this process to the Ray cluster at ``address`` (or ``RAY_ADDRESS``) with the
    cluster's token.

    Refuses (:class:`~agentbox.errors.RefusedError`, naming the fix) a host without the
    cluster's secrets and a cluster that answers a client without the token; says what
    to do (:class:`~agentbox.errors.ConfigError`) when no cluster answers.
    """
    if ray.is_initialized():
        return
    where: str | None = address or os.environ.get("RAY_ADDRESS") or ""
    if not where or where == "auto":
        where = _local_address()
    if where is None:
        raise ConfigError(_NO_CLUSTER.format(where="this host (no --address, no RAY_ADDRESS)"))
    try:
        open_ = _secure.cluster_is_open(where)
    except ConfigError as exc:
        raise ConfigError(_NO_CLUSTER.format(where=where)) from exc
    if open_:
        raise RefusedError(
            f"the Ray cluster at {where} runs without token authentication: anyone who "
            "reaches its port could run code on its nodes. Restart it with "
            "RAY_AUTH_MODE=token and the cluster's token (`agentbox node start --head` "
            "does; docs/how-to/add-a-cluster-node.md)"
        )
    sec = sec or _secure.load_secrets()
    os.environ.update(_secure.ray_env(sec))
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    # Ray read its config (auth mode, token) when it was imported: read them again.
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    ray.init(
        address=where,
        namespace=NAMESPACE,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )


def _local_address() -> str | None:
    """The address of a Ray cluster this host is part of (Ray's own record), or None."""
    from ray._private.services import canonicalize_bootstrap_address

    from agentbox.cluster._join import NODE_RAY_TMP

    for tmp in (None, str(NODE_RAY_TMP)):
        try:
            got = canonicalize_bootstrap_address("auto", temp_dir=tmp)
        except (ConnectionError, ValueError, RuntimeError, OSError):
            continue
        if got:
            return str(got)
    return None
