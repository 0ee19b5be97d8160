"""``agentbox publish ID [--branch NAME]``: put a finished task's kept result on a branch.

For a ``--no-publish`` task, or one whose ``agentbox/<id>`` was refused at the
end of the task (the user had a branch of that name, or had it checked out).
Never overwrites a ref agentbox did not write: a refusal exits 3 with the
reason, and nothing in the repo changes.
"""

from __future__ import annotations

import json

import typer
from rich.text import Text

from agentbox.config import load_settings
from agentbox.core.console import console as make_console

__all__ = ["register"]

_out = make_console()


def register(app: typer.Typer) -> None:
    """Add ``agentbox publish`` to the CLI."""

    @app.command("publish")
    def publish(
        task_id: str = typer.Argument(..., help="The finished task whose result to publish."),
        branch: str | None = typer.Option(
            None, "--branch", help="Branch to create in the task's repo (default agentbox/ID)."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the task as JSON."),
    ) -> None:
        """Publish a finished task's result into its repo as a new branch."""
        from agentbox.core.paths import validate_task_id
        from agentbox.launcher import Launcher

        launcher = Launcher(load_settings(), max_tasks=1)
        try:
            info = launcher.publish(validate_task_id(task_id), branch=branch)
        finally:
            launcher.close()
        if as_json:
            print(json.dumps(info.model_dump(mode="json")))
            return
        # The repo path and branch came from a request: printed as text, never as markup.
        _out.print(Text(f"published {info.branch} in {info.repo}"), highlight=False)
