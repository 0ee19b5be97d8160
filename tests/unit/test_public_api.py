"""The public surface is pinned: adding to it is a decision, not an accident."""

from __future__ import annotations

import agentbox
import agentbox.errors as errors


def test_top_level_all() -> None:
    assert sorted(agentbox.__all__) == [
        "AgentboxError",
        "AsyncClient",
        "AsyncSandbox",
        "Boxfile",
        "Client",
        "Sandbox",
        "Settings",
        "__version__",
        "load_boxfile",
        "load_settings",
    ]
    for name in agentbox.__all__:
        assert hasattr(agentbox, name)


def test_every_error_is_rooted() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.AgentboxError), name


def test_errors_carry_what_failed() -> None:
    e = errors.CommandError(["podman", "run", "x"], 125, "Error: no such image\n")
    assert e.returncode == 125 and "no such image" in str(e) and "podman run x" in str(e)
    t = errors.TaskError("boom", task_id="t-1")
    assert t.task_id == "t-1" and "t-1" in str(t)
    b = errors.BoxfileError("unknown key", key="resources.gpus")
    assert b.key == "resources.gpus" and "resources.gpus" in str(b)
