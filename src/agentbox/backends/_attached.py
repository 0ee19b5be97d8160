"""The detached-sandbox verbs of a backend that cannot detach (docker, qemu, firecracker).

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
