"""The registry of backends: one line per backend, the one place backend names live.

A new backend is its folder under ``agentbox.backends`` and one :class:`Registered`
line in :data:`REGISTERED`. From it come :data:`agentbox.backends.BACKENDS` (name →
class), the rows ``agentbox doctor`` prints for each backend, the test suite's facility
switch (a test marked with a backend's name skips, with the reason, where the backend's
facility is missing), and the names the ``backend`` settings accept (the ``Literal`` in
:mod:`agentbox.config` and the Boxfile is checked against :data:`NAMES` by
tests/unit/test_backend_registry.py). Nothing here imports a backend: each target is a
``module:attribute`` string, imported only when asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentbox.config import Settings
from agentbox.core.host import Facility


@dataclass(frozen=True)
class DoctorRow:
    """One row a backend adds to ``agentbox doctor``'s table."""

    facility: Facility
    present: bool | None = None
    """The piece is installed: a failed probe then reads "refused", not "missing"."""
    essential: bool = False
    partial: bool = False
    """Only part of the probe could run (reported as "partial")."""


@dataclass(frozen=True)
class Registered:
    """One backend: its name, its package and the class there. The package's facade also
    names ``facility(settings) -> Facility`` (whether this host can run it: the test
    suite's switch for the marker called ``name``) and ``doctor_rows(settings) ->
    list[DoctorRow]`` (its rows in ``agentbox doctor``), unless ``probes`` is False."""

    name: str
    package: str
    cls: str
    selectable: bool = True
    """A user may name it (``AGENTBOX_BACKEND``, the Boxfile's ``backend``)."""
    probes: bool = True

    @property
    def target(self) -> str:
        """``module:Class``, called as ``Class(settings, **kw)``."""
        return f"{self.package}:{self.cls}"


#: Every backend, in the doctor's order.
REGISTERED: tuple[Registered, ...] = (
    Registered("podman", "agentbox.backends.podman", "PodmanBackend"),
    Registered("qemu", "agentbox.backends.microvm.qemu", "QemuBackend"),
    Registered("firecracker", "agentbox.backends.microvm.firecracker", "FirecrackerBackend"),
    Registered("docker", "agentbox.backends.docker", "DockerBackend"),
    Registered("fake", "agentbox.backends.fake", "FakeBackend", selectable=False, probes=False),
)

#: The names a user may choose (the ``backend`` Literal's values).
NAMES: tuple[str, ...] = tuple(r.name for r in REGISTERED if r.selectable)


def entry(name: str) -> Registered | None:
    """The registered backend called ``name``, if any."""
    return next((r for r in REGISTERED if r.name == name), None)


def _probe(found: Registered, attr: str) -> Any:
    """The backend package's ``attr`` (the package imported now)."""
    return getattr(importlib.import_module(found.package), attr)


def facility(name: str, settings: Settings) -> Facility | None:
    """Whether this host can run backend ``name`` (None: no probe is registered)."""
    found = entry(name)
    if found is None or not found.probes:
        return None
    probe: Callable[[Settings], Facility] = _probe(found, "facility")
    return probe(settings)


def doctor_rows(settings: Settings) -> list[DoctorRow]:
    """Every registered backend's doctor rows, in registry order. A backend whose
    module cannot be imported here says so in one row instead of taking the report down."""
    rows: list[DoctorRow] = []
    for r in REGISTERED:
        if not r.probes:
            continue
        try:
            rows_of: Callable[[Settings], list[DoctorRow]] = _probe(r, "doctor_rows")
        except ImportError as exc:
            fac = Facility(r.name, False, f"backend module missing: {exc}", "reinstall agentbox")
            rows.append(DoctorRow(fac, partial=True))
            continue
        rows += rows_of(settings)
    return rows
