"""The paths issue 33 §8 adds to the flagged list: each runs code (or contacts a server)
when the branch is opened, or when a tool is used in it; ordinary neighbours are not."""

from __future__ import annotations

import pytest

from agentbox.collect._risky import risky_reason


@pytest.mark.parametrize(
    ("path", "words"),
    [
        (".lfsconfig", "makes git contact a server"),
        ("sub/.LFSConfig", "makes git contact a server"),
        (".vscode/launch.json", "launch"),
        ("app/.vscode/Launch.JSON", "launch"),
        ("proj.code-workspace", "workspace"),
        ("tools/Team.Code-Workspace", "workspace"),
        (".idea/runConfigurations/Server.xml", "run configuration"),
        (".idea/workspace.xml", "run configuration"),
        (".run/Server.run.xml", "run configuration"),
        ("mise.toml", "mise"),
        (".mise.toml", "mise"),
        ("svc/mise.local.toml", "mise"),
        (".config/mise.toml", "mise"),
        (".mise/tasks/build", "mise"),
        ("MISE.TOML", "mise"),
        (".yarnrc.yml", "yarnPath"),
        (".npmrc", "script-shell"),
        (".tool-versions", "asdf"),
        (".python-version", "pyenv"),
        (".env", "direnv"),
        ("web/.env", "direnv"),
    ],
)
def test_more_paths_that_run_code(path: str, words: str) -> None:
    why = risky_reason(path)
    assert why is not None and words in why, (path, why)


@pytest.mark.parametrize(
    "path",
    [
        "docs/mise.md",
        "mise.toml.example",
        ".env.example",
        "src/npmrc",
        ".idea/misc.xml",
        ".vscode/extensions.json",
        "workspace.code",
        "lfsconfig",
        "python-version.txt",
    ],
)
def test_their_neighbours_are_not_flagged(path: str) -> None:
    assert risky_reason(path) is None, path
