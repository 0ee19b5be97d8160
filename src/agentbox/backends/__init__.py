"""Sandbox backends behind one Protocol (:mod:`agentbox.backends.base`).

:func:`get_backend` is the one way to get a backend by name; each backend's
module is imported only when asked for, so a host without QEMU never imports
the qemu backend.
"""

from __future__ import annotations

import importlib
from typing import Any

from agentbox.backends.base import Backend
from agentbox.config import Settings
from agentbox.errors import UnsupportedError

__all__ = ["BACKENDS", "get_backend"]

#: Backend name → "module:ClassName"; the class is called as ``Class(settings, **kw)``.
BACKENDS: dict[str, str] = {
    "podman": "agentbox.backends.podman:PodmanBackend",
    "qemu": "agentbox.backends.qemu:QemuBackend",
    "firecracker": "agentbox.backends.firecracker:FirecrackerBackend",
}


def get_backend(name: str, settings: Settings, **kw: Any) -> Backend:
    """The backend called ``name``, built with ``settings`` and backend-specific ``kw``."""
    try:
        target = BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(BACKENDS))
        raise UnsupportedError(f"unknown backend {name!r}", fix=f"use one of: {known}") from None
    module, _, cls = target.partition(":")
    backend: Backend = getattr(importlib.import_module(module), cls)(settings, **kw)
    return backend
