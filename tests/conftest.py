"""Shared fixtures: a scrubbed environment, settings in a temp data dir, facility skips,
the leak guard of backend tests, and ResourceWarning strictness.

A test marked ``podman``/``qemu``/``claude``/``docker``/``gitlfs`` skips with the reason the
probe gave when the facility is missing. ``AGENTBOX_REQUIRE=podman,claude``
(set by ``scripts/test.sh`` on machines where they must exist) turns such a
skip into an error for the whole run, so security tests never skip silently where they matter.

``sandbox_factory`` (per test) and ``module_sandbox_factory`` (per module, for a
sandbox or launcher the module shares) make the
:class:`~sandbox_leaks.SandboxTracker` every backend test makes or registers its
sandboxes through: afterwards they assert that nothing of them survived
(process, cgroup, container, VM dir, socket, env fd; see
``tests/sandbox_leaks.py``), and on a failure :func:`pytest_runtest_makereport`
saves their posture and logs under ``$AGENTBOX_TEST_ARTIFACTS`` (default
``/var/tmp/agentbox-test-artifacts``).

``scripts/test.sh`` runs the suite on several xdist workers (one module per worker,
each with its own session: data dirs, task ids and sockets are per test or module),
then the tests in :data:`SERIAL`, :data:`SERIAL_DIRS` and :data:`SERIAL_TESTS` (marked
``serial``) alone: they sweep or count what is host-wide, and another worker's tasks
would make them (or be made by them) fail.

A leaked file, socket or subprocess pipe (``ResourceWarning``, or the
``PytestUnraisableExceptionWarning`` carrying one the garbage collector found) is
an error in every test module outside ``tests/unit/`` (which has its own
conftest) except those in :data:`LEAKY`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbox.backends import registry
from agentbox.backends.base import Backend
from agentbox.config import Settings
from agentbox.core import host as _host
from sandbox_leaks import SandboxTracker, active_trackers

_KEEP_ENV = {"PATH", "HOME", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER", "LOGNAME"}


def _required() -> set[str]:
    return {x for x in os.environ.get("AGENTBOX_REQUIRE", "").split(",") if x}


#: A test marked with a registered backend's name needs that backend's facility.
_BACKEND_MARKERS = tuple(r.name for r in registry.REGISTERED if r.probes)


def _facility(marker: str) -> _host.Facility | None:
    """The facility a marker needs: a registered backend's own probe, or a tool's."""
    if registry.entry(marker) is not None:
        return registry.facility(marker, Settings())
    if marker == "claude":
        return _host.claude_code(Settings().claude_binary)
    if marker == "gitlfs":
        found = shutil.which("git-lfs")
        return _host.Facility(
            "git-lfs", found is not None, found or "not on PATH", "apt-get install git-lfs"
        )
    if marker == "chromium":
        got = [p for p in ("/usr/bin/chromium", "/usr/bin/chromedriver") if Path(p).exists()]
        return _host.Facility(
            "chromium", len(got) == 2, ", ".join(got) or "not installed",
            "apt-get install chromium chromium-driver",
        )  # fmt: skip
    return None


_STRICT = (
    pytest.mark.filterwarnings("error::ResourceWarning"),
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
)
#: A LEAKY module's leaks are shown and counted (:func:`pytest_terminal_summary`), not errors.
_LENIENT = (
    pytest.mark.filterwarnings("always::ResourceWarning"),
    pytest.mark.filterwarnings("always::pytest.PytestUnraisableExceptionWarning"),
)
_TESTS = Path(__file__).resolve().parent

#: Test modules (outside ``tests/unit/``) not yet run clean under
#: ``-W error::ResourceWarning -W error::pytest.PytestUnraisableExceptionWarning``;
#: this may only shrink (``tests/unit/test_leak_guard_coverage.py``). A module not
#: listed is strict: a leak fails the test that made it. The garbage of a listed
#: module is collected (ignored) after each of its tests, so it cannot fail the next.
LEAKY: set[str] = set()


#: LEAKY modules that ran, and those of them that leaked this session.
_leaky_ran: set[str] = set()
_leaked: set[str] = set()
#: Tests whose leaks were shown rather than raised (found by the collector, or LEAKY).
_collected: set[str] = set()


def pytest_warning_recorded(
    warning_message: warnings.WarningMessage, when: str, nodeid: str, location: object
) -> None:
    del when, location
    if issubclass(
        warning_message.category, ResourceWarning | pytest.PytestUnraisableExceptionWarning
    ):
        module = nodeid.split("::", 1)[0].removeprefix("tests/")
        if module in LEAKY:
            _leaked.add(module)
        _collected.add(nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The tests whose leaks were shown (not errors); which LEAKY modules leaked this run,
    and which ran clean (candidates to make strict)."""
    if _collected:
        terminalreporter.write_sep("-", "leaks shown, not raised (tests/conftest.py)")
        for nodeid in sorted(_collected):
            terminalreporter.write_line(nodeid)
    if not _leaky_ran:
        return
    clean = sorted(_leaky_ran - _leaked)
    terminalreporter.write_sep("-", "LEAKY modules (tests/conftest.py)")
    terminalreporter.write_line(f"leaked this run ({len(_leaked)}): {sorted(_leaked)}")
    terminalreporter.write_line(f"ran without a leak ({len(clean)}): {clean}")


def _rel(item: pytest.Item) -> str:
    with contextlib.suppress(ValueError):
        return Path(item.path).resolve().relative_to(_TESTS).as_posix()
    return ""


def _leaky(item: pytest.Item) -> bool:
    return _rel(item) in LEAKY


#: What must not run beside other tests (``serial``), decided test by test from the code:
#: a sweep of every dead owner's sandboxes on the host (the podman and docker
#: ``cleanup_orphans`` verbs: another worker's test may hold a sandbox whose owner it
#: killed on purpose and will recover), a count or limit of what is host-wide (kernel
#: quotas, inotify, every Ray process of the node user), a probe another VMM on the host
#: disturbs (``doctor``'s KVM probe), or the default data dir (the tutorials run verbatim).
#: The escape suite probes host-wide quotas. Everything else keeps to its own data dir,
#: task ids, sandbox names and labels (the launcher's own orphan sweep and a microVM's
#: are per data dir), and runs on the xdist workers.
SERIAL_DIRS = ("escape/",)
#: Whole modules.
SERIAL: set[str] = {
    "integration/test_image_doctor.py",  # the KVM probe fails while another QEMU runs
    "integration/test_podman_kernel_quotas.py",
    "integration/test_userns_hook_cost.py",
    "integration/test_userns_limits.py",
    "e2e/test_tutorials.py",
}
#: Single tests (``module::function``, every parametrization): the first four call a
#: backend's host-wide ``cleanup_orphans``; the fifth races a launcher's restart against a
#: waiter's 10 s patience (``START_AFTER``), which a loaded worker loses; the last
#: restarts the host's dockerd.
SERIAL_TESTS: set[str] = {
    "integration/test_detached_podman.py"
    "::test_an_orphan_sweep_never_settles_the_disk_of_a_running_detached_sandbox",
    "integration/test_docker_backend.py::test_orphans_are_removed_and_live_ones_kept",
    "integration/test_podman.py::test_cleanup_orphans_removes_sandboxes_whose_owner_died",
    "integration/test_podman_env.py::test_a_sigkilled_podman_caller_leaves_no_env_on_disk",
    "e2e/test_detach_resume.py::test_wait_rides_through_a_launcher_restart",
    # checks that no loop device holds its disk: a podman conmon another worker starts
    # while the disk is mounted can hold it (mount propagation into conmon's namespace)
    "e2e/test_run_disk_limit.py::test_a_task_that_fills_its_disk_is_still_collected",
    # restarts the host's one dockerd: every other docker test would lose its daemon
    "e2e/test_live_restore_docker.py::test_a_dockerd_restart_with_live_restore_loses_no_task",
}


def _serial(items: list[pytest.Item]) -> None:
    for item in items:
        rel = _rel(item)
        name = getattr(item, "originalname", item.name)
        if rel in SERIAL or rel.startswith(SERIAL_DIRS) or f"{rel}::{name}" in SERIAL_TESTS:
            item.add_marker(pytest.mark.serial)


def _strictness(items: list[pytest.Item]) -> None:
    for item in items:
        rel = _rel(item)
        if rel.startswith("unit/"):
            continue  # tests/unit/conftest.py: strict except its own LEAKY
        for mark in _LENIENT if rel in LEAKY else _STRICT:
            item.add_marker(mark)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _strictness(items)
    _serial(items)
    _slow_modules_first(items)
    required = _required()
    missing: list[str] = []
    for item in items:
        for marker in (*_BACKEND_MARKERS, "claude", "gitlfs"):
            if item.get_closest_marker(marker) is None:
                continue
            fac = _facility(marker)
            if fac is not None and not fac.ok:
                reason = f"{fac.name}: {fac.detail} (fix: {fac.fix})"
                if marker in required:
                    missing.append(reason)
                item.add_marker(pytest.mark.skip(reason=reason))
    if missing:
        raise pytest.UsageError(
            "facilities required on this machine (AGENTBOX_REQUIRE) are missing: "
            + "; ".join(sorted(set(missing)))
        )


#: The longest modules of the parallel pass, longest first (CI's durations, 2026-12-07).
HEAVIEST = (
    "integration/test_owner_signals.py",
    "e2e/test_live_restore.py",
    "e2e/test_env_backends.py",
    "integration/test_image_containerfile.py",
    "integration/test_cluster_ray.py",
    "e2e/test_private_credentials.py",
    "e2e/test_env_node.py",
    "e2e/test_env_python.py",
    "integration/test_qemu_backend.py",
    "e2e/test_live_restore_qemu.py",
    "e2e/test_run_restart.py",
    "e2e/test_live_restore_docker.py",
    "e2e/test_run_qemu.py",
    "e2e/test_attempts.py",
)

#: Modules that share something host-wide with each other and with nothing else: one
#: xdist work unit per group, so they run one after another on one worker while the rest
#: of the parallel pass goes on (test_cluster_ray stops every Ray process of the node
#: user at its end; the Ray tutorial runs in the serial pass).
TOGETHER: dict[str, str] = {
    "integration/test_cluster_ray.py": "ray",
    "integration/test_cluster_ray_tls.py": "ray",
}


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` as ``scripts/test.sh`` wants it: work units in the collection
    order (:func:`_slow_modules_first`; xdist's default re-sorts them by their number of
    tests, which put the few-test, ten-minute modules last), the :data:`TOGETHER` groups
    as one unit each, and a worker given its next unit only when its last test is the one
    left (xdist's default asks at two, so a worker on a two-test heavy module took a second
    heavy module while another worker went idle)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Modules(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = str(super()._split_scope(nodeid))
            return TOGETHER.get(module.removeprefix("tests/"), module)

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            # One pending test is the one a worker holds until it learns what comes next.
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

    config.option.loadscopereorder = False
    return Modules(config, log)


def _slow_modules_first(items: list[pytest.Item]) -> None:
    """The :data:`HEAVIEST` modules go first, then those with a test marked ``slow``, then
    the rest, each in its order: xdist (``--dist loadfile``) hands out whole modules in this
    order, so a ten-minute module starts at once rather than on a worker that is already
    busy at the end of the pass."""
    slow = {_rel(i) for i in items if i.get_closest_marker("slow") is not None}

    def rank(item: pytest.Item) -> tuple[int, bool]:
        rel = _rel(item)
        heavy = HEAVIEST.index(rel) if rel in HEAVIEST else len(HEAVIEST)
        return heavy, rel not in slow

    items.sort(key=rank)  # stable: the order within stays


@pytest.fixture(autouse=True)
def _scrub_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests see no credentials or agentbox settings from the developer's shell."""
    for key in list(os.environ):
        if key in _KEEP_ENV or key == "AGENTBOX_DATA_DIR" or key == "AGENTBOX_REQUIRE":
            continue
        if key.startswith(("AGENTBOX_", "ANTHROPIC_", "CLAUDE_")) or "TOKEN" in key or "KEY" in key:
            monkeypatch.delenv(key, raising=False)
    yield


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Settings with a private data dir and repos root under tmp_path."""
    (tmp_path / "data").mkdir()
    (tmp_path / "repos").mkdir()
    (tmp_path / "roots").mkdir()
    return Settings(
        data_dir=tmp_path / "data",
        repos_root=tmp_path / "repos",
        mount_roots=(tmp_path / "roots",),
    )


def _collect_ignoring_leaks() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


_last_module: list[str] = [""]


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Garbage left by earlier modules (a LEAKY one, or unit tests' fakes) is collected,
    # ignored, before a strict module's first test, so it cannot fail a test that did not leak.
    rel = _rel(item)
    if rel != _last_module[0]:
        _last_module[0] = rel
        if not rel.startswith("unit/"):
            _collect_ignoring_leaks()


def _collect_as_warnings() -> None:
    """Run the garbage collector and re-issue the warnings its finalizers raised (a leak
    found in a ``__del__`` cannot raise there) here: shown, in the summary and
    attributed to this test, not an error (leaks only the collector finds are being
    fixed; one the test drops itself is an error under its marks)."""
    found: list[Any] = []
    prev = sys.unraisablehook
    sys.unraisablehook = found.append
    try:
        gc.collect()
    finally:
        sys.unraisablehook = prev
    for unraisable in found:
        if isinstance(unraisable.exc_value, Warning):
            with warnings.catch_warnings():
                warnings.simplefilter("always", type(unraisable.exc_value))
                warnings.warn(unraisable.exc_value, stacklevel=1)
        else:
            prev(unraisable)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    # Once the test's fixtures are torn down: what the test left to the garbage collector
    # is found now and attributed to it (shown and counted), not raised in whichever
    # later test the collector happens to run in.
    if _rel(item).startswith("unit/"):
        return  # tests/unit/conftest.py
    if _leaky(item):
        _leaky_ran.add(_rel(item))
    _collect_as_warnings()


#: Where a failed backend test's sandbox posture and logs are saved.
ARTIFACTS = Path(os.environ.get("AGENTBOX_TEST_ARTIFACTS", "/var/tmp/agentbox-test-artifacts"))


def _tracking() -> Iterator[Callable[[Backend, Settings], SandboxTracker]]:
    made: list[SandboxTracker] = []

    def make(backend: Backend, settings: Settings) -> SandboxTracker:
        tracker = SandboxTracker(backend, settings)
        made.append(tracker)
        return tracker

    yield make
    try:
        for tracker in made:
            tracker.assert_clean()
    finally:
        for tracker in made:
            tracker.close()


@pytest.fixture
def sandbox_factory() -> Iterator[Callable[[Backend, Settings], SandboxTracker]]:
    """Make a :class:`~sandbox_leaks.SandboxTracker` for a backend; after the test, assert
    that no process, cgroup, container, VM dir, socket or env fd of its sandboxes remains."""
    yield from _tracking()


@pytest.fixture(scope="module")
def module_sandbox_factory() -> Iterator[Callable[[Backend, Settings], SandboxTracker]]:
    """:func:`sandbox_factory` for a module's shared sandboxes (or launcher): checked once
    the module is done with them."""
    yield from _tracking()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """On a failed test, save the posture, host pids and logs of its sandboxes."""
    rep = yield
    if rep.failed and call.when in ("setup", "call") and active_trackers():  # type: ignore[attr-defined]
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid)[-150:]
        into = ARTIFACTS / f"{safe}-{call.when}"
        saved: list[Path] = []
        for tracker in active_trackers():
            with contextlib.suppress(Exception):
                saved += tracker.save_artifacts(into)
        rep.sections.append(  # type: ignore[attr-defined]
            ("agentbox sandbox artifacts", f"{len(saved)} file(s) saved in {into}")
        )
    return rep  # type: ignore[no-any-return]
