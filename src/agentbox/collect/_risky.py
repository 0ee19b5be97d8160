"""Paths that make other tools run code when the result branch is opened or merged.

A diff is reviewed for what the code does; these paths do something before any
review: direnv runs ``.envrc`` on ``cd`` (and loads ``.env``), Claude Code runs the
hooks in ``.claude/settings.json`` and starts the servers in ``.mcp.json``, VS Code
runs a ``folderOpen`` task or a launch configuration, JetBrains IDEs a run
configuration, git runs the filter a ``.gitattributes`` names and git-lfs contacts
the server an ``.lfsconfig`` names, mise/asdf/pyenv act on ``mise.toml``,
``.tool-versions`` and ``.python-version`` in every shell, Yarn runs ``yarnPath``
and npm its ``script-shell``, CI runs a workflow on push.

Flagging is by path, not content: ``.npmrc`` and ``.yarnrc.yml`` are flagged
whether or not they set ``script-shell`` or ``yarnPath`` (a reviewer reads the
file either way), and ``.env`` whether or not an ``.envrc`` calls ``dotenv``
(direnv's ``load_dotenv`` setting, or an ``.envrc`` in a parent directory
outside the result, loads it without one). The walk (:mod:`._walk`) notes every such path it adds,
changes or deletes, and the report lists them above the diff
(:class:`~agentbox.collect.report.Flagged`).

Matching is per path component, at any depth (a tool may be started in a
subdirectory), after the folding a case-insensitive filesystem does (case,
Unicode NFC, the code points HFS+ ignores, Windows' trailing dots and spaces),
so ``.Claude/Settings.json`` on a Mac checkout is caught too. The list is not
every way a repo can run code (a build file runs when you build): it is the
paths that act when the branch is merely opened, checked out or merged.
"""

from __future__ import annotations

import unicodedata

#: Reasons of the walk's notes that mark a flagged path (``"<FLAG_NOTE> added"``).
FLAG_NOTE = "runs code when opened or merged:"

_CHANGES = ("added", "modified", "deleted")

# Code points HFS+ ignores in names (as in _walk's .git check).
_IGNORABLE = dict.fromkeys(
    [0x200C, 0x200D, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x206A, 0x2070), 0xFEFF]
)

#: A directory whose every file is flagged, by folded name.
_DIRS = {
    ".claude": "Claude Code project settings: hooks and commands it runs in this repo",
    ".mise": "mise configuration: tasks, hooks and env scripts it runs in this directory",
    ".devcontainer": "dev container definition: its build and lifecycle commands run on open",
}
#: A file flagged wherever it is, by folded name.
_FILES = {
    ".envrc": "direnv runs it in your shell when you cd into the directory",
    ".mcp.json": "MCP servers (commands) Claude Code starts in this repo",
    ".gitattributes": "names git filters and diff drivers that run on checkout, diff and merge",
    ".gitmodules": "submodule URLs and update commands git uses on clone and update",
    ".pre-commit-config.yaml": "pre-commit hooks that run on every commit",
    ".devcontainer.json": "dev container definition: its lifecycle commands run on open",
    ".lfsconfig": "makes git contact a server: git-lfs takes lfs.url from it on checkout and push",
    "mise.toml": "mise runs its tasks, hooks and env scripts when you cd into the directory",
    ".mise.toml": "mise runs its tasks, hooks and env scripts when you cd into the directory",
    "mise.local.toml": "mise runs its tasks, hooks and env scripts when you cd into the directory",
    ".mise.local.toml": "mise runs its tasks, hooks and env scripts when you cd into the directory",
    ".tool-versions": "asdf/mise install and run the tool versions (and plugins) it names",
    ".python-version": "pyenv picks the interpreter (and runs its hooks) by it in every shell",
    ".yarnrc.yml": "Yarn runs the yarnPath it names (any script) for every yarn command",
    ".yarnrc": "Yarn 1 runs the yarn-path it names (any script) for every yarn command",
    ".npmrc": "npm runs the script-shell and node-options it names for every script",
    ".env": "direnv loads it into your shell (dotenv in an .envrc, or load_dotenv); "
    "tools read it as settings",
}
#: A file flagged wherever it is, by the folded end of its name.
_SUFFIXES = {
    ".code-workspace": "VS Code workspace: its tasks, launch configs and settings apply on open",
    ".run.xml": "JetBrains run configuration (a program and arguments the IDE runs)",
}
#: Names not starting with a dot that the list above holds (for the cheap first test).
_PLAIN = ("mise.toml", "mise.local.toml", ".code-workspace", ".run.xml")
#: A file flagged inside a directory of the given folded name.
_PAIRS = {
    (".vscode", "tasks.json"): "VS Code tasks (a folderOpen task runs when the folder opens)",
    (".vscode", "settings.json"): "VS Code settings (tool and interpreter paths it runs)",
    (".vscode", "launch.json"): "VS Code launch configurations (programs and preLaunchTasks)",
    (".idea", "workspace.xml"): "JetBrains workspace: its run configurations (programs it runs)",
    (".idea", "runconfigurations"): "JetBrains run configurations (programs the IDE runs)",
    (".config", "mise.toml"): "mise runs its tasks, hooks and env scripts in this directory",
}
_WORKFLOWS = "GitHub Actions workflows run on push and pull request"
#: Config directories of the above: as a path's last part (git tracks no directory), a
#: symlink or a file where the directory should be (a link to a directory of tasks).
_LINKED = {
    ".vscode": "a link or file in place of VS Code's settings directory",
    ".github": "a link or file in place of the .github directory (workflows)",
}


def _fold(name: str) -> str:
    return unicodedata.normalize("NFC", name.translate(_IGNORABLE)).casefold().rstrip(" .")


def risky_reason(path: str) -> str | None:
    """Why ``path`` (``/``-separated, relative to the repo) runs code, or None."""
    if (path.isascii() and path[:1] != "." and "/." not in path
            and not path.rstrip(" .").lower().endswith(_PLAIN)):  # fmt: skip
        return None  # every other name above starts with a dot: the common case, cheaply
    parts = [_fold(p) for p in path.split("/")]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part in _DIRS:
            return _DIRS[part]
        if last and part in _FILES:
            return _FILES[part]
        if i and last and (parts[i - 1], part) in _PAIRS:
            return _PAIRS[(parts[i - 1], part)]
        if i and not last and (parts[i - 1], part) == (".idea", "runconfigurations"):
            return _PAIRS[(".idea", "runconfigurations")]
        if last:
            for suffix, why in _SUFFIXES.items():
                if part.endswith(suffix):
                    return why
        if part == ".github" and not last and parts[i + 1] == "workflows":
            return _WORKFLOWS
        if last and part in _LINKED:
            return _LINKED[part]
    return None


def flag_note(change: str) -> str:
    """The reason of the walk's note for a flagged path (``change``: added, modified, deleted)."""
    assert change in _CHANGES
    return f"{FLAG_NOTE} {change}"


def flag_change(reason: str) -> str | None:
    """The change a note's reason flags (added, modified, deleted), or None for other notes."""
    if not reason.startswith(FLAG_NOTE):
        return None
    change = reason[len(FLAG_NOTE) :].strip()
    return change if change in _CHANGES else None
