"""The suite's entry point: one backend/runtime, optionally with its positive controls."""

from __future__ import annotations

import time

from agentbox.backends import get_backend, uid_slot
from agentbox.backends.base import Backend
from agentbox.config import Settings
from agentbox.core.log import get_logger
from agentbox.escape._controls import exec_controls, run_weak_controls, stall_control
from agentbox.escape._fixtures import Fixture
from agentbox.escape._model import Outcome, Report
from agentbox.escape._registry import PROBES
from agentbox.escape._runner import real_spec, run_real
from agentbox.escape._uidrange import shared_range_control


def _exec_controls_on_podman(settings: Settings, fx: Fixture, image: str) -> list[Outcome]:
    spec = real_spec(fx, settings, image, "runc", "standard").replace(
        name=f"agentbox-escape-{fx.marker_nonce[-12:]}-execctl"
    )
    with get_backend("podman", settings).create(spec) as box:
        return exec_controls(box.name, settings.sandbox_uid)


log = get_logger(__name__)


def run_suite(
    backend: Backend,
    settings: Settings,
    *,
    runtime: str = "runc",
    isolation: str = "standard",
    image: str | None = None,
    controls: bool = False,
) -> Report:
    """Run every probe on a real sandbox of ``backend``; with ``controls``, prove each can fire.

    The controls use podman (runc) whatever the backend: they prove the *probes*
    (the same program and host checks every backend runs), and the weakened
    container must drop the user namespace, which no backend offers.
    """
    image = image or settings.image
    report = Report(backend=backend.name, runtime=runtime, isolation=isolation)
    t0 = time.monotonic()
    with uid_slot(settings, backend.name, "escape") as slotted:  # a uid range of its own
        backend, settings = get_backend(backend.name, slotted), slotted
        _run(report, backend, settings, runtime, isolation, image, controls)
    report.seconds = time.monotonic() - t0
    return report


def _run(
    report: Report,
    backend: Backend,
    settings: Settings,
    runtime: str,
    isolation: str,
    image: str,
    controls: bool,
) -> None:
    with Fixture(uid=settings.sandbox_host_uid) as fx:
        outcomes, _, facts = run_real(
            backend, settings, fx, image=image, runtime=runtime, isolation=isolation
        )  # fmt: skip
        report.outcomes = outcomes
        report.facts = facts
        if controls:
            got = run_weak_controls(
                fx,
                image,
                uid=settings.sandbox_uid,
                mapped_uid=settings.sandbox_host_uid,
                settings=settings,
            )
            # The exec-level controls need `podman exec -t` / `--preserve-fds`: they prove
            # the probe program, so a hardened podman sandbox of its own serves any backend.
            got += _exec_controls_on_podman(settings, fx, image)
            got.append(stall_control())
            got.append(
                shared_range_control(
                    settings, image, real_spec(fx, settings, image, "runc", "standard")
                )
            )
            order = {p.id: i for i, p in enumerate(PROBES)}
            report.controls = sorted(got, key=lambda o: order.get(o.id, 999))
