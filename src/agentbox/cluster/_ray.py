"""Ray's part: the node actor, the placement task, and the executor the driver uses.

Ray decides *where* an attempt runs and carries its inputs and outputs; nothing
else. A node advertises ``agentbox_slot`` (one per task it runs at once) when it
joins; the driver starts one tiny *placement task* per attempt asking for one
slot, so Ray puts it on a node with room; the placement task hands the attempt
to that node's actor (named ``agentbox-node-<ray node id>`` in the namespace
``agentbox``) and waits for its outcome, holding the slot meanwhile. The base
bundle travels through the object store once per repo per batch: the
placement task passes its reference on unread, and the actor's worker fetches it.

Nothing Ray carries is a secret: the attempt names a model, and each node's
launcher reads that model's key from the node's own environment or file.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import socket
import time
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agentbox._log import get_logger
from agentbox.cluster._node import NodeService, node_problems
from agentbox.cluster._spec import Attempt
from agentbox.config import load_settings
from agentbox.errors import RefusedError

__all__ = ["NAMESPACE", "SLOT", "NodeActor", "RayExecutor", "actor_name", "start_node"]

log = get_logger("cluster.ray")

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
    """One per host: that host's :class:`~agentbox.cluster.NodeService` (its launcher).

    ``overrides`` are settings (the tests give each node its own data dir); every
    other setting, model keys included, comes from the node's own environment.
    """

    def __init__(self, overrides: dict[str, Any], slots: int, name: str, check: bool) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        self.svc = NodeService(load_settings(**overrides), slots=slots, name=name, check=check)

    def run(self, attempt: dict[str, Any], bundle: bytes) -> dict[str, Any]:
        return self.svc.run(Attempt.model_validate(attempt), bundle).model_dump()

    def info(self) -> dict[str, object]:
        return {**self.svc.info(), "node_id": self.node_id}

    def cancel(self, attempt_id: str) -> bool:
        return self.svc.cancel(attempt_id)

    def shutdown(self) -> None:
        self.svc.close()


def _check(overrides: dict[str, Any]) -> list[str]:
    return node_problems(load_settings(**overrides))


def _place(attempt: dict[str, Any], bundle: list[Any]) -> dict[str, Any]:
    node_id = ray.get_runtime_context().get_node_id()
    try:
        actor = ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
    except ValueError as exc:
        raise _NodeNotReady(f"no agentbox node actor on Ray node {node_id[:12]}") from exc
    out: Any = ray.get(actor.run.remote(attempt, bundle[0]))
    return dict(out)


_remote_check = ray.remote(num_cpus=0, max_retries=0)(_check)
# max_retries=0: a placement task that died with its node is re-run by the driver
# with a new attempt id; Ray re-running it would reuse the old one (harmless, as the
# actor's submit is idempotent, but the driver must know the attempt was lost).
_remote_place = ray.remote(num_cpus=0, max_retries=0, resources={SLOT: 1})(_place)
_RemoteNode = ray.remote(num_cpus=0, max_restarts=0)(NodeActor)


def start_node(
    node_id: str,
    *,
    slots: int,
    name: str | None = None,
    overrides: dict[str, Any] | None = None,
    check: bool = True,
) -> Any:
    """Start the node actor on Ray node ``node_id`` after the node's own checks pass.

    Raises :class:`~agentbox.errors.RefusedError` with every reason when the
    node cannot run tasks (podman, the runtime, Claude Code or the image missing).
    Returns the actor handle (detached: it lives until its node or the cluster stops).
    """
    overrides = overrides or {}
    name = name or f"{socket.gethostname()}-{node_id[:6]}"
    pin = NodeAffinitySchedulingStrategy(node_id, soft=False)
    if check:
        problems = ray.get(_remote_check.options(scheduling_strategy=pin).remote(overrides))
        if problems:
            raise RefusedError(f"node {name} refused: " + "; ".join(problems))
    actor: Any = _RemoteNode.options(
        name=actor_name(node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        max_concurrency=4 * slots + 8,
        scheduling_strategy=pin,
    ).remote(overrides, slots, name, check)
    try:
        ray.get(actor.info.remote())
    except RayError as exc:
        raise RefusedError(f"node {name} refused: {exc}") from exc
    log.info("node actor started", node=name, node_id=node_id, slots=slots)
    return actor


class RayExecutor:
    """The driver's :class:`~agentbox.cluster.Executor` over a Ray cluster."""

    def __init__(self, *, refresh: float = 1.0) -> None:
        self._refresh = refresh
        self._seen = 0.0
        self._where: dict[str, str] = {}
        self._node_ids: dict[str, str] = {}

    def put(self, data: bytes) -> object:
        return ray.put(data)

    def place(
        self, attempt: Attempt, bundle: object, *, node: str | None
    ) -> concurrent.futures.Future[dict[str, Any]]:
        opts: dict[str, Any] = {}
        if node is not None:
            self.where()
            node_id = self._node_ids.get(node, "")
            # A node that is gone: a strategy Ray cannot satisfy fails the attempt as
            # lost, and the driver runs it again elsewhere under a new id.
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id or "0" * 56, soft=False
            )
        ref = _remote_place.options(**opts).remote(attempt.model_dump(), [bundle])
        fut: concurrent.futures.Future[dict[str, Any]] = ref.future()
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
        """Every live node actor's info (name, slots, active attempts, Ray node id)."""
        refs = [a.info.remote() for a in self.actors()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
        out = []
        for ref in ready:
            with contextlib.suppress(RayError):
                out.append(ray.get(ref))
        return out

    def where(self) -> dict[str, str]:
        if time.monotonic() - self._seen < self._refresh:
            return self._where
        where: dict[str, str] = {}
        for info in self.nodes():
            self._node_ids[str(info["node"])] = str(info["node_id"])
            for aid in info["active"]:
                where[aid] = str(info["node"])
        self._where, self._seen = where, time.monotonic()
        return where

    def cancel(self, attempt_id: str) -> None:
        for actor in self.actors():
            with contextlib.suppress(RayError):
                actor.cancel.remote(attempt_id)


def connect(address: str | None) -> None:
    """Connect this process to the Ray cluster at ``address`` (or ``RAY_ADDRESS``)."""
    if not ray.is_initialized():
        ray.init(
            address=address or os.environ.get("RAY_ADDRESS") or "auto",
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
