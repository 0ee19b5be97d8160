"""Results as pull requests: which forge a remote is on, the push, and the request.

``agentbox publish ID --push [--remote R] [--pr] [--draft]`` (and ``run --pr``,
MCP ``publish(task_id, pr=true)``, ``batch run --pr``) pushes the task's result
branch to the repo's remote as the repo's owner (:func:`push_result`: hooks off,
never force) and opens a pull request on GitHub or GitLab (:func:`open_pull_request`)
whose body is the task's report (:func:`pr_body`). The forge and repo come from
the remote's URL (:func:`parse_remote`); the token from the user's
``agentbox secret`` (``GITHUB_TOKEN`` / ``GITLAB_TOKEN``) or the environment of
the user running ``publish`` (:func:`forge_token`).
"""

from __future__ import annotations

from agentbox.forge._body import MAX_BODY, pr_body, pr_title
from agentbox.forge._clients import PullRequest, open_pull_request
from agentbox.forge._flow import Shipped, ship
from agentbox.forge._push import check_remote, push_result, remote_url
from agentbox.forge._remote import ForgeRepo, parse_remote
from agentbox.forge._token import TOKEN_NAMES, forge_token

__all__ = [
    "MAX_BODY",
    "TOKEN_NAMES",
    "ForgeRepo",
    "PullRequest",
    "Shipped",
    "check_remote",
    "forge_token",
    "open_pull_request",
    "parse_remote",
    "pr_body",
    "pr_title",
    "push_result",
    "remote_url",
    "ship",
]
