"""End to end (issue 33 §2): one repo's frozen environment never reaches another repo's
or another user's agent, through the launcher and the real Claude Code (a replay script).

The reproduction: two repos with the same ``[setup]`` (``sh build.sh``, keyed with
``key = "inputs"`` on the same ``requirements.txt``) but another ``build.sh`` (which
setup runs and ``inputs`` does not name) and another ``[env] set``. The first repo's
setup leaves its marker and an ``evil.py`` in ``.venv``. Then:

- the second repo's task runs setup (a miss) and its agent sees its own ``.venv``;
- the first repo again: a hit (the key is stable through the launcher: nothing of a
  task's own lands in what keys it);
- one repo keyed on its whole tree (the default) delegated by its owner twice (a miss,
  then a hit), then by root: a miss.
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Callable

import pytest

from env_helpers import EnvLab

pytestmark = [pytest.mark.podman, pytest.mark.claude]

NONCE = secrets.token_hex(4)
USER = 64433  # the repo owner who delegates as a non-root caller (a bare uid)

SCRIPT = """\
name: env-scope
turns:
  - text: "Looking at the environment."
    tool_use:
      - name: Bash
        input:
          command: "echo MARK=$(cat .venv/marker); ls .venv | sed 's/^/ENTRY=/'"
          description: "Look at .venv"
  - text: "Done."
"""


def _boxfile(mark: str, key: str) -> str:
    return f"""\
[env]
set = {{ MARK = "{mark}" }}

[setup]
run = ["sh build.sh"]
inputs = ["requirements.txt"]
key = "{key}"
"""


def _build(who: str, extra: str = "") -> str:
    return f'mkdir -p .venv && echo "$MARK-{who}" > .venv/marker{extra}\n'


def _repo(lab: EnvLab, name: str, mark: str, build: str, key: str = "inputs") -> str:
    path = lab.repo(name, {
        "requirements.txt": f"attrs=={NONCE}\n", "build.sh": build, ".gitignore": ".venv/\n",
        ".agentbox/Boxfile.toml": _boxfile(mark, key),
    })  # fmt: skip
    return str(path)


def test_no_environment_crosses_repos_or_users(env_lab: Callable[..., EnvLab]) -> None:
    from pathlib import Path

    lab = env_lab("envscope", SCRIPT)
    evil = Path(_repo(lab, "evil", "e", _build("evil", " && echo x > .venv/evil.py")))
    good = Path(_repo(lab, "good", "g", _build("good")))
    first = lab.run("scope-evil", evil, 300.0)
    assert first.info.status == "done", first.info.error
    assert first.setup["cache"] == "miss"
    assert "MARK=e-evil" in first.agent_log() and "ENTRY=evil.py" in first.agent_log()
    # Another repo, same [setup] and requirements.txt: its own setup, its own .venv.
    second = lab.run("scope-good", good, 300.0)
    assert second.info.status == "done", second.info.error
    assert second.setup["cache"] == "miss" and second.setup["key"] != first.setup["key"]
    log = second.agent_log()
    assert "MARK=g-good" in log and "evil" not in log.replace("scope-evil", "")
    # The first repo again: its own environment, reused.
    again = lab.run("scope-evil2", evil, 300.0)
    assert again.setup["cache"] == "hit" and again.setup["key"] == first.setup["key"]
    assert "MARK=e-evil" in again.agent_log()
    # One repo (keyed on its whole tree, the default), two users: the owner's task (and
    # its hit), then root's, a setup of its own.
    mine = Path(_repo(lab, "mine", "m", _build("mine"), key="tree"))
    subprocess.run(["chown", "-R", "-h", f"{USER}:{USER}", str(mine)], check=True)
    by_owner = lab.run("scope-owner", mine, 300.0, caller=USER)
    assert by_owner.info.status == "done", by_owner.info.error
    assert by_owner.setup["cache"] == "miss"
    owner_again = lab.run("scope-owner2", mine, 300.0, caller=USER)
    assert owner_again.setup["cache"] == "hit", owner_again.info.error
    by_root = lab.run("scope-root", mine, 300.0)
    assert by_root.info.status == "done", by_root.info.error
    assert by_root.setup["cache"] == "miss" and by_root.setup["key"] != by_owner.setup["key"]
    assert "MARK=m-mine" in by_root.agent_log()
