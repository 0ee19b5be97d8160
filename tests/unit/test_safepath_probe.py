"""safepath.supported(): asking the kernel leaves no descriptor open."""

from __future__ import annotations

import os

import pytest

from agentbox.safepath import _openat2


def test_the_openat2_probe_closes_the_root_it_opens(monkeypatch: pytest.MonkeyPatch) -> None:
    before = set(os.listdir("/proc/self/fd"))
    for _ in range(5):
        monkeypatch.setattr(_openat2, "_supported", None)  # ask the kernel again
        _openat2.supported()
    leaked = set(os.listdir("/proc/self/fd")) - before
    assert not leaked, sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in leaked if fd.isdigit())
