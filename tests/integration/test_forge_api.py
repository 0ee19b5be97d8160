"""Opening pull requests through the forges' clients, against local servers that check each
request against the forge's published API description (tests/forge_servers.py).

GitHub's requests are validated with openapi-core against GitHub's own OpenAPI description
(``@octokit/openapi``); GitLab publishes none for merge requests, so its requests are
checked against the documented fields (cited in forge_servers.py).
"""

from __future__ import annotations

import pytest

from agentbox.errors import ForgeError
from agentbox.forge import ForgeRepo, open_pull_request, parse_remote, pr_body
from forge_servers import ForgeServer

TOKEN = "ghp_forgetest_0123456789abcdef"
REPORT = {
    "status": "done",
    "model": "replay-demo",
    "final_message": "Fixed the bug.\n@octocat <img src=x> ```` not a fence",
    "last_test_command": {"command": "pytest -q", "exit_code": 0},
    "tokens": {
        "input": 1200,
        "output": 340,
        "cache_creation": 0,
        "cache_read": 10,
        "cost_usd": 0.0123,
    },
    "diffstat": {"files_changed": 2, "insertions": 5, "deletions": 1},
    "flagged": [{"path": ".envrc", "change": "added", "reason": "direnv runs it"}],
}


def _github(server: ForgeServer) -> ForgeRepo:
    return parse_remote("git@github.com:octo/hello.git", [f"github.com=github:{server.url}"])


def test_github_pull_request_is_a_valid_create_call_and_is_not_duplicated() -> None:
    body = pr_body(REPORT, task="fix the bug", task_id="t-gh")
    with ForgeServer("github") as server:
        repo = _github(server)
        pr = open_pull_request(repo, TOKEN, head="agentbox/t-gh", title="fix [agentbox t-gh]",
                               body=body, draft=True)  # fmt: skip
        assert server.errors == []
        assert pr.url == "https://github.com/octo/hello/pull/1347" and not pr.existed
        create = [r for r in server.requests if r.method == "POST"]
        assert len(create) == 1
        assert create[0].path == "/repos/octo/hello/pulls"
        assert create[0].body == {
            "base": "main",
            "head": "agentbox/t-gh",
            "title": "fix [agentbox t-gh]",
            "body": body,
            "draft": True,
        }
        assert create[0].headers["authorization"] in (f"token {TOKEN}", f"Bearer {TOKEN}")
        # The base came from the repo's default branch, as GitHub reported it.
        assert any(r.method == "GET" and r.path == "/repos/octo/hello" for r in server.requests)
        # Again: the open one is returned, no second create.
        again = open_pull_request(repo, TOKEN, head="agentbox/t-gh", title="x", body="y")
        assert again.existed and again.number == pr.number
        assert [r.method for r in server.requests].count("POST") == 1
        assert server.errors == []


def test_github_server_refuses_a_call_outside_the_description() -> None:
    """The check can fail: a body field GitHub's description does not name is refused."""
    from github import Auth, Github

    with ForgeServer("github") as server:
        gh = Github(auth=Auth.Token(TOKEN), base_url=server.url, retry=None)
        r = gh.get_repo("octo/hello")
        with pytest.raises(Exception, match="400"):
            r._requester.requestJsonAndCheck(  # the client's own transport, a bad body
                "POST", f"{r.url}/pulls", input={"title": "t", "head": "h", "base": "main",
                                                 "labels": ["x"]},
            )  # fmt: skip
        assert server.errors and "additional" in server.errors[-1].lower()
        gh.close()


def test_github_errors_name_the_status_and_never_the_token() -> None:
    with ForgeServer("github", repo="octo/other") as server:
        with pytest.raises(ForgeError) as info:
            open_pull_request(_github(server), TOKEN, head="b", title="t", body="b")
        assert info.value.status == 404
        assert TOKEN not in str(info.value)


def test_gitlab_merge_request_uses_documented_fields_and_draft_title() -> None:
    with ForgeServer("gitlab", repo="group/sub/proj", default_branch="trunk") as server:
        repo = parse_remote("https://gitlab.example/group/sub/proj.git",
                            [f"gitlab.example=gitlab:{server.url}"])  # fmt: skip
        pr = open_pull_request(repo, TOKEN, head="agentbox/t-gl", title="fix it",
                               body="the body", draft=True)  # fmt: skip
        assert server.errors == []
        assert pr.url.endswith("/group/sub/proj/-/merge_requests/1") and pr.number == 1
        create = [r for r in server.requests if r.method == "POST"]
        assert create[0].body == {"source_branch": "agentbox/t-gl", "target_branch": "trunk",
                                  "title": "Draft: fix it", "description": "the body",
                                  "remove_source_branch": False}  # fmt: skip
        assert create[0].headers["private-token"] == TOKEN
        again = open_pull_request(repo, TOKEN, head="agentbox/t-gl", title="x", body="y")
        assert again.existed and [r.method for r in server.requests].count("POST") == 1
        assert server.errors == []


def test_gitlab_errors_name_the_status_and_never_the_token() -> None:
    with ForgeServer("gitlab", repo="group/other") as server:
        repo = parse_remote("https://gitlab.example/group/proj",
                            [f"gitlab.example=gitlab:{server.url}"])  # fmt: skip
        with pytest.raises(ForgeError) as info:
            open_pull_request(repo, TOKEN, head="b", title="t", body="b")
        assert info.value.status == 404 and TOKEN not in str(info.value)
