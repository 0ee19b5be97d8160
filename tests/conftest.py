"""Shared fixtures: a scrubbed environment, settings in a temp data dir, facility skips.

A test marked ``podman``/``qemu``/``claude``/``kvm`` skips with the reason the
probe gave when the facility is missing. ``AGENTBOX_REQUIRE=podman,claude``
(set by ``scripts/test.sh`` on machines where they must exist) turns such a
skip into an error for the whole run, so security tests never skip silently where they matter.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox import _host
from agentbox.config import Settings

_KEEP_ENV = {"PATH", "HOME", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER", "LOGNAME"}


def _required() -> set[str]:
    return {x for x in os.environ.get("AGENTBOX_REQUIRE", "").split(",") if x}


def _facility(marker: str) -> _host.Facility | None:
    if marker == "podman":
        return _host.podman()
    if marker == "qemu":
        return _host.qemu()
    if marker == "claude":
        return _host.claude_code(Settings().claude_binary)
    if marker == "firecracker":
        from agentbox.backends.firecracker import facility

        return facility(Settings())
    if marker == "docker":
        from agentbox.backends.docker._facility import facility as docker_facility

        return docker_facility(Settings())
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    required = _required()
    missing: list[str] = []
    for item in items:
        for marker in ("podman", "qemu", "claude", "firecracker", "docker"):
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
