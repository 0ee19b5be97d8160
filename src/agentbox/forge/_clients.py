"""Opening a pull request (GitHub) or merge request (GitLab) through each forge's client.

GitHub through PyGithub, GitLab through python-gitlab: each the forge's long-kept,
typed Python client (``py.typed``), so no request is written by hand here. Both
calls are idempotent: an open request from the same branch is returned, not
duplicated. The base branch defaults to the repo's default branch, as the
forge reports it. Tokens go to the client only; an error message never holds
one (:class:`~agentbox.errors.ForgeError` carries the status and the forge's
own message).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentbox.errors import ForgeError
from agentbox.forge._remote import ForgeRepo

#: Seconds a forge call may take before it is a ForgeError.
TIMEOUT = 30


@dataclass(frozen=True)
class PullRequest:
    """An open pull (merge) request: its web URL and number, and whether it already was."""

    url: str
    number: int
    existed: bool = False


def _scrub(text: str, token: str) -> str:
    return text.replace(token, "[token]") if token else text


def open_pull_request(
    repo: ForgeRepo,
    token: str,
    *,
    head: str,
    title: str,
    body: str,
    draft: bool = False,
    base: str | None = None,
) -> PullRequest:
    """Open a pull request from branch ``head`` (in the same repo) into ``base`` (default:
    the repo's default branch), or return the open one from ``head``."""
    try:
        if repo.kind == "github":
            return _github(repo, token, head, title, body, draft, base)
        return _gitlab(repo, token, head, title, body, draft, base)
    except ForgeError:
        raise
    except Exception as exc:  # the clients' own errors (HTTP, JSON, connection)
        status = getattr(exc, "status", None) or getattr(exc, "response_code", None)
        msg = _scrub(f"{type(exc).__name__}: {exc}", token)[:500]
        raise ForgeError(
            f"{repo.kind} ({repo.host}) refused or failed opening the pull request for "
            f"{repo.path}: {msg}",
            status=status if isinstance(status, int) else None,
        ) from None


def _github(
    repo: ForgeRepo, token: str, head: str, title: str, body: str, draft: bool, base: str | None
) -> PullRequest:
    from github import Auth, Github, GithubRetry

    gh = Github(
        auth=Auth.Token(token), base_url=repo.api_url, timeout=TIMEOUT,
        user_agent="agentbox", retry=GithubRetry(total=2), seconds_between_requests=None,
        seconds_between_writes=None,
    )  # fmt: skip
    try:
        r = gh.get_repo(repo.path)
        target = base or r.default_branch
        for pr in r.get_pulls(state="open", head=f"{repo.owner}:{head}", base=target):
            return PullRequest(url=pr.html_url, number=pr.number, existed=True)
        pr = r.create_pull(base=target, head=head, title=title, body=body, draft=draft)
        return PullRequest(url=pr.html_url, number=pr.number)
    finally:
        gh.close()


def _gitlab(
    repo: ForgeRepo, token: str, head: str, title: str, body: str, draft: bool, base: str | None
) -> PullRequest:
    import gitlab

    with gitlab.Gitlab(
        repo.api_url, private_token=token, timeout=TIMEOUT, retry_transient_errors=False,
        user_agent="agentbox",
    ) as gl:  # fmt: skip
        project = gl.projects.get(repo.path)
        target = base or str(project.default_branch)
        for mr in project.mergerequests.list(
            source_branch=head, target_branch=target, state="opened", get_all=False
        ):
            return PullRequest(url=str(mr.web_url), number=int(mr.iid), existed=True)
        # GitLab marks a draft by its title ("Draft: …"); the create call has no draft field.
        mr = project.mergerequests.create(
            {
                "source_branch": head,
                "target_branch": target,
                "title": f"Draft: {title}" if draft else title,
                "description": body,
                "remove_source_branch": False,
            }
        )
        return PullRequest(url=str(mr.web_url), number=int(mr.iid))
