"""The one command a task may run, and the environment it gets.

The command is always Claude Code in print mode with the task spec, with the
flags listed here and no others (:func:`check_agent_argv` enforces it on the
final argv, whoever built it):

* ``--output-format stream-json --verbose``: one JSON event per line, kept as the
  task's log; the final ``result`` event gives the agent's last message to the
  report (never used for accounting: tokens come from the gateway's usage file).
* ``--dangerously-skip-permissions``: Claude Code's own permission prompts are
  off *inside* the sandbox, because the sandbox is the permission boundary: no
  network but the gateway, a read-only root, no capabilities, a uid that owns
  nothing on the host, and only the workspace writable. Nothing the agent does
  with Bash or Edit there can reach the host; what it wrote comes back only
  through result collection, as data.
* ``--settings <json>``: the launcher's own settings for Claude Code
  (:func:`forced_settings`): the environment the launcher sets (base URL, the
  model variables, the switches) and the permission mode. Settings given on the
  command line outrank the workspace's ``.claude/settings.json`` and
  ``settings.local.json`` (only managed settings outrank them), key by key: a
  repo, or a previous task's agent, that sets ``env.ANTHROPIC_BASE_URL`` there no
  longer points Claude Code elsewhere. Its hooks still run, inside the sandbox
  like anything the agent runs; ``agentbox resume`` shows them as flagged paths.
* ``--resume <session-id>`` (a continued task only, :mod:`agentbox.launcher._session`):
  Claude Code's own resume of the previous task's session, whose state the launcher
  copied into the workspace's ``.git`` (``CLAUDE_CONFIG_DIR`` points there in every
  task, so the session outlives the sandbox's tmpfs ``$HOME``); a UUID, nothing else.
* ``--`` then the task text, so a task beginning with ``-`` is never a flag.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agentbox.backends.base import GATEWAY_PORT, HOME_IN_SANDBOX, WORKSPACE_IN_SANDBOX
from agentbox.errors import AgentboxError, PolicyRefused

if TYPE_CHECKING:
    from agentbox.config import Settings

#: Claude Code's config and session dir, relative to the workspace: in the agent's own
#: ``.git``, never collected, and kept with the task (for ``agentbox resume``).
CLAUDE_CONFIG_IN_WORKSPACE = ".git/agentbox/claude"
#: A Claude Code session id (what ``--resume`` takes).
SESSION_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

#: The flags the launcher passes; nothing else is accepted on the agent's argv.
AGENT_FLAGS: tuple[str, ...] = (
    "-p",
    "--output-format",
    "stream-json",
    "--verbose",
    "--dangerously-skip-permissions",
)

#: Claude Code's own model choices (its main model, what its ``opus``/``sonnet``/``haiku``
#: aliases, subagents and small fast model resolve to): all set to the task's model id,
#: so that the agent's view of its model (context window, ``/model``) is what runs. The
#: gateway rewrites every request's ``model`` to it anyway.
MODEL_ENV_NAMES = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)

#: The variable telling an attempt of a best-of-N group its index (1-based).
ATTEMPT_ENV = "AGENTBOX_ATTEMPT"

#: Variables the launcher itself sets in every agent sandbox.
LAUNCHER_ENV_NAMES = frozenset(
    {
        *MODEL_ENV_NAMES,
        "ANTHROPIC_BASE_URL",
        "ANTHROPIC_API_KEY",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC",
        "CLAUDE_CONFIG_DIR",
        "DISABLE_AUTOUPDATER",
        "DISABLE_TELEMETRY",
        "DISABLE_ERROR_REPORTING",
        "HOME",
        "PYTHONDONTWRITEBYTECODE",
        # Best-of-N: which attempt of its group the task is (1-based); set only there.
        ATTEMPT_ENV,
    }
)


#: Launcher variables never put on a command line (a secret: argv is visible to ``ps``).
_SECRET_ENV = frozenset({"ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"})
#: The settings keys :func:`forced_settings` writes (and the only ones the check accepts).
_FORCED_KEYS = frozenset({"env", "permissions"})


def forced_settings(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The launcher's settings for Claude Code, passed with ``--settings`` so that the
    workspace's own settings files cannot override them.

    The one place for them: every variable of ``env`` (default :func:`agent_env`'s)
    that :data:`LAUNCHER_ENV_NAMES` names, secrets aside (the token stays in the
    process environment only), and the permission mode the sandbox runs in. A
    variable added to the agent's environment (a model variable) is pinned here by
    adding its name to :data:`LAUNCHER_ENV_NAMES`.
    """
    source = agent_env("") if env is None else env
    pinned = {k: str(v) for k, v in sorted(source.items())
              if k in LAUNCHER_ENV_NAMES and k not in _SECRET_ENV}  # fmt: skip
    return {"env": pinned, "permissions": {"defaultMode": "bypassPermissions"}}


def _settings_arg(settings: Mapping[str, Any]) -> str:
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


def _check_settings_arg(text: str) -> None:
    """Refuse a ``--settings`` value that is not what :func:`forced_settings` makes."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    env = data.get("env") if isinstance(data, dict) else None
    if (
        not isinstance(data, dict)
        or set(data) != _FORCED_KEYS
        or not isinstance(env, dict)
        or not set(env) <= LAUNCHER_ENV_NAMES - _SECRET_ENV
        or not all(isinstance(v, str) for v in env.values())
        or data["permissions"] != {"defaultMode": "bypassPermissions"}
    ):
        raise PolicyRefused(f"not the launcher's Claude Code settings: {text[:80]!r}")


def agent_argv(
    task: str, *, resume: str | None = None, env: Mapping[str, str] | None = None
) -> list[str]:
    """``claude -p <our flags> --settings <forced settings of env> [--resume <session-id>]
    -- <task>``."""
    if "\0" in task:
        raise PolicyRefused("the task text contains a NUL byte")
    if resume is not None and not SESSION_ID.fullmatch(resume):
        raise PolicyRefused(f"not a Claude Code session id: {resume!r:.60}")
    extra = ["--resume", resume] if resume is not None else []
    pinned = ["--settings", _settings_arg(forced_settings(env))]
    return ["claude", *AGENT_FLAGS, *pinned, *extra, "--", task]


def check_agent_argv(argv: Sequence[str]) -> None:
    """Refuse any argv that is not exactly ``claude`` + our flags + ``--settings`` with
    the launcher's settings (+ ``--resume <uuid>``) + ``--`` + one task text."""
    n = len(AGENT_FLAGS) + 1
    if len(argv) < n + 2 or argv[n] != "--settings":
        raise PolicyRefused(
            f"the agent command must be claude with the launcher's flags: {list(argv)[:8]!r}"
        )
    _check_settings_arg(argv[n + 1])
    argv = [*argv[:n], *argv[n + 2 :]]
    if (
        len(argv) == len(AGENT_FLAGS) + 5
        and argv[len(AGENT_FLAGS) + 1] == "--resume"
        and SESSION_ID.fullmatch(argv[len(AGENT_FLAGS) + 2])
    ):
        argv = [*argv[: len(AGENT_FLAGS) + 1], *argv[len(AGENT_FLAGS) + 3 :]]
    expected = len(AGENT_FLAGS) + 3
    if (
        len(argv) != expected
        or argv[0] != "claude"
        or tuple(argv[1:-2]) != AGENT_FLAGS
        or argv[-2] != "--"
        or not argv[-1]
    ):
        raise PolicyRefused(
            f"the agent command must be claude with the launcher's flags: {list(argv)[:8]!r}"
        )


def agent_env(
    token: str, model_id: str | None = None, *, attempt: int | None = None
) -> dict[str, str]:
    """What the launcher adds to the Boxfile's allow-listed environment; ``model_id``: the
    task's upstream model id (a replay entry's name), set in :data:`MODEL_ENV_NAMES`;
    ``attempt``: a best-of-N attempt's index, as :data:`ATTEMPT_ENV`."""
    models = dict.fromkeys(MODEL_ENV_NAMES, model_id) if model_id else {}
    return {
        **models,
        **({ATTEMPT_ENV: str(int(attempt))} if attempt is not None else {}),
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{GATEWAY_PORT}",
        "ANTHROPIC_API_KEY": token,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CONFIG_DIR": f"{WORKSPACE_IN_SANDBOX}/{CLAUDE_CONFIG_IN_WORKSPACE}",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "HOME": HOME_IN_SANDBOX,
        # Bytecode caches are noise in a result branch.
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def check_env(env: Mapping[str, str], allowed: set[str]) -> None:
    """Refuse an environment with a variable neither the launcher nor the allow-list names."""
    extra = sorted(set(env) - allowed - LAUNCHER_ENV_NAMES)
    if extra:
        raise PolicyRefused(f"environment variables not on the allow-list: {', '.join(extra)}")


def model_id(settings: Settings, model: str) -> str | None:
    """The model id the agent is told to ask for: the entry's upstream id (a replay
    entry: its name), which the gateway sends upstream whatever the agent asks."""
    from agentbox.gateway.registry import load_registry

    try:
        entry = load_registry(settings).get(model)
    except AgentboxError:
        return None
    return entry.name if entry.scripted else entry.target_model
