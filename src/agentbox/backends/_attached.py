"""The verbs of a backend that cannot detach (firecracker) or keeps no warm pool.

One mixin instead of the same four refusing methods in each such backend: ``detaches``
is False, and ``launch``/``follow``/``adoptable`` raise the contract's
:func:`~agentbox.backends.base.refuse_detached` error. Callers check ``detaches`` and use
``run()``: the sandbox then lives as long as its caller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from agentbox.backends.base import Exited, OutputCallback, SandboxSpec, refuse_detached


class AttachedOnly:
    """Mixed into a backend whose sandboxes live as long as their caller."""

    name: str

    def detaches(self, runtime: str) -> bool:
        """False: this backend's sandboxes live as long as their caller (see ``run``)."""
        del runtime
        return False

    def launch(self, spec: SandboxSpec, argv: Sequence[str], *, log: Path) -> None:
        """Unsupported here (:meth:`detaches` is False)."""
        raise refuse_detached(self.name, spec.runtime)

    def follow(
        self,
        name: str,
        *,
        log: Path,
        on_stdout: OutputCallback | None,
        on_stderr: OutputCallback | None,
        poll: float = 0.2,
    ) -> Exited:
        """Unsupported here (:meth:`detaches` is False)."""
        raise refuse_detached(self.name)

    def adoptable(self, name: str, *, labels: Mapping[str, str]) -> bool:
        """Unsupported here (:meth:`detaches` is False)."""
        raise refuse_detached(self.name)


class NoPool:
    """Mixed into a backend that keeps no warm pool: every ``launch`` starts afresh."""

    name: str

    def pool_refused(self, runtime: str) -> str | None:
        """Why this backend keeps no pool (see the podman backend's for one that does)."""
        del runtime
        return f"the {self.name} backend keeps no warm pool"

    def fill_pool(self, template: SandboxSpec, size: int, *, ttl: float) -> list[str]:
        """Nothing to start (:meth:`pool_refused` says why)."""
        del template, size, ttl
        return []

    def drain_pool(self, *, everything: bool = True) -> list[str]:
        """Nothing to remove."""
        del everything
        return []
