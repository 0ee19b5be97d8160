"""``image_facts`` looks an image up once per process, and once at a time: a launch that
asks while the launcher's warm-up (Backend.warm) is still asking waits for that answer
instead of starting a second ``podman image inspect``. podman is a stand-in here (a
recorded, slow ``_proc.run``); the real lookup is exercised by every podman test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agentbox.backends.oci import _args as _oci_args
from agentbox.backends.podman import PodmanBackend
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.core.wait import wait_until
from agentbox.errors import CommandError


class _Inspect:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.fail = False

    def __call__(self, argv: list[str], **kw: Any) -> Any:
        self.calls.append(argv)
        time.sleep(0.3)  # a podman process
        if self.fail:
            raise CommandError(argv, 125, "", "Error: image not known")
        return type("Res", (), {"stdout": 'sha256:abc ["/usr/bin/tini","--"]\n'})()


@pytest.fixture
def inspect(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Inspect]:
    fake = _Inspect()
    monkeypatch.setattr(_proc, "run", fake)
    monkeypatch.setattr(_oci_args, "_facts", {})
    monkeypatch.setattr(_oci_args, "_lookups", {})
    # podman's image list as unchanged (another test's build would move the real one)
    monkeypatch.setattr(_oci_args, "store_signature", lambda: "unchanged")
    yield fake


def test_a_lookup_during_a_warm_up_waits_for_it_and_asks_podman_once(
    inspect: _Inspect, tmp_path: Any
) -> None:
    backend = PodmanBackend(Settings(data_dir=tmp_path))
    warm = threading.Thread(target=backend.warm, args=("localhost/img:1",))
    warm.start()
    wait_until(  # the warm-up is inside its podman call
        lambda: inspect.calls,
        timeout=30,
        on_timeout=lambda: AssertionError("the warm-up never asked podman"),
    )
    facts = _oci_args.image_facts("localhost/img:1")
    warm.join()
    assert len(inspect.calls) == 1, inspect.calls
    assert facts.id == "sha256:abc" and facts.has_tini
    # Cached for the process; a refresh asks again.
    assert _oci_args.image_facts("localhost/img:1") is facts
    _oci_args.image_facts("localhost/img:1", refresh=True)
    assert len(inspect.calls) == 2


def test_a_warm_up_of_a_missing_image_raises_nothing_and_the_launch_still_says_why(
    inspect: _Inspect, tmp_path: Any
) -> None:
    from agentbox.errors import ImageError

    inspect.fail = True
    PodmanBackend(Settings(data_dir=tmp_path)).warm("localhost/missing:1")
    with pytest.raises(ImageError, match="not in podman's local storage"):
        _oci_args.image_facts("localhost/missing:1")
    assert len(inspect.calls) == 2  # a failure is not cached
