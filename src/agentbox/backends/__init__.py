"""Sandbox backends behind one Protocol (:mod:`agentbox.backends.base`), by family:
``oci/`` (what ``podman/`` and ``docker/`` share), ``microvm/`` (with ``qemu/`` and
``firecracker/``), the in-process ``fake``.

:mod:`agentbox.backends.registry` is the one place backend names live: a new
backend is a package under ``agentbox.backends`` plus one line there.
:func:`get_backend` is the one way to get a backend by name; each backend's module
is imported only when asked for, so a host without QEMU never imports the qemu
backend. Callers outside this package never compare a
backend's name: they ask its traits (``kind``, ``runtimes``,
``shares_host_kernel``) and call its verbs.
"""

from __future__ import annotations

import contextlib
import importlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentbox.backends._k8slog import exit_marker
from agentbox.backends._uidslots import claim as claim_uid_slot
from agentbox.backends._uidslots import reap as reap_uid_slots
from agentbox.backends._uidslots import release as release_uid_slot
from agentbox.backends.base import Backend, Exited
from agentbox.backends.registry import REGISTERED
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, UnsupportedError, map_exceptions

__all__ = [
    "BACKENDS",
    "Backend",
    "Exited",
    "backend_class",
    "claim_uid_slot",
    "exit_marker",
    "get_backend",
    "mark_bounded",
    "owned_sandboxes",
    "reap_uid_slots",
    "release_uid_slot",
    "settle_dead_disks",
    "slot_settings",
    "sweep_pools",
    "uid_slot",
    "warm_image_facts",
]

log = get_logger(__name__)

#: Backend name → "module:ClassName" (from :mod:`agentbox.backends.registry`); the class is
#: called as ``Class(settings, **kw)``. A test may register one more here for a while.
BACKENDS: dict[str, str] = {r.name: r.target for r in REGISTERED}


def slot_settings(name: str, settings: Settings, slot: int) -> Settings:
    """``settings`` for a sandbox of backend ``name`` that holds uid ``slot``
    (:mod:`agentbox.backends._uidslots`): its own 65536-id range; under docker, whose
    user namespace is the daemon's one ``userns-remap`` range (Engine 20.10 maps no
    container on its own), its own uid in that range: ``sandbox_uid + 1 + slot``."""
    if name == "docker":
        uid = settings.sandbox_uid + 1 + slot
        if uid >= 65536:
            raise UnsupportedError(
                f"docker has no uid left in its 65536-id remap range for uid slot {slot}",
                fix="lower AGENTBOX_UID_SLOTS, or run fewer docker sandboxes at once",
            )
        return settings.model_copy(update={"sandbox_uid": uid})
    return settings.for_slot(slot)


@contextlib.contextmanager
def uid_slot(settings: Settings, backend: str, what: str) -> Iterator[Settings]:
    """``settings`` for one sandbox of ``backend`` outside the launcher (``agentbox exec``,
    the escape suite) holding a uid slot of its own: claimed here, released at the end
    (a process killed meanwhile leaves it to the next reconcile)."""
    owner = f"agentbox-{what}-{secrets.token_hex(6)}"
    slot = claim_uid_slot(settings, owner)
    try:
        yield slot_settings(backend, settings, slot)
    finally:
        release_uid_slot(settings, owner)


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name`` (its module imported now)."""
    try:
        target = BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(BACKENDS))
        raise UnsupportedError(f"unknown backend {name!r}", fix=f"use one of: {known}") from None
    module, _, cls = target.partition(":")
    fix = "reinstall agentbox (a backend module is missing or broken)"
    with map_exceptions(
        {ImportError: lambda m: UnsupportedError(m, fix=fix)}, what=f"backend {name}"
    ):
        found: type[Backend] = getattr(importlib.import_module(module), cls)
    return found


def get_backend(name: str, settings: Settings, **kw: Any) -> Backend:
    """The backend called ``name``, built with ``settings`` and backend-specific ``kw``."""
    backend: Backend = backend_class(name)(settings, **kw)  # type: ignore[call-arg]
    return backend


def owned_sandboxes(settings: Settings) -> list[tuple[str, str]]:
    """(backend, sandbox) for every sandbox of every backend that ``settings.data_dir`` owns.

    What a restarted launcher holds against its records. A backend that cannot be
    built or listed on this host (its tools absent) contributes nothing.
    """
    found: dict[str, str] = {}
    for name in BACKENDS:
        try:
            names = get_backend(name, settings).owned()
        except (AgentboxError, OSError, ImportError) as exc:
            log.debug("backend lists nothing here", backend=name, error=str(exc))
            continue
        for sandbox in names:
            # Backends that share a store (the microVMs' VM dirs) list the same sandbox:
            # the first one registered acts for both, with the same verbs.
            found.setdefault(sandbox, name)
    return [(backend, sandbox) for sandbox, backend in found.items()]


def sweep_pools(settings: Settings) -> list[str]:
    """Each backend's warm pool swept of its expired and dead entries (a dead keeper's
    included: what :func:`owned_sandboxes` leaves out); the names removed."""
    removed: list[str] = []
    for name in BACKENDS:
        try:
            removed += get_backend(name, settings).drain_pool(everything=False)
        except (AgentboxError, OSError, ImportError) as exc:
            log.debug("backend swept no pool here", backend=name, error=str(exc))
    return removed


def mark_bounded(workspace: Path, bounded: bool = True) -> None:
    """Say that ``workspace`` is bounded by a layer of its own (a fork's overlay on its
    own image), so a sandbox of it gets no second workspace disk; ``bounded=False``: no
    more (:mod:`agentbox.backends._wsdisk`)."""
    from agentbox.backends._wsdisk import mark_bounded as _mark

    _mark(workspace, bounded)


def settle_dead_disks(settings: Settings) -> list[str]:
    """Copy back and unmount every workspace disk of this data dir whose owner process is
    gone and whose detached container (if any) is gone too (a launcher killed while it
    held an SDK sandbox or its warm spare); return their sandbox names."""
    from agentbox.backends._wsdisk import settle_orphan_disks

    return settle_orphan_disks(settings)


def warm_image_facts(image: str) -> None:
    """Read ``image``'s facts (``podman image inspect``) ahead, for the processes this one
    forks (:func:`agentbox.backends.oci._args.warm_image_facts`)."""
    from agentbox.backends.oci._args import warm_image_facts as _warm

    _warm(image)
