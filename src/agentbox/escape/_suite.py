"""The suite's entry point: one backend/runtime, optionally with its positive controls."""

from __future__ import annotations

import time

from agentbox._log import get_logger
from agentbox.backends.base import Backend, Sandbox
from agentbox.config import Settings
from agentbox.errors import UnsupportedError
from agentbox.escape._controls import exec_controls, run_weak_controls, stall_control
from agentbox.escape._fixtures import Fixture
from agentbox.escape._model import Outcome, Report
from agentbox.escape._registry import PROBES
from agentbox.escape._runner import run_real

__all__ = ["run_suite"]

log = get_logger("escape")


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
    with Fixture(uid=settings.sandbox_host_uid) as fx:

        def during(box: Sandbox) -> list[Outcome]:
            if not controls:
                return []
            if backend.name != "podman":
                raise UnsupportedError(
                    f"exec controls need a podman sandbox, not {backend.name}",
                    fix="run --controls with --backend podman",
                )
            return exec_controls(box.name, settings.sandbox_uid)

        outcomes, extra, facts = run_real(
            backend, settings, fx, image=image, runtime=runtime, isolation=isolation,
            during=during,
        )  # fmt: skip
        report.outcomes = outcomes
        report.facts = facts
        if controls:
            got = run_weak_controls(
                fx, image, uid=settings.sandbox_uid, mapped_uid=settings.sandbox_host_uid
            )
            got += extra
            got.append(stall_control())
            order = {p.id: i for i, p in enumerate(PROBES)}
            report.controls = sorted(got, key=lambda o: order.get(o.id, 999))
    report.seconds = time.monotonic() - t0
    return report
