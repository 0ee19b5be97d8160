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
