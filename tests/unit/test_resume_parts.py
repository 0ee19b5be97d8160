"""The parts of ``resume``, ``wait`` and ``diff`` that need no sandbox: the agent's argv with
``--resume``, carrying a Claude Code session file between workspaces (real files, real
``openat2``: a link the agent planted is never followed), the session id read from the
previous agent's output, ``wait``'s exit codes and ``diff --stat``'s counts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentbox.cli._diff import diffstat
from agentbox.cli._wait import WAIT_TIMEOUT, exit_code
from agentbox.config import Settings
from agentbox.core.paths import TaskPaths
from agentbox.errors import PolicyRefused
from agentbox.launcher import _session
from agentbox.launcher._agent import AGENT_FLAGS, agent_argv, agent_env, check_agent_argv

SID = "e4e4272e-5a78-4927-a968-98b6984c85c6"


def test_resume_is_the_one_extra_flag_and_takes_a_uuid_only() -> None:
    argv = agent_argv("go on", resume=SID)
    assert argv[: len(AGENT_FLAGS) + 2] == ["claude", *AGENT_FLAGS, "--settings"]
    assert argv[len(AGENT_FLAGS) + 3 :] == ["--resume", SID, "--", "go on"]
    check_agent_argv(argv)
    check_agent_argv(agent_argv("go on"))
    with pytest.raises(PolicyRefused):
        agent_argv("go on", resume="../../etc")
    n = len(AGENT_FLAGS) + 3  # claude, the flags, --settings JSON
    for bad in (
        [*argv[:n], "--resume", "x", "--", "t"],  # not a uuid
        [*argv[:n], "--resume-x", SID, "--", "t"],  # not the flag
        [*argv[:n], "--", "t", "--resume", SID],  # after the task
        [*argv[:n], "--mcp-config", SID, "--", "t"],  # another flag in its place
    ):
        with pytest.raises(PolicyRefused):
            check_agent_argv(bad)


def test_claude_keeps_its_sessions_in_the_workspace_git() -> None:
    assert agent_env("t" * 30)["CLAUDE_CONFIG_DIR"] == "/workspace/.git/agentbox/claude"


def _session_file(paths: TaskPaths) -> Path:
    return paths.workspace / ".git/agentbox/claude/projects/-workspace" / f"{SID}.jsonl"


def _previous(settings: Settings, task_id: str) -> TaskPaths:
    prev = TaskPaths(settings.data_dir, task_id)
    prev.log_dir.mkdir(parents=True)
    (prev.log_dir / "agent.jsonl").write_text(
        'not json\n{"type":"system","subtype":"init","session_id":"' + SID + '"}\n'
    )
    return prev


def _follow_up(settings: Settings, task_id: str, previous: str) -> TaskPaths:
    paths = TaskPaths(settings.data_dir, task_id)
    (paths.workspace / ".git").mkdir(parents=True)
    paths.log_dir.mkdir(parents=True)
    sid = _session.session_id_of(TaskPaths(settings.data_dir, previous))
    assert sid == SID
    cont = _session.Continuation(previous, "0" * 40, "done", sid)
    _session.record(settings, task_id, cont)
    return paths


def test_the_session_is_carried_and_resumed(settings: Settings) -> None:
    prev = _previous(settings, "prev")
    _session_file(prev).parent.mkdir(parents=True)
    _session_file(prev).write_text('{"type":"user"}\n')
    paths = _follow_up(settings, "next", "prev")
    _session.seed(settings, paths)
    assert _session_file(paths).read_text() == '{"type":"user"}\n'
    assert _session.resume_session(paths) == SID
    assert "previous-task.md" in _session.agent_task(paths, "go on")
    assert (paths.workspace / _session.PREVIOUS_FILE).is_file()
    # Kept: a task requeued by a later launcher is prepared again from it.
    assert (settings.data_dir / "continue" / "next.json").exists()


def test_a_planted_link_is_never_followed(settings: Settings, tmp_path: Path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("root's secret\n")
    prev = _previous(settings, "prev")
    _session_file(prev).parent.mkdir(parents=True)
    _session_file(prev).symlink_to(secret)  # the agent made its session file a link
    paths = _follow_up(settings, "next", "prev")
    _session.seed(settings, paths)
    assert not _session_file(paths).exists()
    assert _session.resume_session(paths) is None  # runs without --resume, file only
    # A link higher up (the agent's .git/agentbox pointing out) is refused the same way.
    prev2 = _previous(settings, "prev2")
    (prev2.workspace / ".git").mkdir(parents=True)
    os.symlink(tmp_path, prev2.workspace / ".git" / "agentbox")
    (tmp_path / "claude/projects/-workspace").mkdir(parents=True)
    (tmp_path / f"claude/projects/-workspace/{SID}.jsonl").write_text("outside\n")
    paths2 = _follow_up(settings, "next2", "prev2")
    _session.seed(settings, paths2)
    assert not _session_file(paths2).exists()
    assert _session.resume_session(paths2) is None


def test_a_session_id_must_be_a_uuid(settings: Settings) -> None:
    prev = TaskPaths(settings.data_dir, "odd")
    prev.log_dir.mkdir(parents=True)
    (prev.log_dir / "agent.jsonl").write_text(json.dumps({"session_id": "../x"}) + "\n")
    assert _session.session_id_of(prev) == ""
    assert _session.session_id_of(TaskPaths(settings.data_dir, "none")) == ""


def test_wait_exit_codes() -> None:
    assert exit_code(["done", "done"]) == 0
    assert exit_code(["done", "cancelled"]) == 6
    assert exit_code(["timed_out", "cancelled"]) == 5
    assert exit_code(["cancelled", "failed", "timed_out"]) == 1
    assert WAIT_TIMEOUT == 7


def test_diffstat_counts_lines_per_file() -> None:
    diff = (
        "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1,2 +1,2 @@\n-x\n--- c\n+y\n+z\n"
        "diff --git a/new b/new\nnew file mode 100644\n--- /dev/null\n+++ b/new\n@@ -0,0 +1 @@\n"
        "+--- not a header\n"
    )
    assert diffstat(diff) == [("a.py", 2, 2), ("new", 1, 0)]


def test_the_launchers_claude_settings_are_pinned_on_the_command_line() -> None:
    """The base URL and the launcher's other variables go in ``--settings`` (outranking
    the workspace's .claude/settings.json); the token never does; nothing else passes."""
    env = {**agent_env("secret-token-" * 3), "ANTHROPIC_BASE_URL": "http://127.0.0.1:9"}
    argv = agent_argv("go on", env=env)
    pinned = json.loads(argv[len(AGENT_FLAGS) + 2])
    assert pinned["env"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9"
    assert pinned["env"]["CLAUDE_CONFIG_DIR"] == agent_env("t")["CLAUDE_CONFIG_DIR"]
    assert "ANTHROPIC_API_KEY" not in pinned["env"] and "secret-token" not in " ".join(argv)
    assert pinned["permissions"] == {"defaultMode": "bypassPermissions"}
    n = len(AGENT_FLAGS) + 2
    for other in (
        {**pinned, "hooks": {"SessionStart": []}},  # anything but the launcher's keys
        {**pinned, "env": {**pinned["env"], "LD_PRELOAD": "/x.so"}},
        {**pinned, "env": {**pinned["env"], "ANTHROPIC_API_KEY": "k"}},
        {**pinned, "permissions": {"defaultMode": "default"}},
    ):
        with pytest.raises(PolicyRefused):
            check_agent_argv([*argv[:n], json.dumps(other), *argv[n + 1 :]])
    with pytest.raises(PolicyRefused):  # without --settings
        check_agent_argv([*argv[: n - 1], *argv[n + 1 :]])
