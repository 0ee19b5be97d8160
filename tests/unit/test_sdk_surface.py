"""The SDK's public names on the root package (issue 29): there, and imported only when named."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import agentbox
before = sorted(m for m in sys.modules if m.startswith("agentbox.sdk") or m == "httpx")
from agentbox import AsyncClient, AsyncSandbox, Client, Sandbox
import agentbox.sdk as sdk
assert Sandbox is sdk.Sandbox and AsyncSandbox is sdk.AsyncSandbox
assert Client is sdk.Client and AsyncClient is sdk.AsyncClient
assert {"Sandbox", "AsyncSandbox", "Client", "AsyncClient"} <= set(agentbox.__all__)
assert {"Sandbox", "AsyncSandbox", "Client", "AsyncClient"} <= set(dir(agentbox))
print("BEFORE", *before)
"""


def test_import_agentbox_does_not_import_the_sdk() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["BEFORE"]  # nothing of the SDK (nor httpx) before it is named


def test_every_public_sdk_name_is_in_the_reference() -> None:
    """docs/reference/sdk.md names every name agentbox.sdk exports."""
    from pathlib import Path

    import agentbox.sdk as sdk

    doc = (Path(__file__).parents[2] / "docs" / "reference" / "sdk.md").read_text()
    missing = [name for name in sdk.__all__ if f"`{name}" not in doc and f" {name}" not in doc]
    assert missing == []
