"""Re-validation of a task request, before anything is created.

A request that passed the wire schema is checked again against this host's
settings: the repo resolves inside the repos root (a symlink pointing out is
refused, because the check is on the resolved path), is a git repo with a
commit, and is clean unless uncommitted changes were asked for; the model is
in the registry; the budget and deadline are in range; the id is well-formed.
Nothing on disk is created or changed here (git runs read-only, with
``GIT_OPTIONAL_LOCKS=0`` so ``status`` does not even refresh the index).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.boxfile import Boxfile
from agentbox.config import Settings, setting_source
from agentbox.core import proc as _proc
from agentbox.core.paths import check_inside, new_task_id, validate_task_id
from agentbox.errors import (
    AgentboxError,
    CommandError,
    ConfigError,
    PathRefused,
    PolicyRefused,
    UncommittedChanges,
)
from agentbox.gateway.registry import Registry
from agentbox.launcher.api import (
    DEFAULT_BUDGET,
    DEFAULT_DEADLINE,
    MAX_BUDGET,
    MAX_DEADLINE,
    MAX_TASK_CHARS,
    MIN_DEADLINE,
    TaskRequest,
)


@dataclass(frozen=True)
class Validated:
    """A request checked against this host: every value final."""

    task_id: str
    repo: Path
    task: str
    model: str
    budget: int
    deadline: float
    include_uncommitted: bool
    publish: bool
    budget_usd: float | None = None


#: ``git`` as found along each ``PATH`` (PATH -> its absolute path): found once, not by
#: every git process's exec trying each directory before it (~/.cargo/bin, pyenv shims).
_git_at: dict[str, str] = {}


def git_path(path: str) -> str:
    """The ``git`` that an exec along ``path`` runs (as execvp finds it), else ``git``."""
    found = _git_at.get(path)
    if found is None:
        found = shutil.which("git", path=path) or "git"
        if os.path.isabs(found):  # noqa: PTH117 (a str from which, kept a str)
            _git_at[path] = found
    return found


def git_readonly(repo: Path, *args: str, timeout: float = 60) -> _proc.Result:
    """Run git in the user's repo without writing to it and without its hooks or fsmonitor."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GIT_OPTIONAL_LOCKS": "0",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "LC_ALL": "C",
    }
    argv = [
        git_path(env["PATH"]),
        "-c",
        f"safe.directory={repo}",
        "-c",
        "core.fsmonitor=false",
        "-c",
        "core.hooksPath=/dev/null",
        "-C",
        str(repo),
        *args,
    ]
    return _proc.run(argv, timeout=timeout, env=env)


def _check_repo(settings: Settings, repo: str, include_uncommitted: bool) -> Path:
    if "\0" in repo or not Path(repo).is_absolute():
        raise PathRefused("the repo must be an absolute path", path=repo)
    try:
        real = check_inside(settings.repos_root, Path(repo), what="repo")
    except PathRefused:
        raise PathRefused(
            f"the repo resolves outside the repos root {settings.repos_root} "
            f"({setting_source('repos_root', settings.repos_root)})",
            path=repo,
        ) from None
    if real == settings.repos_root:
        raise PathRefused(
            f"the repo must be a directory inside the repos root, not the root "
            f"({setting_source('repos_root', settings.repos_root)})",
            path=repo,
        )
    if not real.is_dir():
        raise PathRefused("the repo is not a directory", path=repo)
    if not (real / ".git").exists():
        raise PathRefused("not a git repository (no .git at its top)", path=repo)
    # status beside rev-parse (both only read the repo): one git process's wait fewer.
    # Its answer is used only once rev-parse said the repo is what we take it for.
    with concurrent.futures.ThreadPoolExecutor(1) as side:
        asked = (
            None
            if include_uncommitted
            else side.submit(git_readonly, real, "status", "--porcelain", "--untracked-files=no")
        )
        try:
            # One process: the top level, then HEAD's commit (a repo without one fails).
            top = git_readonly(
                real, "rev-parse", "--show-toplevel", "--verify", "--quiet", "HEAD^{commit}"
            ).stdout.partition("\n")[0]
        except CommandError as exc:
            raise PathRefused("not a git repository with a commit", path=repo) from exc
        if Path(top).resolve() != real:
            raise PathRefused(f"the repo's top level is {top}, not this directory", path=repo)
        status = "" if asked is None else asked.result().stdout
    if status.strip():  # asked only without include_uncommitted
        raise UncommittedChanges(
            f"the repo {real} has uncommitted changes; commit them or include them"
        )  # each front end adds its option's name (UncommittedChanges.with_option)
    return real


def _first(*values: Any) -> Any:
    """The first value that is not None (0 is a value, and out of range, not a default)."""
    return next(v for v in values if v is not None)


def validate(
    req: TaskRequest,
    settings: Settings,
    registry: Registry,
    *,
    boxfile: Boxfile | None = None,
    repo_checked: Path | None = None,
) -> Validated:
    """Check ``req`` against this host; raise a RefusedError before anything is created.
    ``repo_checked``: the repo as an earlier validation of this request found it (its
    git questions are not asked again: validated again with the repo's own Boxfile)."""
    task_id = validate_task_id(req.task_id) if req.task_id is not None else new_task_id()
    if not req.task.strip() or len(req.task) > MAX_TASK_CHARS or "\0" in req.task:
        raise PolicyRefused(f"the task text must be 1..{MAX_TASK_CHARS} characters, without NUL")
    model = req.model if req.model is not None else (boxfile.model if boxfile else None)
    if model is None:
        model = registry.default
    try:
        why = registry.get(model).unavailable()
    except ConfigError as exc:
        raise PolicyRefused(str(exc)) from exc
    if why is not None:
        # Refused before anything starts, rather than a task failing inside.
        raise PolicyRefused(f"model {model!r} is unavailable: {why}")
    budget_usd = (
        req.budget_usd if req.budget_usd is not None else (boxfile.budget_usd if boxfile else None)
    )
    if budget_usd is not None and registry.get(model).price is None:
        raise PolicyRefused(
            f"--budget-usd: model {model!r} has no price in the model registry "
            f"({registry.source}), so a dollar budget cannot be kept; add "
            f"[models.{model}.price] or use --budget (tokens)"
        )
    budget = _first(req.budget, boxfile.budget if boxfile else None, DEFAULT_BUDGET)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise PolicyRefused(f"budget must be 1..{MAX_BUDGET} tokens, got {budget}")
    deadline = _first(req.deadline, boxfile.deadline if boxfile else None, DEFAULT_DEADLINE)
    if (
        isinstance(deadline, bool)
        or not isinstance(deadline, int | float)
        or not MIN_DEADLINE <= deadline <= MAX_DEADLINE
    ):
        raise PolicyRefused(
            f"deadline must be {MIN_DEADLINE:g}..{MAX_DEADLINE:g} s, got {deadline:g}"
        )
    try:
        repo = repo_checked or _check_repo(settings, req.repo, req.include_uncommitted)
    except CommandError as exc:
        raise PathRefused(f"cannot inspect the repo: {exc}", path=req.repo) from exc
    except AgentboxError:
        raise
    return Validated(
        task_id=task_id,
        repo=repo,
        task=req.task,
        model=model,
        budget=budget,
        deadline=float(deadline),
        include_uncommitted=req.include_uncommitted,
        publish=req.publish,
        budget_usd=budget_usd,
    )
