"""The small concrete base every backend's sandbox extends (re-exported by
:mod:`agentbox.backends.base`): the context manager and a verified, idempotent destroy."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Self

from agentbox.errors import SandboxError


class BaseSandbox:
    """The small concrete base of a sandbox: the context manager and a verified destroy.

    A subclass sets ``name`` and implements :meth:`_teardown` (remove everything
    the sandbox holds on the host) and :meth:`leftovers` (what of it is still
    there: processes, cgroups, containers, VM dirs, sockets). :meth:`destroy`
    runs the teardown once, however often and from however many threads it is
    called, then checks :meth:`leftovers` and raises if anything survived, like
    Firecracker's ``Microvm.kill()``.
    """

    name: str

    def __init__(self, name: str) -> None:
        self.name = name
        self._destroy_lock = threading.Lock()
        self._destroyed = False

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def _teardown(self) -> None:
        raise NotImplementedError

    def leftovers(self) -> list[str]:
        """What of this sandbox still exists on the host (empty once destroyed)."""
        return []

    def destroy(self) -> None:
        """Remove the sandbox and everything it held; idempotent; verifies nothing survived."""
        with self._destroy_lock:
            if self._destroyed:
                return
            self._destroyed = True  # even if the teardown raises: never run it twice
            self._teardown()
            left = self.leftovers()
        if left:
            raise SandboxError(f"teardown left {', '.join(left)}", sandbox=self.name)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()
