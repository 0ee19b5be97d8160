"""Unit tests: a leaked file, socket or subprocess pipe fails the test that leaked it.

A ``ResourceWarning`` is an error here, and so is the
``PytestUnraisableExceptionWarning`` that carries it when the leak is only noticed
by the garbage collector (a ``__del__`` cannot raise).
"""

from __future__ import annotations

import gc
import warnings

import pytest

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
