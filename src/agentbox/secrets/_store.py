"""The host's secret store: one JSON file per owner uid under ``<data_dir>/secrets/``.

Root-only: the dir is 0700 and each file 0600, both owned by root (the launcher's
identity); users reach their own secrets through the launcher's socket, which names the
owner by the peer's uid (``SO_PEERCRED``), never by a field of the request. A file is
replaced whole (a temp file, fsync, rename, fsync of the dir) under an ``flock`` of the
dir's lock file, so a reader sees the old store or the new one, never half of one.
A value is never logged, put in an error, or returned by :meth:`SecretStore.list`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import secrets as _random
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentbox.config import Settings
from agentbox.errors import InvalidValue, SecretNotFound, SecretStoreError
from agentbox.secrets._refs import check_name, find_refs

#: The longest value, in UTF-8 bytes: a header's worth (tokens are far shorter).
MAX_VALUE = 8192
_FORMAT = 1
_MAX_FILE = 4 << 20  # a store file past this is not one of ours


def check_value(value: str) -> str:
    """``value`` if it may be stored: non-empty, at most :data:`MAX_VALUE` UTF-8 bytes,
    no control characters (a CR or LF would split the header it is injected into).
    The error never quotes the value."""
    if not isinstance(value, str) or not value:
        raise InvalidValue([("secret value", "is empty")])
    if len(value.encode("utf-8", "surrogatepass")) > MAX_VALUE:
        raise InvalidValue([("secret value", f"is longer than {MAX_VALUE} bytes")])
    bad = [c for c in value if ord(c) < 0x20 or ord(c) == 0x7F or 0xD800 <= ord(c) <= 0xDFFF]
    if bad:
        raise InvalidValue(
            [("secret value", "has a control character (a newline, tab, NUL…): one line of text")]
        )
    return value


@dataclass(frozen=True)
class SecretInfo:
    """What may be shown of a secret: never its value."""

    name: str
    owner_uid: int
    owner_name: str
    set_at: float
    shared: bool


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _check_uid(uid: int) -> int:
    if not isinstance(uid, int) or isinstance(uid, bool) or not 0 <= uid < 2**32 - 1:
        raise InvalidValue([("owner uid", f"{uid!r:.20} is not a uid")])
    return uid


class SecretStore:
    """The secrets of one host (``settings.data_dir / "secrets"``)."""

    def __init__(self, settings: Settings) -> None:
        self.root = settings.data_dir / "secrets"

    # -- the dir and its files ------------------------------------------------------------

    def _ensure(self) -> Path:
        try:
            if not self.root.parent.exists():
                self.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                self.root.mkdir(mode=0o700)
            st = self.root.lstat()
        except OSError as exc:
            raise SecretStoreError(
                f"cannot make the secret store {self.root}: {exc.strerror}"
            ) from exc
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise SecretStoreError(
                f"the secret store {self.root} is not a directory owned by uid {os.geteuid()} "
                "(secrets are root's: run as root, or through the launcher)"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            self.root.chmod(0o700)
        return self.root

    def _file(self, uid: int) -> Path:
        return self.root / f"{_check_uid(uid)}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        root = self._ensure()
        fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read(self, uid: int) -> dict[str, dict[str, Any]]:
        path = self._file(uid)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise SecretStoreError(f"cannot open {path}: {exc.strerror}") from exc
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > _MAX_FILE:
                raise SecretStoreError(f"{path} is not a secret file of ours")
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.fchmod(fh.fileno(), 0o600)
            raw = fh.read(_MAX_FILE + 1)
        try:
            data = json.loads(raw)
            entries = data["secrets"]
            if (
                data.get("format") != _FORMAT
                or data.get("uid") != uid
                or not isinstance(entries, dict)
            ):
                raise ValueError
            for name, entry in entries.items():
                check_name(name)
                if not isinstance(entry.get("value"), str) or not isinstance(
                    entry.get("set_at"), int | float
                ):
                    raise ValueError
        except (ValueError, KeyError, TypeError, AttributeError):
            # No detail: the parser's message could quote a value.
            raise SecretStoreError(f"{path} is not a secret file (format {_FORMAT})") from None
        return entries

    def _write(self, uid: int, entries: dict[str, dict[str, Any]]) -> None:
        path = self._file(uid)
        if not entries:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self._sync_dir()
            return
        body = json.dumps(
            {"format": _FORMAT, "uid": uid, "secrets": entries}, indent=1, sort_keys=True
        )
        tmp = self.root / f".{uid}.{_random.token_hex(6)}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(body)
                fh.flush()
                os.fsync(fh.fileno())
            tmp.replace(path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._sync_dir()

    def _sync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _owners(self) -> list[int]:
        out = []
        for p in self._ensure().iterdir():
            stem = p.name.removesuffix(".json")
            if p.name.endswith(".json") and stem.isdigit():
                out.append(int(stem))
        return sorted(out)

    # -- the API --------------------------------------------------------------------------

    def set(self, name: str, value: str, owner_uid: int, shared: bool = False) -> SecretInfo:
        """Store ``value`` as ``owner_uid``'s secret ``name`` (replacing one of that name).

        ``shared`` (root only) lets every user's tasks use it when they have none of that name.
        """
        check_name(name)
        check_value(value)
        _check_uid(owner_uid)
        if shared and owner_uid != 0:
            raise InvalidValue([("shared", "only root's secrets can be shared")])
        now = time.time()
        with self._locked():
            entries = self._read(owner_uid)
            entries[name] = {"value": value, "set_at": now, "shared": bool(shared)}
            self._write(owner_uid, entries)
        return SecretInfo(name, owner_uid, _user_name(owner_uid), now, bool(shared))

    def remove(self, name: str, owner_uid: int) -> SecretInfo:
        """Remove ``owner_uid``'s secret ``name`` (what it was, without the value);
        :class:`SecretNotFound` if it has none. Root's shared one is root's to remove."""
        check_name(name)
        with self._locked():
            entries = self._read(owner_uid)
            gone = entries.pop(name, None)
            if gone is None:
                raise SecretNotFound(name, uid=owner_uid)
            self._write(owner_uid, entries)
        return SecretInfo(
            name, owner_uid, _user_name(owner_uid), float(gone["set_at"]), bool(gone.get("shared"))
        )

    def list(self, uid: int, *, all_users: bool = False) -> list[SecretInfo]:
        """The secrets ``uid``'s tasks can use (its own, then root's shared ones it does not
        shadow), sorted by name; ``all_users`` (for root): every owner's. Never a value."""
        _check_uid(uid)
        with self._locked():
            owners = self._owners() if all_users else sorted({uid, 0})
            found: list[SecretInfo] = []
            for owner in owners:
                for name, e in self._read(owner).items():
                    shared = bool(e.get("shared"))
                    if not all_users and owner != uid and not shared:
                        continue
                    found.append(
                        SecretInfo(name, owner, _user_name(owner), float(e["set_at"]), shared)
                    )
        if not all_users:
            own = {i.name for i in found if i.owner_uid == uid}
            found = [i for i in found if i.owner_uid == uid or i.name not in own]
        return sorted(found, key=lambda i: (i.name, i.owner_uid))

    def resolve(self, names: Iterable[str], owner_uid: int) -> dict[str, str]:
        """The values of ``names`` for a task of ``owner_uid``: its own secret of each name,
        else root's shared one. :class:`SecretNotFound` names the first missing one."""
        _check_uid(owner_uid)
        wanted = [check_name(n) for n in names]
        if not wanted:
            return {}
        with self._locked():
            own = self._read(owner_uid)
            shared = {} if owner_uid == 0 else self._read(0)
        out: dict[str, str] = {}
        for name in wanted:
            if name in own:
                out[name] = own[name]["value"]
            elif name in shared and shared[name].get("shared"):
                out[name] = shared[name]["value"]
            else:
                raise SecretNotFound(name, uid=owner_uid)
        return out


def resolve_for_task(
    settings: Settings, owner_uid: int, templates: Iterable[str]
) -> dict[str, str]:
    """Every secret the ``templates`` (inject values) reference, resolved for a task whose
    owner is ``owner_uid`` (the submitter's uid as the launcher's socket saw it)."""
    names: list[str] = []
    for t in templates:
        names.extend(n for n in find_refs(t) if n not in names)
    return SecretStore(settings).resolve(names, owner_uid)
