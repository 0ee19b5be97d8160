"""``python -m agentbox.gateway …``: the ``agentbox gateway`` command alone, quick to start."""

from __future__ import annotations

import sys

import typer

from agentbox._log import configure
from agentbox.errors import AgentboxError, RefusedError
from agentbox.gateway._cli import gateway
from agentbox.gateway._logcap import cap_log


def main() -> None:
    """Run the gateway command; agentbox errors become one line on stderr and an exit code."""
    cap_log()  # before anything holds sys.stderr (structlog, uvicorn's handlers)
    configure()
    try:
        typer.run(gateway)
    except AgentboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(3 if isinstance(exc, RefusedError) else 1)


if __name__ == "__main__":
    main()
