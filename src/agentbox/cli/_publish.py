"""``agentbox publish ID [--branch NAME] [--push [--remote R]] [--pr [--draft] [--base B]]``.

Puts a finished task's kept result on a branch of its repo; ``--push`` pushes that
branch to the repo's remote as the repo's owner (hooks off, never force), and
``--pr`` (implies ``--push``) opens a pull request on GitHub or GitLab whose body is
the task's report (:mod:`agentbox.forge`).

For a ``--no-publish`` task, or one whose ``agentbox/<id>`` was refused at the
end of the task (the user had a branch of that name, or had it checked out).
Never overwrites a ref agentbox did not write: a refusal exits 3 with the
reason, and nothing in the repo changes.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer
from rich.text import Text

from agentbox.config import load_settings
from agentbox.core.console import console as make_console

if TYPE_CHECKING:
    from agentbox.launcher.pushapi import PushInfo

_out = make_console()


def print_push(pushed: PushInfo) -> None:
    """Where the branch went, and the pull request (``publish --push/--pr``, ``run --pr``)."""
    how = "pushed" if pushed.pushed else "already on"
    _out.print(Text(f"{how} {pushed.branch} {'to ' if pushed.pushed else ''}"
                    f"{pushed.remote} ({pushed.remote_url})"), highlight=False)  # fmt: skip
    if pushed.pull_request:
        state = "already open" if pushed.existed else "opened"
        _out.print(Text(f"pull request {state}: {pushed.pull_request}"), highlight=False)


def register(app: typer.Typer) -> None:
    """Add ``agentbox publish`` to the CLI."""

    @app.command("publish")
    def publish(
        task_id: str = typer.Argument(..., help="The finished task whose result to publish."),
        branch: str | None = typer.Option(
            None, "--branch", help="Branch to create in the task's repo (default agentbox/ID)."
        ),
        push: bool = typer.Option(
            False, "--push", help="Also push the branch to the repo's remote (never by force)."
        ),
        remote: str = typer.Option("origin", "--remote", help="The remote to push to."),
        pr: bool = typer.Option(
            False, "--pr", help="Open a pull request on GitHub or GitLab (implies --push)."
        ),
        draft: bool = typer.Option(False, "--draft", help="Open the pull request as a draft."),
        base: str | None = typer.Option(
            None, "--base", help="The pull request's target branch (default: the repo's default)."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the task as JSON."),
        pick: int | None = typer.Option(
            None,
            "--pick",
            min=1,
            max=8,
            help="For a best-of-N GROUP: publish attempt K as agentbox/GROUP "
            "(default: the group's pick).",
        ),
    ) -> None:
        """Publish a finished task's result into its repo as a new branch; push it, open a PR.

        For a best-of-N GROUP: its pick (or attempt --pick K) as agentbox/GROUP."""
        import os

        from agentbox.core.paths import validate_task_id
        from agentbox.launcher import Launcher
        from agentbox.launcher.attempts import group_of

        if pick is not None or group_of(task_id) is None:
            from agentbox.cli._client import in_process

            probe = in_process(1)
            try:
                is_group = not probe.store.exists(task_id) and bool(probe.store.group(task_id))
            finally:
                probe.close()
            if is_group:
                if push or pr or branch:
                    raise typer.BadParameter(
                        "a group's pick is published as agentbox/GROUP; push that branch with "
                        "`agentbox publish GROUP-aK --push` (K: the pick)"
                    )
                from agentbox.cli._attempts import publish_group

                publish_group(validate_task_id(task_id), pick, pick_by="tests", as_json=as_json)
                return
            if pick is not None:
                raise typer.BadParameter(
                    f"{task_id} is not a group of attempts", param_hint="--pick"
                )

        if (draft or base) and not pr:
            raise typer.BadParameter("--draft and --base go with --pr")
        launcher = Launcher(load_settings(), max_tasks=1)
        try:
            if push or pr:
                from agentbox.launcher.pushapi import PushRequest

                req = PushRequest(remote=remote, branch=branch, pr=pr, draft=draft, base=base)
                pushed = launcher.push(validate_task_id(task_id), req, env=dict(os.environ))
            else:
                info = launcher.publish(validate_task_id(task_id), branch=branch)
        finally:
            launcher.close()
        if push or pr:
            if as_json:
                print(json.dumps(pushed.model_dump(mode="json")))
                return
            print_push(pushed)
            return
        if as_json:
            print(json.dumps(info.model_dump(mode="json")))
            return
        # The repo path and branch came from a request: printed as text, never as markup.
        _out.print(Text(f"published {info.branch} in {info.repo}"), highlight=False)
