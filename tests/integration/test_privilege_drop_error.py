"""A failed privilege drop is one error, :class:`~agentbox.errors.PrivilegeDropError`,
whichever process drops: the gateway (and the egress proxy, which uses its drop) or
the MCP server. Each drop is run in a child process: a drop cannot be undone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the drops start as root")


def _child(code: str) -> str:
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_the_mcp_servers_drop_without_an_identity_is_a_privilege_drop_error() -> None:
    out = _child(
        "from agentbox.mcp import drop_privileges\n"
        "try:\n    drop_privileges(None)\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    assert out.startswith("PrivilegeDropError started as root without an identity"), out


def test_a_gateway_drop_that_did_not_take_is_a_privilege_drop_error() -> None:
    # setuid refused silently (as a seccomp filter returning 0 would): the check after it
    # sees root still and refuses to go on.
    out = _child(
        "import os\n"
        "from agentbox.linux.privdrop import drop_to\n"
        "os.setresuid = lambda *uids: None\n"
        "try:\n    drop_to(65534, 65534)\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    assert out.startswith("PrivilegeDropError privilege drop did not take"), out
