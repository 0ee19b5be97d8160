"""One push-and-pull-request flow for every front end: ``publish --push/--pr``, ``run --pr``,
MCP ``publish(pr=true)`` (through the launcher) and ``batch run --pr`` (the driver)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.collect import RepoDir, user_git
from agentbox.config import Settings
from agentbox.errors import PublishRefused
from agentbox.forge._body import pr_body, pr_title
from agentbox.forge._clients import PullRequest, open_pull_request
from agentbox.forge._push import push_result, remote_url
from agentbox.forge._remote import parse_remote
from agentbox.forge._token import forge_token


@dataclass(frozen=True)
class Shipped:
    """What :func:`ship` did: the remote's URL, whether it pushed, the pull request."""

    remote_url: str
    pushed: bool
    pull_request: PullRequest | None


def ship(
    settings: Settings,
    repo: Path,
    *,
    task_id: str,
    task: str,
    branch: str,
    commit: str,
    report: Mapping[str, Any],
    remote: str = "origin",
    pr: bool = False,
    draft: bool = False,
    base: str | None = None,
    uid: int | None = None,
    env: Mapping[str, str] | None = None,
    root: Path | None = None,
) -> Shipped:
    """Push ``commit`` (already in ``repo``) to ``branch`` on ``remote`` as the repo's owner,
    and with ``pr`` open a pull request whose body is ``report``.

    With ``pr``, the forge (from the remote's URL) and the token (user ``uid``'s secret,
    default the repo's owner; else ``env``) are found before anything is pushed, so a
    remote on no forge or a missing token sends nothing.
    """
    with RepoDir.open(repo, root=root) as rd:
        if user_git(rd, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode:
            raise PublishRefused(
                f"the result {commit[:12]} is not in {repo}: publish it there first "
                f"(`agentbox publish {task_id} --branch NAME`)"
            )
        url = remote_url(rd, remote)
        target = token = None
        if pr:
            target = parse_remote(url, settings.forge_hosts)
            token = forge_token(target.kind, settings, uid=rd.owner[0] if uid is None else uid,
                                env=env)  # fmt: skip
        pushed = push_result(rd, remote=remote, branch=branch, commit=commit)
    if target is None or token is None:
        return Shipped(remote_url=url, pushed=pushed, pull_request=None)
    opened = open_pull_request(
        target, token, head=branch, base=base, draft=draft, title=pr_title(task, task_id),
        body=pr_body(report, task=task, task_id=task_id),
    )  # fmt: skip
    return Shipped(remote_url=url, pushed=pushed, pull_request=opened)
