"""Scale-out on Ray: a batch of tasks over many hosts, each task as safe as on one.

::

    from agentbox.cluster import RayExecutor, connect, read_tasks, run_batch

    connect("10.0.0.1:6379")  # a Ray cluster whose nodes ran `agentbox node start`
    for res in run_batch(read_tasks(Path("tasks.jsonl")), executor=RayExecutor(),
                         state_dir=Path(".agentbox-batches"), budget=50_000_000):
        print(res.key, res.status, res.branch)   # agentbox/<attempt> in the task's repo

Every node runs its own launcher (:class:`NodeService`, held by a Ray actor);
Ray only places attempts (custom resource ``agentbox_slot``) and carries git
bundles and reports. The Ray parts (:class:`RayExecutor`, :func:`connect`,
:func:`start_node`) need the ``agentbox[ray]`` extra and are imported on first
use; the rest works without Ray. See docs/explanation/cluster.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentbox.cluster._driver import Executor, batch_dir, new_batch_id, run_batch
from agentbox.cluster._join import join, leave
from agentbox.cluster._local import LocalExecutor
from agentbox.cluster._node import NodeService, node_problems
from agentbox.cluster._secure import keygen
from agentbox.cluster._spec import (
    Attempt,
    BatchEvent,
    BatchResult,
    BatchTask,
    NodeOutcome,
    read_tasks,
)
from agentbox.cluster._state import BatchState

if TYPE_CHECKING:
    from agentbox.cluster._ray import RayExecutor as RayExecutor
    from agentbox.cluster._ray import connect as connect
    from agentbox.cluster._ray import start_node as start_node

__all__ = [
    "Attempt",
    "BatchEvent",
    "BatchResult",
    "BatchState",
    "BatchTask",
    "Executor",
    "LocalExecutor",
    "NodeOutcome",
    "NodeService",
    "RayExecutor",
    "batch_dir",
    "connect",
    "join",
    "keygen",
    "leave",
    "new_batch_id",
    "node_problems",
    "read_tasks",
    "run_batch",
    "start_node",
]

_LAZY = {"RayExecutor", "connect", "start_node"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            from agentbox.cluster import _ray
        except ImportError as exc:
            from agentbox.errors import UnsupportedError

            raise UnsupportedError(
                f"Ray is not installed ({exc})", fix="pip install 'agentbox[ray]'"
            ) from exc
        return getattr(_ray, name)
    raise AttributeError(name)
