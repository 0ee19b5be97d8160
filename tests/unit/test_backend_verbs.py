"""Every backend answers the Protocol's by-name verbs, so callers never switch on its name.

The watchdog, a cancel and a restarted launcher's reconcile act on a sandbox by
name only (:func:`agentbox.launcher._watchdog.kill_sandbox` and ``reap_sandbox``
dispatch to ``Backend.kill``/``Backend.reap``); a backend without them would be
silently skipped, as firecracker once was.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbox.backends import BACKENDS, get_backend
from agentbox.backends.base import Backend
from agentbox.config import Settings


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_kills_and_reaps_by_name(name: str, tmp_path: Path) -> None:
    backend = get_backend(name, Settings(data_dir=tmp_path))
    assert isinstance(backend, Backend)
    for verb in ("kill", "reap", "cleanup_orphans"):
        assert callable(getattr(backend, verb, None)), f"{name} has no {verb}"


def test_watchdog_names_no_backend() -> None:
    """kill_sandbox and reap_sandbox dispatch: no backend name is spelled in them."""
    import inspect

    from agentbox.launcher import _watchdog

    src = inspect.getsource(_watchdog._act) + inspect.getsource(_watchdog.kill_sandbox)
    for name in BACKENDS:
        assert f'"{name}"' not in src
