"""The forge package's pure parts: a remote URL to a forge repo, and the pull request body."""

from __future__ import annotations

import pytest

from agentbox.errors import ForgeError
from agentbox.forge import MAX_BODY, parse_remote, pr_body, pr_title


@pytest.mark.parametrize(
    ("url", "kind", "host", "path", "api"),
    [
        ("https://github.com/octo/hello.git", "github", "github.com", "octo/hello",
         "https://api.github.com"),
        ("https://user:tok@github.com/octo/hello", "github", "github.com", "octo/hello",
         "https://api.github.com"),
        ("git@github.com:octo/hello.git", "github", "github.com", "octo/hello",
         "https://api.github.com"),
        ("ssh://git@github.com:22/octo/hello.git", "github", "github.com", "octo/hello",
         "https://api.github.com"),
        ("https://gitlab.com/group/sub/proj.git", "gitlab", "gitlab.com", "group/sub/proj",
         "https://gitlab.com"),
        ("git@GitLab.com:group/proj", "gitlab", "gitlab.com", "group/proj",
         "https://gitlab.com"),
    ],
)  # fmt: skip
def test_known_forges_from_the_remote_url(
    url: str, kind: str, host: str, path: str, api: str
) -> None:
    repo = parse_remote(url)
    assert (repo.kind, repo.host, repo.path, repo.api_url) == (kind, host, path, api)


def test_enterprise_and_self_hosted_hosts_come_from_the_settings() -> None:
    hosts = ["ghe.corp=github", "git.corp=gitlab", "gl2.corp=gitlab:https://gl2.corp/prefix/"]
    ghe = parse_remote("git@ghe.corp:team/app.git", hosts)
    assert (ghe.kind, ghe.api_url, ghe.owner, ghe.name) == (
        "github", "https://ghe.corp/api/v3", "team", "app")  # fmt: skip
    assert parse_remote("https://git.corp/a/b/c", hosts).api_url == "https://git.corp"
    assert parse_remote("https://gl2.corp/a/b", hosts).api_url == "https://gl2.corp/prefix"
    # A setting for github.com replaces its API URL (the tests' local server).
    assert parse_remote("https://github.com/o/r", ["github.com=github:http://127.0.0.1:1"]
                        ).api_url == "http://127.0.0.1:1"  # fmt: skip


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("/srv/git/repo.git", "not on a forge"),
        ("file:///srv/git/repo.git", "not on a forge"),
        ("https://example.org/o/r.git", "AGENTBOX_FORGE_HOSTS=example.org"),
        ("https://github.com/only-owner", "owner/repo"),
        ("https://github.com/a/b/c", "owner/repo"),
        ("https://github.com/../etc", "owner/repo"),
        ("https://gitlab.com/-x/y z", "group/project"),
    ],
)
def test_remotes_on_no_known_forge_are_refused(url: str, why: str) -> None:
    with pytest.raises(ForgeError, match=why.replace(".", r"\.")):
        parse_remote(url)


def test_a_bad_forge_hosts_entry_is_refused() -> None:
    with pytest.raises(ForgeError, match="HOST=github"):
        parse_remote("https://x.corp/a/b", ["x.corp=bitbucket"])
    with pytest.raises(ForgeError, match="not http"):
        parse_remote("https://x.corp/a/b", ["x.corp=gitlab:ftp://x.corp"])


REPORT = {
    "status": "done",
    "model": "sonnet",
    "final_message": "Done.\n```` @octocat <img src=https://evil/x.png>\n```",
    "last_test_command": {"command": "pytest -q", "exit_code": 1},
    "tokens": {"input": 1000, "output": 200, "cache_creation": 5, "cache_read": 7, "cost_usd": 0.5},
    "diffstat": {"files_changed": 3, "insertions": 10, "deletions": 2},
    "flagged": [
        {"path": ".github/workflows/`x`.yml", "change": "added", "reason": "GitHub Actions runs it"}
    ],
}


def test_the_body_has_the_report_and_renders_the_agents_text_inert() -> None:
    body = pr_body(REPORT, task="Fix the flaky test", task_id="t-9", host="box1")
    for part in ("### Request", "Fix the flaky test", "### Summary", "### Tests",
                 "FAILED (exit 1): pytest -q", "tokens: 1,212", "cost $0.5000",
                 "changes: 3 files, +10 -2", "### Files that run code", "GitHub Actions runs it",
                 "`agentbox logs t-9` on `box1`", "agentbox show t-9"):  # fmt: skip
        assert part in body, part
    # The agent's message sits in a fence longer than any backtick run in it: its own
    # fences, mentions and HTML stay text.
    fence = "`````text\nDone.\n```` @octocat"
    assert fence in body
    assert "\n`````\n" in body
    # A file name with backticks is inline code that they cannot end early.
    assert "``.github/workflows/`x`.yml``" in body


def test_the_body_without_a_message_tests_or_price_says_so() -> None:
    body = pr_body({"status": "done", "tokens": {"input": 1}}, task="x", task_id="t-1",
                   host="h")  # fmt: skip
    assert "The agent left no final message." in body
    assert "none run (the agent ran no test command)" in body
    assert "unknown (no price for the model)" in body
    assert "Files that run code when the branch is checked out or merged\n\nNone." in body


def test_the_body_is_cut_to_what_github_takes() -> None:
    big = dict(REPORT, flagged=[{"path": "p" * 300, "change": "added", "reason": "r" * 300}
                                for _ in range(200)])  # fmt: skip
    body = pr_body(big, task="t" * 40_000, task_id="t-1", host="h")
    assert len(body) <= MAX_BODY and body.endswith("[… the report was cut here]\n")


def test_the_title_is_the_first_line_of_the_request() -> None:
    assert pr_title("\n  Fix   the bug\nin detail", "t-1") == "Fix the bug [agentbox t-1]"
    assert pr_title("x" * 100, "t-2") == "x" * 71 + "… [agentbox t-2]"
    assert pr_title("   ", "t-3") == "agentbox result [agentbox t-3]"
