"""Integration fixtures shared by every area.

``default_image`` calls :func:`agentbox.image.build_default`, which is cached by
content hash: seconds when nothing changed, a full build otherwise. Tests that
use it must be marked ``podman``.

``sandbox_factory`` and ``module_sandbox_factory`` (the leak guard every backend
test makes its sandboxes through) live in ``tests/conftest.py``, so e2e sees them.

The sandbox fixtures give each test settings whose data dir and mount root
live under a 0711 scratch root, because runsc's gofer opens bind-mount
sources as the mapped container root (host uid ``subid_base``), not as root.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentbox.backends.base import Backend
from agentbox.config import Settings
from agentbox.core import host as _host
from sandbox_leaks import SandboxTracker

#: OCI runtimes podman can use on this host (crun is refused on cgroups v1/hybrid).
PODMAN_RUNTIMES = [rt for rt in ("runc", "crun", "runsc") if _host.podman_runtime(rt).ok]


@pytest.fixture(scope="session")
def default_image() -> str:
    """The default sandbox image's name in podman storage (built or found in the cache)."""
    from agentbox.image import build_default

    return build_default(Settings()).name


@pytest.fixture(scope="session")
def sandbox_root() -> Iterator[Path]:
    """A scratch root every sandbox id can traverse (0711)."""
    root = Path(tempfile.mkdtemp(prefix="agentbox-it-", dir="/var/tmp"))
    root.chmod(0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def new_settings(root: Path) -> Settings:
    """Settings with a fresh data dir, repos root and mount root under ``root``."""
    base = Path(tempfile.mkdtemp(dir=root))
    base.chmod(0o711)
    for sub in ("data", "roots", "repos"):
        (base / sub).mkdir()
        (base / sub).chmod(0o711)
    return Settings(
        data_dir=base / "data", repos_root=base / "repos", mount_roots=(base / "roots",)
    )


def new_workspace(settings: Settings) -> Path:
    """A workspace dir owned by the sandbox identity (host uid subid_base + 64000)."""
    ws = Path(tempfile.mkdtemp(prefix="ws-", dir=settings.data_dir))
    ws.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(ws, settings.sandbox_host_uid, settings.sandbox_host_uid)
    return ws


@pytest.fixture
def podman_boxes(
    sandbox_settings: Settings,
    sandbox_factory: Callable[[Backend, Settings], SandboxTracker],
) -> SandboxTracker:
    """A podman backend on :func:`sandbox_settings` behind the leak guard: nothing of a
    sandbox it made may remain after the test."""
    from agentbox.backends.podman import PodmanBackend

    return sandbox_factory(PodmanBackend(sandbox_settings), sandbox_settings)


@pytest.fixture
def sandbox_settings(sandbox_root: Path) -> Settings:
    """Settings whose data dir and mount root live under :func:`sandbox_root`."""
    return new_settings(sandbox_root)


@pytest.fixture
def make_workspace(sandbox_settings: Settings) -> Callable[[], Path]:
    """Make workspaces owned by the sandbox identity under ``sandbox_settings.data_dir``."""
    return lambda: new_workspace(sandbox_settings)


@pytest.fixture(scope="session")
def settings_factory(sandbox_root: Path) -> Callable[[], Settings]:
    """Session-scoped maker of :func:`new_settings` (for module-scoped sandboxes)."""
    return lambda: new_settings(sandbox_root)


@pytest.fixture(scope="session")
def workspace_factory() -> Callable[[Settings], Path]:
    """Session-scoped :func:`new_workspace`."""
    return new_workspace
