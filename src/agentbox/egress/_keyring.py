"""A pip index's password from the host user's keyring, read as that user.

pip looks a password up in the ``keyring`` library when its index URL has none
(``index-url = https://alice@pypi.corp.example/simple/``, the password kept by
``keyring set``): first under the index URL, then under its ``host[:port]``. This
module asks the same questions, in a child process running as the user (their uid,
gid, no other groups, their ``HOME``): the user's own ``python3`` with the user's
own ``keyring`` and backend configuration (``~/.config/python_keyring/keyringrc.cfg``),
else a ``keyring`` command on their ``PATH`` or in ``~/.local/bin`` (pipx). A backend
that needs the user's D-Bus session (the Secret Service) gets it when the user has
one running (``/run/user/UID/bus``). Nothing runs as root for another user; where no
backend answers, nothing is brokered. The child's output holds passwords: it is
parsed here and never logged.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from agentbox.core.log import get_logger

log = get_logger(__name__)

#: A keyring backend may wait on a locked wallet: bounded, then nothing is brokered.
KEYRING_TIMEOUT = 20.0

#: Runs in the user's python3 (their site-packages: a ``pip install --user keyring``
#: counts). stdin: ``[[service URL, host[:port], username or null], …]``.
_LOOKUP = r"""
import json, sys
asks = json.load(sys.stdin)
try:
    import keyring
except Exception:
    json.dump({"keyring": False}, sys.stdout)
    raise SystemExit(0)
found = {}
for url, netloc, user in asks:
    for service in (url, netloc):
        cred = None
        try:
            cred = keyring.get_credential(service, user)
        except Exception:
            cred = None
        if cred is not None and cred.password:
            found[url] = [cred.username or user or "", cred.password]
            break
        if user:
            try:
                password = keyring.get_password(service, user)
            except Exception:
                password = None
            if password:
                found[url] = [user, password]
                break
json.dump({"keyring": True, "found": found}, sys.stdout)
"""

#: (argv, env, stdin, timeout) -> the finished child, run as the user.
Runner = Callable[[list[str], dict[str, str], str, float], subprocess.CompletedProcess[str]]


def keyring_env(uid: int, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` plus the user's D-Bus session bus, if they have one running."""
    out = dict(env)
    bus = Path(f"/run/user/{uid}/bus")
    if "DBUS_SESSION_BUS_ADDRESS" not in out and bus.is_socket():
        out["DBUS_SESSION_BUS_ADDRESS"] = f"unix:path={bus}"
    return out


def keyring_credentials(
    asks: Sequence[tuple[str, str, str | None]], env: Mapping[str, str], run: Runner
) -> dict[str, tuple[str, str]]:
    """``service URL -> (username, password)`` for each ask the user's keyring answers.

    ``asks``: (index URL without credentials, its ``host[:port]``, the URL's username or
    None). ``run`` runs a command as the user (the caller's ``_run_as``).
    """
    if not asks:
        return {}
    found: dict[str, tuple[str, str]] = {}
    work = dict(env)
    py = shutil.which("python3", path=work.get("PATH", ""))
    has_library = False
    if py:
        try:
            res = run([py, "-c", _LOOKUP], work, json.dumps(list(asks)), KEYRING_TIMEOUT)
            data = json.loads(res.stdout) if res.returncode == 0 else {}
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            log.info("the user's keyring did not answer", error=type(exc).__name__)
            data = {}
        has_library = bool(isinstance(data, dict) and data.get("keyring"))
        got = data.get("found") if isinstance(data, dict) else None
        if isinstance(got, dict):
            for url, pair in got.items():
                if (
                    isinstance(url, str)
                    and isinstance(pair, list)
                    and len(pair) == 2
                    and all(isinstance(x, str) for x in pair)
                ):
                    found[url] = (pair[0], pair[1])
    if has_library:
        return found
    # No library for python3: a keyring command (pipx's) answers get SERVICE USER.
    home = work.get("HOME", "/nonexistent")
    cli = shutil.which("keyring", path=f"{work.get('PATH', '')}:{home}/.local/bin")
    if cli is None:
        return found
    for url, netloc, user in asks:
        if user is None or url in found:
            continue
        for service in (url, netloc):
            try:
                res = run([cli, "get", service, user], work, "", KEYRING_TIMEOUT)
            except (OSError, subprocess.SubprocessError) as exc:
                log.info("the user's keyring command did not answer", error=type(exc).__name__)
                break
            password = res.stdout.rstrip("\n")
            if res.returncode == 0 and password:
                found[url] = (user, password)
                break
    return found


def owner_runner(uid: int, run_as: Callable[..., subprocess.CompletedProcess[str]]) -> Runner:
    """A :data:`Runner` that runs as ``uid`` through ``run_as(uid, argv, env, stdin=…)``."""

    def run(
        argv: list[str], env: dict[str, str], stdin: str, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        return run_as(uid, argv, env, stdin=stdin, timeout=timeout)

    return run
