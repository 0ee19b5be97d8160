"""``agentbox diff ID [--stat]``, ``agentbox apply ID [--checkout]``: no raw git needed.

``diff`` prints the task's diff against its base: colored on a terminal, as git
printed it when piped (control characters made visible either way: the file
contents are the agent's). ``--stat`` prints changed lines per file.

``apply`` brings the result into the user's own branch, with git run as the repo's
owner (never root) with hooks off. It refuses, changing nothing, when the work
tree has uncommitted changes to tracked files; git itself refuses to overwrite an
untracked file. Default: the task's commits onto the current branch
(a fast-forward when the branch has not moved since, else a cherry-pick of the
task's commits; a conflict is aborted, the branch left as it was, and the files
named). ``--checkout``: check the branch ``agentbox/<id>`` out. A result not yet
on a branch (``--no-publish``) is published first as ``agentbox/<id>``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from agentbox.cli._client import in_process
from agentbox.cli._view import console, print_diff, print_flagged, safe
from agentbox.collect import user_git
from agentbox.errors import CommandError, PolicyRefused, RefusedError
from agentbox.launcher.api import TaskInfo
from agentbox.paths import validate_task_id

__all__ = ["diffstat", "register"]

_FILE = re.compile(r"^diff --git a/(.*) b/(.*)$")


def diffstat(diff: str) -> list[tuple[str, int, int]]:
    """(path, lines added, lines removed) per file of a unified git diff."""
    out: list[tuple[str, int, int]] = []
    header = False  # between "diff --git" and the first hunk: ---/+++ are names, not lines
    for line in diff.splitlines():
        m = _FILE.match(line)
        if m:
            out.append((m.group(2), 0, 0))
            header = True
        elif line.startswith("@@"):
            header = False
        elif out and not header and line.startswith("+"):
            out[-1] = (out[-1][0], out[-1][1] + 1, out[-1][2])
        elif out and not header and line.startswith("-"):
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
    return out


def register(app: typer.Typer) -> None:
    """Add ``diff`` and ``apply`` to the CLI."""

    @app.command("diff")
    def diff(
        task_id: Annotated[str, typer.Argument(help="A finished task.")],
        stat: bool = typer.Option(False, "--stat", help="Changed lines per file only."),
    ) -> None:
        """Print a finished task's diff (colored on a terminal, plain when piped)."""
        launcher = in_process(1)
        try:
            res = launcher.result(validate_task_id(task_id))
        finally:
            launcher.close(wait=False)
        if not stat:
            print_diff(res)
            return
        rows = diffstat(res.diff)
        for path, added, removed in rows:
            console.print(safe(f"{path} | +{added} -{removed}"), soft_wrap=True)
        total_a, total_r = sum(r[1] for r in rows), sum(r[2] for r in rows)
        console.print(f"{len(rows)} file(s) changed, {total_a} insertion(s), {total_r} deletion(s)")
        if res.diff_truncated:
            console.print(safe("(diff truncated: the counts cover its first part only)", "yellow"))

    @app.command("apply")
    def apply(
        task_id: Annotated[str, typer.Argument(help="A finished task with changes.")],
        checkout: bool = typer.Option(
            False, "--checkout", help="Check out agentbox/ID instead of applying onto HEAD."
        ),
    ) -> None:
        """Apply a task's result onto the current branch of its repo (or check it out).

        Refuses when tracked files have uncommitted changes, and on a conflict (aborted:
        the branch stays as it was). Never loses work.
        """
        launcher = in_process(1)
        try:
            tid = validate_task_id(task_id)
            info = launcher.get(tid)
            res = launcher.result(tid)
            if not res.changed or not res.commit:
                raise PolicyRefused(f"task {tid} has no changes to apply ({info.status})")
            if not info.branch:
                info = launcher.publish(tid)  # never overwrites a ref agentbox did not write
        finally:
            launcher.close(wait=False)
        print_flagged(res.report.get("flagged"))
        repo = Path(info.repo)
        _check_clean(repo)
        branch = info.branch or f"agentbox/{tid}"
        if checkout:
            _git(repo, "checkout", "--quiet", branch, "--")
            console.print(safe(f"checked out {branch} in {repo}"))
            return
        how = _apply_onto_head(repo, info, res.commit)
        console.print(safe(f"applied {branch} onto {_current(repo)} in {repo} ({how})"))


def _git(repo: Path, *args: str) -> str:
    try:
        return user_git(repo, *args).stdout
    except CommandError as exc:
        raise RefusedError(f"git {args[0]} failed in {repo}: {exc}") from exc


def _check_clean(repo: Path) -> None:
    """Refuse a repo with uncommitted changes to tracked files, or an operation in progress."""
    dirty = user_git(repo, "status", "--porcelain", "--untracked-files=no").stdout.splitlines()
    if dirty:
        shown = ", ".join(line[3:] for line in dirty[:5]) + (" …" if len(dirty) > 5 else "")
        raise PolicyRefused(f"{repo} has uncommitted changes ({shown}); commit or stash them first")
    gitdir = Path(user_git(repo, "rev-parse", "--absolute-git-dir").stdout.strip())
    for marker in ("MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD", "rebase-merge", "rebase-apply"):
        if (gitdir / marker).exists():
            raise PolicyRefused(
                f"{repo} is in the middle of a git operation ({marker}); end it first"
            )


def _current(repo: Path) -> str:
    name = user_git(repo, "rev-parse", "--abbrev-ref", "HEAD", check=False).stdout.strip()
    return name or "HEAD"


def _apply_onto_head(repo: Path, info: TaskInfo, commit: str) -> str:
    """A fast-forward when HEAD is an ancestor of the result, else a cherry-pick of the
    task's commits; a conflict is aborted and refused."""
    ff = user_git(repo, "merge-base", "--is-ancestor", "HEAD", commit, check=False)
    if ff.returncode == 0:
        _git(repo, "merge", "--ff-only", "--quiet", commit)
        return "fast-forward"
    base = user_git(repo, "merge-base", "HEAD", commit).stdout.strip()
    picked = user_git(
        repo, "-c", "user.name=agentbox", "-c", "user.email=agentbox@localhost",
        "cherry-pick", "--allow-empty", f"{base}..{commit}", check=False,
    )  # fmt: skip
    if picked.returncode == 0:
        return "cherry-picked"
    conflicts = user_git(repo, "diff", "--name-only", "--diff-filter=U", check=False).stdout
    user_git(repo, "cherry-pick", "--abort", check=False)
    names = ", ".join(conflicts.split()[:10]) or "see git"
    raise RefusedError(
        f"task {info.id}'s changes conflict with {_current(repo)} in {repo} ({names}); nothing "
        f"was changed. Check out agentbox/{info.id} instead (agentbox apply {info.id} --checkout)"
    )
