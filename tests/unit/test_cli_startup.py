"""The CLI stays light: heavy SDKs are imported by the commands that need them."""

from __future__ import annotations

import subprocess
import sys


def test_cli_import_does_not_pull_the_mcp_sdk() -> None:
    code = "import sys, agentbox.cli; print('mcp' in sys.modules, 'anthropic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_mcp_default_pinned() -> None:
    from agentbox.cli._mcp import DEFAULT_MAX_PENDING
    from agentbox.mcp._server import DEFAULT_MAX_PENDING as real

    assert real == DEFAULT_MAX_PENDING
