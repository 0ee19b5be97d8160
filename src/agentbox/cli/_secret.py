"""``agentbox secret set|ls|rm``: secrets kept on the host for egress rules to inject.

Root works on the store directly; any other user goes through the launcher's socket,
where the owner of a secret is the caller's uid as the kernel reports it. A value is
read from stdin (without echo on a terminal), an environment variable or a file, and
is never printed: ``ls`` shows names, owners and times only.
"""

from __future__ import annotations

import getpass
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from agentbox.config import Settings, load_settings
from agentbox.core.console import console as make_console
from agentbox.core.text import visible
from agentbox.errors import InvalidValue, RefusedError
from agentbox.secrets import MAX_VALUE, SecretStore, check_name, check_value

console = make_console(highlight=False)


def _strip_newline(text: str) -> str:
    """One trailing line end off (``echo tok | agentbox secret set X`` means ``tok``)."""
    for end in ("\r\n", "\n"):
        if text.endswith(end):
            return text[: -len(end)]
    return text


def read_value(name: str, from_env: str | None, from_file: Path | None) -> str:
    """The value to store: from ``$from_env``, the file ``from_file``, or stdin (a prompt
    without echo on a terminal). Checked, never quoted in an error."""
    if from_env is not None and from_file is not None:
        raise InvalidValue([("secret value", "give one of --from-env and --from-file")])
    if from_env is not None:
        if from_env not in os.environ:
            raise InvalidValue([("--from-env", f"{from_env!r:.80} is not set")])
        value = os.environ[from_env]
    elif from_file is not None:
        try:
            with from_file.open("rb") as fh:
                raw = fh.read(MAX_VALUE + 3)
        except OSError as exc:
            raise InvalidValue([("--from-file", f"{from_file}: {exc.strerror}")]) from None
        value = _strip_newline(_decode(raw))
    elif sys.stdin.isatty():
        value = getpass.getpass(f"value of {name} (not echoed): ")
    else:
        value = _strip_newline(_decode(sys.stdin.buffer.read(MAX_VALUE + 3)))
    return check_value(value)


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidValue([("secret value", "is not UTF-8 text")]) from None


def _client(settings: Settings) -> Any:
    """A client of the launcher service (a non-root caller's only way to the store)."""
    from agentbox.cli._client import service_socket
    from agentbox.core.wait import socket_accepts
    from agentbox.launcher.client import LauncherClient

    path = service_socket(settings)
    if not socket_accepts(path):
        raise RefusedError(
            f"no launcher answers at {path}: a user's secrets are kept by root's launcher "
            "(ask root to run `agentbox launcher serve`; its data dir, /var/lib/agentbox by "
            "default, is found from AGENTBOX_DATA_DIR or data_dir in /etc/agentbox/config.toml)"
        )
    return LauncherClient(path, timeout=30.0, reconnect=5.0)


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def register(app: typer.Typer) -> None:
    """Add ``agentbox secret`` to ``app``."""
    secret_app = typer.Typer(help="Secrets on the host, injected by egress rules (set, ls, rm).")
    app.add_typer(secret_app, name="secret")

    @secret_app.command("set")
    def set_(
        name: Annotated[str, typer.Argument(help="The secret's name: A-Z, 0-9, _.")],
        from_env: Annotated[
            str | None, typer.Option("--from-env", help="Read the value from this variable.")
        ] = None,
        from_file: Annotated[
            Path | None, typer.Option("--from-file", help="Read the value from this file.")
        ] = None,
        shared: Annotated[
            bool, typer.Option("--shared", help="Root only: every user's tasks may use it.")
        ] = False,
    ) -> None:
        """Store a secret: its value from stdin (no echo on a tty), --from-env or --from-file."""
        check_name(name)
        if shared and os.geteuid() != 0:
            raise RefusedError("only root can share a secret (--shared)")
        value = read_value(name, from_env, from_file)
        settings = load_settings()
        if os.geteuid() == 0:
            info = SecretStore(settings).set(name, value, 0, shared=shared)
            owner = info.owner_name
        else:
            with _client(settings) as client:
                owner = client.secret_set(name, value, shared=shared).owner_name
        what = "shared secret" if shared else "secret"
        console.print(Text(visible(f"{what} {name} set for {owner}")))

    @secret_app.command("ls")
    def ls(
        as_json: Annotated[bool, typer.Option("--json")] = False,
        every: Annotated[
            bool, typer.Option("--all", help="Root only: every user's secrets.")
        ] = False,
    ) -> None:
        """List the secrets your tasks can use: names, owners, when set; never values."""
        settings = load_settings()
        if os.geteuid() == 0:
            rows = [
                (i.name, i.owner_uid, i.owner_name, i.set_at, i.shared)
                for i in SecretStore(settings).list(0, all_users=every)
            ]
        else:
            if every:
                raise RefusedError("only root lists every user's secrets (--all)")
            with _client(settings) as client:
                rows = [
                    (e.name, e.owner_uid, e.owner_name, e.set_at, e.shared)
                    for e in client.secret_list()
                ]
        if as_json:
            keys = ("name", "owner_uid", "owner", "set_at", "shared")
            print(json.dumps([dict(zip(keys, r, strict=True)) for r in rows], indent=2))
            return
        table = Table(box=None)
        for col in ("name", "owner", "shared", "set"):
            table.add_column(col)
        for name, _uid, owner, set_at, is_shared in rows:
            stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(set_at))
            table.add_row(name, Text(visible(owner)), "yes" if is_shared else "",
                          f"{stamp} ({_ago(set_at)})")  # fmt: skip
        console.print(table)
        console.print(f"{len(rows)} secret(s)")

    @secret_app.command("rm")
    def rm(name: Annotated[str, typer.Argument(help="The secret's name.")]) -> None:
        """Remove one of your secrets (root: a shared one too)."""
        check_name(name)
        settings = load_settings()
        if os.geteuid() == 0:
            SecretStore(settings).remove(name, 0)
        else:
            with _client(settings) as client:
                client.secret_remove(name)
        console.print(f"secret {name} removed")
