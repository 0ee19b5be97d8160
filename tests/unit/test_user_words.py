"""What a new user reads: errors in the words of what they typed (issue 34, items 11-20).

Each test runs the real code (the CLI through typer's runner, the Boxfile parser, the
launcher's checks) with no services; each fails on the code before the issue.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbox.boxfile import Boxfile, loads_boxfile
from agentbox.config import Settings
from agentbox.errors import BoxfileError, PathRefused, PolicyRefused

# -- item 11: a flag's bad value names the flag and its unit --------------------------


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"deadline": 5}, "--deadline must be at least 10 seconds, got 5"),
        ({"deadline": 90000}, "--deadline must be at most 86,400 seconds, got 90,000"),
        ({"budget": 0}, "--budget must be at least 1 token, got 0"),
        ({"model": ""}, "--model must not be empty"),
        ({"model": "m" * 200}, "--model must be at most 128 characters"),
    ],
)
def test_a_flags_bad_value_names_the_flag_and_unit(fields: dict[str, object], words: str) -> None:
    from agentbox.cli._run import _request

    with pytest.raises(PolicyRefused) as ei:
        _request(repo="/srv/r", task="do it", **fields)
    assert str(ei.value) == words
    assert "Input should" not in str(ei.value)


def test_run_deadline_5_says_the_flag(tmp_path: Path) -> None:
    """``agentbox run --deadline 5`` as the user types it: the refusal names the flag."""
    from agentbox.cli import app

    out = CliRunner().invoke(
        app, ["run", "--repo", str(tmp_path), "--deadline", "5", "--detach", "x"]
    )
    assert isinstance(out.exception, PolicyRefused), out.output
    assert str(out.exception) == "--deadline must be at least 10 seconds, got 5"


# -- item 20: every unknown Boxfile key, with "did you mean" --------------------------


def test_every_unknown_boxfile_key_is_named_with_a_near_miss() -> None:
    text = (
        'netwrok = "none"\nimagee = "x"\nflavour = 1\n'
        '[setup]\nrun = ["true"]\nrnu = ["x"]\n[resources]\ncpu = 2\n'
    )
    with pytest.raises(BoxfileError) as ei:
        loads_boxfile(text, path=Path("/r/Boxfile.toml"))
    msg = str(ei.value)
    assert "[netwrok] unknown key (did you mean [network]?)" in msg
    assert "[imagee] unknown key (did you mean [image]?)" in msg
    assert "[setup.rnu] unknown key (did you mean [setup.run]?)" in msg
    assert "[resources.cpu] unknown key (did you mean [resources.cpus]?)" in msg
    assert "[flavour] unknown key" in msg and "[flavour] unknown key (" not in msg
    assert msg.startswith("/r/Boxfile.toml: 5 problems: ")
    assert ei.value.key is not None


def test_one_unknown_key_keeps_its_key_and_suggests() -> None:
    with pytest.raises(BoxfileError) as ei:
        Boxfile.from_dict({"image": {"containerfile": "C", "contxt": "."}})
    assert ei.value.key == "image.contxt"
    assert str(ei.value) == "[image.contxt] unknown key (did you mean [image.context]?)"


def test_an_internal_key_is_never_suggested() -> None:
    with pytest.raises(BoxfileError) as ei:
        Boxfile.from_dict({"capabilitie": 1})
    assert "did you mean" not in str(ei.value)


# -- item 12: the dirty-tree refusal names the front end's own option ------------------


def _git(repo: Path, *args: str) -> None:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@localhost", "GIT_CONFIG_NOSYSTEM": "1",
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env=env)


def _dirty_repo(root: Path) -> Path:
    repo = root / "proj"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "init")
    (repo / "a.py").write_text("x = 2\n")
    return repo


def test_dirty_repo_refusal_names_the_cli_flag_and_the_mcp_parameter(settings: Settings) -> None:
    from agentbox.cli import error_message
    from agentbox.launcher._validate import _check_repo
    from agentbox.launcher.client import _error_from
    from agentbox.mcp._server import _tool_error

    repo = _dirty_repo(settings.repos_root)
    with pytest.raises(PolicyRefused) as ei:
        _check_repo(settings, str(repo), include_uncommitted=False)
    cli = error_message(ei.value)
    assert cli.endswith("commit them or include them with --include-uncommitted"), cli
    assert "include_uncommitted" not in cli
    mcp = str(_tool_error(ei.value))
    assert mcp.endswith("commit them or include them with include_uncommitted=true"), mcp
    assert "--include-uncommitted" not in mcp
    # Over the launcher's socket (a detached run, the MCP server) it keeps its kind.
    wire = _error_from(422, {"error": type(ei.value).__name__, "message": str(ei.value)})
    assert error_message(wire) == cli


# -- item 13: the repos-root refusal says where the root came from --------------------


def test_repos_root_refusal_says_the_default_when_nothing_set_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentbox.launcher._validate import _check_repo

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("AGENTBOX_REPOS_ROOT", raising=False)
    monkeypatch.setenv("AGENTBOX_CONFIG", str(tmp_path / "no-config.toml"))
    settings = Settings(data_dir=tmp_path / "data")
    assert settings.repos_root == home.resolve()
    with pytest.raises(PathRefused) as ei:
        _check_repo(settings, str(tmp_path / "elsewhere"), include_uncommitted=False)
    msg = str(ei.value)
    assert "set by AGENTBOX_REPOS_ROOT" not in msg
    assert "(the default (the home directory); set AGENTBOX_REPOS_ROOT" in msg


def test_repos_root_refusal_names_the_variable_or_the_file_that_set_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentbox.config import load_settings
    from agentbox.mcp._repo import validate_repo

    root = tmp_path / "repos"
    root.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(f'repos_root = "{root}"\n')
    monkeypatch.delenv("AGENTBOX_REPOS_ROOT", raising=False)
    monkeypatch.setenv("AGENTBOX_CONFIG", str(config))
    with pytest.raises(PathRefused, match=f"set in {config}"):
        validate_repo(load_settings().repos_root, str(tmp_path / "elsewhere"))
    monkeypatch.setenv("AGENTBOX_REPOS_ROOT", str(root))
    with pytest.raises(PathRefused, match=r"\(set by AGENTBOX_REPOS_ROOT\)"):
        validate_repo(load_settings().repos_root, str(tmp_path / "elsewhere"))


# -- item 14: `agentbox du` prints whole task ids ------------------------------------


def test_du_prints_whole_task_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from agentbox.cli import app
    from agentbox.launcher._store import Owner, Store

    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.setenv("AGENTBOX_DATA_DIR", str(data))
    store = Store(data / "state.db")
    ids = [f"demo-{n}-0123456789abcdef0123456789abcdef" for n in range(3)]
    for task_id in ids:
        store.insert(
            id=task_id, status="done", repo="/r", task="x", model="m", budget=10, deadline=10.0,
            created_at=1.0, finished_at=2.0, owner_pid=os.getpid(), owner_start=Owner.me().start,
        )  # fmt: skip
        (data / "tasks" / task_id / "workspace").mkdir(parents=True)
        (data / "tasks" / task_id / "workspace" / "f").write_bytes(b"x" * 5000)
    out = CliRunner().invoke(app, ["du"], env={"COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    for task_id in ids:
        assert task_id in out.output, out.output
    assert "…" not in out.output


# -- item 16: the report's time shows setup, agent and the whole ----------------------


def _info(**kw: object) -> object:
    from agentbox.launcher.api import TaskInfo

    fields: dict[str, object] = {
        "id": "demo-0123456789abcdef0123456789abcdef-long-id", "status": "done", "repo": "/r",
        "task": "x", "model": "replay-demo", "budget": 20_000_000, "deadline": 3600.0,
        "created_at": 1000.0, "started_at": 1017.5, "finished_at": 1025.5, "exit_code": 0,
        "changed": True, **kw,
    }  # fmt: skip
    return TaskInfo(**fields)


def test_time_shows_setup_agent_and_the_whole() -> None:
    from agentbox.cli._view import time_words

    info = _info()
    setup = {"setup": {"cache": "miss", "duration_s": 14.4}}
    assert time_words(info, setup) == "25.5s in all: setup 14.4s, agent 8.0s (deadline 3600s)"
    hit = {"setup": {"cache": "hit", "duration_s": 0}}
    assert time_words(info, hit) == "25.5s in all: setup cached, agent 8.0s (deadline 3600s)"
    assert time_words(info, {}) == "25.5s in all: agent 8.0s (deadline 3600s)"
    assert time_words(_info(started_at=None), {}) == "25.5s (deadline 3600s)"


# -- item 19: piped output is never wrapped mid-phrase; counts are right ---------------


def test_a_piped_report_keeps_each_row_on_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from agentbox.cli import _view
    from agentbox.core.console import console as make_console
    from agentbox.launcher.api import TaskResult

    buf = io.StringIO()
    monkeypatch.setattr(_view, "console", make_console(file=buf, width=80))
    info = _info()
    report = {
        "tools_run": {"Bash": 3, "Read": 2, "Write": 1, "Edit": 4},
        "setup": {"cache": "miss", "duration_s": 14.4, "roots": [".venv"], "files": 3, "size": 9},
    }
    res = TaskResult(task_id=info.id, status="done", report=report, diff="", diff_truncated=False,
                     branch=f"agentbox/{info.id}", shadow_git="/s", commit="abc")  # fmt: skip
    _view.report_text(info, res)
    lines = buf.getvalue().splitlines()
    assert any(f"(agentbox logs {info.id})" in ln for ln in lines), lines
    assert any("(budget 20,000,000)" in ln for ln in lines), lines
    assert any("setup 14.4s, agent 8.0s" in ln for ln in lines), lines
    assert all(ln == ln.rstrip() for ln in lines)


def test_a_piped_console_does_not_break_a_long_line() -> None:
    import io

    from agentbox.core.console import console as make_console

    buf = io.StringIO()
    c = make_console(file=buf, width=80)
    line = (
        "task demo-0123456789abcdef0123456789abcdef-long-id queued "
        "(agentbox logs demo-0123456789abcdef0123456789abcdef-long-id)"
    )
    c.print(line)
    assert buf.getvalue() == line + "\n"


def test_write_result_counts_the_lines_written(tmp_path: Path) -> None:
    import json

    from agentbox.cli._logs import event_lines
    from agentbox.transcript._parse import parse_agent_jsonl

    content = "".join(f"line {i}\n" for i in range(9))
    lines = [
        {"type": "assistant", "message": {"id": "m1", "content": [
            {"type": "tool_use", "id": "tu1", "name": "Write",
             "input": {"file_path": "/workspace/nine.py", "content": content}}]}},
        {"type": "user", "message": {"content": [
            {"type": "tool_result", "tool_use_id": "tu1",
             "content": "File created successfully at: /workspace/nine.py"}]}},
        {"type": "assistant", "message": {"id": "m2", "content": [
            {"type": "tool_use", "id": "tu2", "name": "Bash", "input": {"command": "echo hi"}}]}},
        {"type": "user", "message": {"content": [
            {"type": "tool_result", "tool_use_id": "tu2", "content": "hi"}]}},
    ]  # fmt: skip
    path = tmp_path / "agent.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    parsed, _ = parse_agent_jsonl(path)
    events = [e for e in parsed.events if e.kind == "tool_result"]
    write = " ".join(t.plain for t in event_lines(events[0], full=False))
    assert "Write ok" in write and "(wrote 9 lines)" in write and "1 lines" not in write, write
    bash = " ".join(t.plain for t in event_lines(events[1], full=False))
    assert "(1 line)" in bash, bash
    # The MCP transcript's words too.
    from agentbox.transcript import event_text

    assert "-> Write ok (wrote 9 lines)" in event_text(events[0])


# -- item 15: `env prune` takes `prune`'s durations, and --dry-run --------------------


def test_env_prune_takes_prunes_durations_and_dry_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from agentbox.cli import app
    from agentbox.env import EnvStore
    from agentbox.env._model import EnvInfo

    monkeypatch.setenv("AGENTBOX_CACHE_DIR", str(tmp_path / "cache"))
    store = EnvStore(Settings(cache_dir=tmp_path / "cache"))
    key = "ab" * 16
    stage = store.staging()
    (stage / "tree" / ".venv").mkdir()
    info = store.freeze(stage, EnvInfo(key=key, image="img", roots=[".venv"]))
    old = info.model_copy(update={"last_used": time.time() - 20 * 86400})
    (store.path(key) / "meta.json").write_text(old.model_dump_json())

    runner = CliRunner()
    dry = runner.invoke(app, ["env", "prune", "--older-than", "14d", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert f"would remove {key[:12]}" in dry.output and "1 would remove" in dry.output
    assert store.path(key).exists()
    kept = runner.invoke(app, ["env", "prune", "--older-than", "3w"])
    assert kept.exit_code == 0 and "0 removed" in kept.output, kept.output
    bad = runner.invoke(app, ["env", "prune", "--older-than", "soon"])
    assert bad.exit_code == 2 and "not an age" in bad.output
    gone = runner.invoke(app, ["env", "prune", "--older-than", "14"])  # a bare number: days
    assert gone.exit_code == 0 and f"removed {key[:12]}" in gone.output, gone.output
    assert not store.path(key).exists()


def test_exec_backend_and_runtime_flags_are_refused_in_the_flags_words() -> None:
    from agentbox.cli import app

    for flag, value, words in (
        ("--backend", "lxc", "--backend must be 'podman', 'qemu', 'firecracker' or 'docker'"),
        ("--runtime", "kata", "--runtime must be 'runc', 'crun' or 'runsc', got 'kata'"),
    ):
        out = CliRunner().invoke(app, ["exec", flag, value, "--", "true"])
        assert isinstance(out.exception, BoxfileError), out.output
        assert str(out.exception).startswith(words), str(out.exception)
        assert "Input should" not in str(out.exception)
