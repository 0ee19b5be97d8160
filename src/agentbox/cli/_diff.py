"""``agentbox diff ID [--stat]``, ``agentbox apply ID [--checkout]``: no raw git needed.

``diff`` prints the task's diff against its base: colored on a terminal, as git
printed it when piped (control characters made visible either way: the file
contents are the agent's). ``--stat`` prints changed lines per file.

``apply`` brings the result into the user's own branch, with git run as the repo's
owner (never root) with hooks off. It refuses, changing nothing, when the work
tree has uncommitted changes to tracked files, or when the result would overwrite
or delete an untracked or ignored file (``--overwrite-ignored`` allows it). git runs
sealed (:mod:`agentbox.collect._apply`): no filter, diff or merge driver of any
config runs on the agent's files, so an LFS pointer is written as the pointer file
and the host's git-lfs never starts. Default: the task's commits onto the current branch
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
from agentbox.core.paths import validate_task_id
from agentbox.errors import PolicyRefused

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
        files, total_a, total_r = len(rows), sum(r[1] for r in rows), sum(r[2] for r in rows)
        real = res.report.get("diffstat")
        if res.diff_truncated and isinstance(real, dict):
            # The totals collection counted over the whole result, not the diff's first part.
            files = int(real.get("files_changed") or 0)
            total_a, total_r = int(real.get("insertions") or 0), int(real.get("deletions") or 0)
            console.print(safe(f"(diff truncated: {len(rows)} of the {files} file(s) listed above; "
                               "the totals below are the whole result's)", "yellow"))  # fmt: skip
        console.print(f"{files} file(s) changed, {total_a} insertion(s), {total_r} deletion(s)")
        if res.diff_truncated and not isinstance(real, dict):
            console.print(safe("(diff truncated: the counts cover its first part only)", "yellow"))

    @app.command("apply")
    def apply(
        task_id: Annotated[str, typer.Argument(help="A finished task with changes.")],
        checkout: bool = typer.Option(
            False, "--checkout", help="Check out agentbox/ID instead of applying onto HEAD."
        ),
        overwrite_ignored: bool = typer.Option(
            False,
            "--overwrite-ignored",
            help="Let the result overwrite or delete ignored files (never untracked ones).",
        ),
    ) -> None:
        """Apply a task's result onto the current branch of its repo (or check it out).

        Refuses when tracked files have uncommitted changes, when the result would
        overwrite or delete untracked or ignored files (unless --overwrite-ignored), and
        on a conflict (aborted: the branch stays as it was). Never loses work.
        """
        from agentbox.collect import apply_result

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
        done = apply_result(repo, task_id=tid, branch=branch, commit=res.commit,
                            checkout=checkout, overwrite_ignored=overwrite_ignored)  # fmt: skip
        if done.how == "checked out":
            console.print(safe(f"checked out {branch} in {repo}"))
        else:
            console.print(safe(f"applied {branch} onto {_current(repo)} in {repo} ({done.how})"))
        if done.pointers:
            shown = ", ".join(done.pointers[:10]) + (" …" if len(done.pointers) > 10 else "")
            console.print(safe(
                f"{len(done.pointers)} Git LFS pointer file(s) written as they are, git-lfs not "
                f"run (fetch their content yourself if you trust the result): {shown}", "yellow",
            ))  # fmt: skip


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
