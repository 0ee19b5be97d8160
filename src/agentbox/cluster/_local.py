"""The local executor: a batch on this host's launcher, no Ray.

The driver's logic (budget, resume, publish, lost attempts) is the same; only
placement differs. Used by the fast tests (with the FakeBackend) and as the
benchmark's baseline (one launcher with as many slots as the Ray nodes have).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from agentbox.cluster._node import NodeService
from agentbox.cluster._spec import Attempt


class LocalExecutor:
    """Runs attempts on one :class:`~agentbox.cluster.NodeService` in this process."""

    def __init__(self, service: NodeService) -> None:
        self.service = service
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=4 * service.slots + 8, thread_name_prefix="agentbox-batch"
        )

    def put(self, data: bytes) -> object:
        return data

    def place(
        self, attempt: Attempt, bundle: object, *, node: str | None
    ) -> concurrent.futures.Future[dict[str, Any]]:
        assert isinstance(bundle, bytes)
        return self._pool.submit(lambda: self.service.run(attempt, bundle).model_dump())

    def is_lost(self, exc: BaseException) -> bool:
        return False

    def where(self) -> dict[str, str]:
        return dict.fromkeys(self.service.active(), self.service.name)

    def cancel(self, attempt_id: str) -> None:
        self.service.cancel(attempt_id)

    def close(self) -> None:
        """Wait for the attempts in flight; idempotent."""
        self._pool.shutdown(wait=True)
