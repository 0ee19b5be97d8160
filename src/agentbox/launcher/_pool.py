"""The launcher's warm pool keeper: refills the podman pool in the background, drains it
at the end (``launcher serve`` only: a one-shot ``agentbox run`` keeps no pool).

The pool's shape is a default task's: the settings' image and runtime, a default
Boxfile's resources, a workspace and a gateway dir, the default deadline. A task of
another shape (a Boxfile with other resources, extra mounts, an environment layer, a
longer deadline) takes the fresh path. The backend keeps the pool
(``Backend.fill_pool``/``drain_pool``; podman's is :mod:`agentbox.backends.podman._pool`)
and says why it keeps none (``pool_refused``).
"""

from __future__ import annotations

import threading
import time

from agentbox.backends import get_backend
from agentbox.backends.base import Backend, SandboxSpec
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError
from agentbox.launcher.api import DEFAULT_DEADLINE
from agentbox.sandbox import spec_from_boxfile

log = get_logger(__name__)

#: How often the keeper tops the pool up (a claim takes one; cheap when full).
REFILL_EVERY = 1.0
#: How often it sweeps expired or dead entries (asks podman about claimed slots).
SWEEP_EVERY = 30.0
#: After a failed refill (the image gone, podman down), wait this long.
BACKOFF = 30.0


def pool_template(settings: Settings) -> SandboxSpec:
    """The spec of a default task, as the launcher builds it (paths are the slot's)."""
    here = settings.data_dir
    return spec_from_boxfile(
        Boxfile(), settings, name="agentbox-pool-template", workspace=here, gateway_dir=here
    ).replace(deadline=DEFAULT_DEADLINE)


class PoolKeeper:
    """A daemon thread that keeps ``settings.pool_size`` sandboxes ready; :meth:`stop` drains."""

    def __init__(self, settings: Settings, backend: Backend) -> None:
        self.settings = settings
        self.backend = backend
        self.template = pool_template(settings)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="agentbox-pool", daemon=True)

    def start(self) -> PoolKeeper:
        self._thread.start()
        return self

    def _loop(self) -> None:
        next_sweep = 0.0
        while not self._stop.is_set():
            wait = REFILL_EVERY
            try:
                if time.monotonic() >= next_sweep:
                    self.backend.drain_pool(everything=False)
                    next_sweep = time.monotonic() + SWEEP_EVERY
                started = self.backend.fill_pool(
                    self.template, self.settings.pool_size, ttl=self.settings.pool_ttl
                )
                if started:
                    log.info("pool refilled", started=started)
            except (AgentboxError, OSError) as exc:
                log.warning("pool refill failed; retrying later", error=str(exc))
                wait = BACKOFF
            self._stop.wait(wait)

    def stop(self) -> list[str]:
        """Stop refilling, then remove every unclaimed pooled sandbox; return them."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=180)
        try:
            return self.backend.drain_pool()
        except (AgentboxError, OSError) as exc:
            log.warning("pool drain failed", error=str(exc))
            return []


def drain_leftovers(settings: Settings) -> list[str]:
    """Remove the idle sandboxes a previous launcher's pool left (and, once no slot is
    left, the pool's mount at ``data_dir/pool``): a launcher that keeps no pool, or
    whose backend keeps none, starts without them. A claimed one is a
    task's: it stays until its task settles."""
    if not (settings.data_dir / "pool").is_dir():
        return []
    try:
        removed = get_backend("podman", settings).drain_pool()
    except (AgentboxError, OSError) as exc:
        log.warning("the previous pool could not be drained", error=str(exc))
        return []
    if removed:
        log.info("previous pool drained", removed=len(removed))
    return removed


def start_pool(settings: Settings) -> PoolKeeper | None:
    """A running keeper when the settings ask for a pool the backend can keep; else None
    (and what a previous launcher's pool left is drained)."""
    if settings.pool_size <= 0:
        drain_leftovers(settings)
        return None
    backend = get_backend(settings.backend, settings)
    refused = backend.pool_refused(settings.runtime)
    if refused is not None:
        log.warning("no warm pool", reason=refused)
        drain_leftovers(settings)
        return None
    return PoolKeeper(settings, backend).start()
