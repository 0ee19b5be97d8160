"""Unit tests: pure, and a leaked file, socket or subprocess pipe fails the test.

Pure: no root, no sandbox, no service. A unit test that starts a container runtime,
a VMM or an agentbox service process (:data:`SANDBOX_PROGRAMS`, :data:`SERVICES`)
fails at that spawn: it belongs in ``tests/integration`` (``scripts/test.sh --fast``
runs this tier alone, in parallel, as any user). ``test_unit_tier_pure.py`` refuses
a unit module that skips unless root.

A ``ResourceWarning`` is an error here, and so is the
``PytestUnraisableExceptionWarning`` that carries it when the leak is only noticed
by the garbage collector (a ``__del__`` cannot raise).
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: Programs a unit test may not start: container runtimes, VMMs, what sets up sandboxes.
SANDBOX_PROGRAMS = frozenset({
    "podman", "docker", "dockerd", "conmon", "runc", "crun", "runsc", "firecracker",
    "jailer", "mmdebstrap", "nsenter", "unshare", "setpriv", "runuser", "sudo", "su",
    "mount", "umount", "losetup", "ip", "iptables", "nft", "ray", "claude",
})  # fmt: skip
_TMP = Path(tempfile.gettempdir()).resolve()
#: ``python -m`` modules that are agentbox's services (a gateway, the launcher, MCP).
SERVICES = ("agentbox.gateway", "agentbox.launcher", "agentbox.mcp")


def _impure(args: Any, env: Any) -> str | None:
    argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
    if not argv:
        return None
    prog = os.path.basename(os.fsdecode(argv[0]))
    if prog in SANDBOX_PROGRAMS or prog.startswith("qemu-system"):
        # A stand-in of the test's own (a script named podman in its tmp_path) is fine.
        path = (env or os.environ).get("PATH") if isinstance(env, dict) else None
        found = shutil.which(os.fsdecode(argv[0]), path=path)
        if found is None or not Path(found).parent.resolve().is_relative_to(_TMP):
            return prog
    words = [os.fsdecode(a) for a in argv if isinstance(a, str | bytes | os.PathLike)]
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1].startswith(SERVICES):
            return f"python -m {words[i + 1]}"
    return None


@pytest.fixture(autouse=True)
def _pure(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a unit test at the moment it starts a sandbox program or service."""
    if "/tests/unit/" not in str(request.node.path):
        yield
        return
    real = subprocess.Popen.__init__

    def init(self: subprocess.Popen[Any], args: Any, *a: Any, **kw: Any) -> None:
        what = _impure(args, kw.get("env"))
        if what is not None:
            pytest.fail(
                f"a unit test started {what}: unit tests are pure (no sandbox, no service,"
                " no root); move it to tests/integration",
                pytrace=False,
            )
        real(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", init)
    yield


_STRICT = (
    pytest.mark.filterwarnings("error::ResourceWarning"),
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
)

#: Modules whose leaks are known and not fixed yet, with why; this may only shrink.
#: Their leftovers are collected (ignored) after each of their tests, so they
#: cannot fail the next test instead.
LEAKY: set[str] = set()


def _leaky(item: pytest.Item) -> bool:
    return any(str(item.path).endswith(m) for m in LEAKY)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/tests/unit/" in str(item.path) and not _leaky(item):
            for mark in _STRICT:
                item.add_marker(mark)


_last_module: list[str] = [""]


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Garbage of the tests that ran before this module (integration, e2e: real fixtures
    # whose leaks are not errors there) is collected, ignored, before the module's first
    # test: a cycle the collector frees later must not fail a unit test that did not leak.
    module = str(item.path)
    if "/tests/unit/" in module and module != _last_module[0]:
        _last_module[0] = module
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _leaky(item):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
