"""What a foreground ``agentbox run`` imports and builds before its task is recorded
(issue 15: ~0.5 s of imports before the sandbox could start).

A real process imports the modules a run holds by then (the CLI command, the
in-process launcher and its runner) and reports what it found: the egress proxy's
side (h11, the asyncio proxy) is not imported, and the pydantic models a run never
uses are not built yet (``defer_build``). Each still works on first use.
"""

from __future__ import annotations

import json
import subprocess
import sys

#: The modules a foreground run has imported when its task is recorded.
RUN_CHAIN = (
    "agentbox.cli",
    "agentbox.core.log",
    "agentbox.cli._run",
    "agentbox.cli._client",
    "agentbox.cli.reap",
    "agentbox.launcher._core",
    "agentbox.launcher._runner",
)

#: Models no plain run validates: built when first used, not at import.
DEFERRED = (
    "agentbox.boxfile._sections.Mount",
    "agentbox.boxfile._sections.Setup",
    "agentbox.boxfile._sections.NetworkPolicy",
    "agentbox.boxfile._sections.ImageBuild",
    "agentbox.transcript._model.TurnTokens",
    "agentbox.transcript._model.TestCommand",
    "agentbox.transcript._model.Transcript",
    "agentbox.transcript._model.TranscriptPage",
    "agentbox.collect._model.Skipped",
    "agentbox.collect.report.Flagged",
    "agentbox.egress._policy.AllowRule",
    "agentbox.egress._policy.Verdict",
    "agentbox.egress._policy.EgressPolicy",
    "agentbox.egress._record.HostSummary",
    "agentbox.egress._record.EgressSummary",
    "agentbox.env._model.EnvInfo",
    "agentbox.env._model.SetupReport",
    "agentbox.launcher.api.TaskList",
    "agentbox.launcher.api.ModelInfo",
    "agentbox.launcher.api.ModelList",
)

_PROBE = """
import importlib, json, sys
for m in sys.argv[1].split(","):
    importlib.import_module(m)
built = {}
for path in sys.argv[2].split(","):
    mod, _, cls = path.rpartition(".")
    built[path] = getattr(importlib.import_module(mod), cls).__pydantic_complete__
print(json.dumps({"modules": sorted(sys.modules), "built": built}))
"""


def _probe() -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(RUN_CHAIN), ",".join(DEFERRED)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    got: dict[str, object] = json.loads(out.stdout)
    return got


def test_a_run_imports_no_egress_proxy_and_builds_no_unused_model() -> None:
    got = _probe()
    mods = set(got["modules"])  # type: ignore[arg-type]
    assert "agentbox.launcher._runner" in mods and "agentbox.egress" in mods  # the control
    proxy = sorted(
        m for m in mods if m in ("h11", "agentbox.egress._process", "agentbox.egress._proxy")
    )
    assert proxy == []
    built = got["built"]
    assert isinstance(built, dict)
    assert sorted(k for k, v in built.items() if v) == []


def test_the_deferred_parts_work_on_first_use() -> None:
    import agentbox.egress as egress
    from agentbox.egress import _process
    from agentbox.launcher.api import ModelInfo, ModelList

    assert egress.spawn_proxy is _process.spawn_proxy
    assert egress.ProxyHandle is _process.ProxyHandle
    info = ModelInfo(name="m", kind="replay", default=True)
    assert ModelList(models=[info]).models[0].name == "m"
    assert ModelInfo.__pydantic_complete__
