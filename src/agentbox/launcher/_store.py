"""Task state in SQLite (stdlib ``sqlite3``, WAL mode) in the data dir.

Several processes may use the same store at once (an ``agentbox run``, a
``launcher serve``, ``agentbox tasks``), so every operation is one statement on a
connection with a busy timeout (each thread keeps its own for its life), and state
changes are single UPDATE statements guarded by the status they expect
(compare-and-set), never read-modify-write.

Each running task records its *owner* (pid and process start time): a
restarted launcher reconciles only tasks whose owner is gone. Each task also
records its *caller* (``caller_uid``, the uid that submitted it): a non-root
caller of the socket API sees only its own. A database from before that column
gets it added, NULL in its old rows: those tasks are visible to root only.

The schema is versioned (``PRAGMA user_version``, :data:`SCHEMA_VERSION`) so a
launcher of the next version re-adopts the tasks of the previous one: opening a
store runs each migration from the database's version up to ours, in one
transaction; a database of a *newer* version is refused (a downgraded launcher
would misread it). Version 0 is every database made before versioning (columns
were then added ad hoc), 1 that schema complete, 2 adds what re-adopting a
running task needs (:attr:`TaskRow.stage`, the sandbox's labels and log, the
deadline as an epoch), 3 the count of re-adoptions, 4 a task's group and attempt
index (best-of-N: :mod:`agentbox.launcher.attempts`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from agentbox.errors import (
    ConfigError,
    StoreUnreadable,
    TaskIdRefused,
    TaskNotFound,
)
from agentbox.launcher.api import TaskInfo, TokenUsage

#: The schema this code reads and writes (``PRAGMA user_version``).
SCHEMA_VERSION = 4

#: Columns that are progress notes only (``phase``: the transcript's last line, rewritten
#: at every step of a task). An update of notes alone is committed without waiting for
#: the disk (``synchronous=NORMAL``; in WAL mode still atomic and in order, on disk with
#: the next synced commit or checkpoint): a power cut may lose the newest note, never a
#: state change. Every other update (status, owner, sandbox, result...) is synced before
#: it returns, as before. A note's sync cost more than the rest of its update (~4 ms).
NOTES = frozenset({"phase"})

#: Where a non-terminal task is, finer than its status (None: queued, nothing done).
#: ``preparing``: task dir, workspace, gateway, setup; nothing of the agent ran (a
#: launcher that dies here leaves a task the next one runs again, from scratch).
#: ``attached``: the agent's sandbox runs held by its launcher (not adoptable).
#: ``launched``: the sandbox runs detached; everything re-adoption checks is recorded.
Stage = str

_SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    repo TEXT NOT NULL,
    task TEXT NOT NULL,
    model TEXT NOT NULL,
    budget INTEGER NOT NULL,
    deadline REAL NOT NULL,
    include_uncommitted INTEGER NOT NULL DEFAULT 0,
    publish INTEGER NOT NULL DEFAULT 1,
    boxfile TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    exit_code INTEGER,
    tokens TEXT,
    branch TEXT,
    commit_id TEXT,
    error TEXT,
    sandbox TEXT,
    backend TEXT,
    owner_pid INTEGER,
    owner_start REAL,
    gateway_pid INTEGER,
    gateway_start REAL,
    watchdog_pid INTEGER,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    phase TEXT,
    changed INTEGER,
    caller_uid INTEGER
);
"""
#: Columns added to the first schema before versioning; a version-0 database may lack them.
_ADDED_V1 = (("phase", "TEXT"), ("changed", "INTEGER"), ("caller_uid", "INTEGER"))


def _to_v1(db: sqlite3.Connection) -> None:
    db.execute(_SCHEMA_V1)  # one statement: executescript would COMMIT the migration
    have = {r[1] for r in db.execute("PRAGMA table_info(tasks)")}
    for name, kind in _ADDED_V1:
        if name not in have:
            db.execute(f"ALTER TABLE tasks ADD COLUMN {name} {kind}")


def _to_v2(db: sqlite3.Connection) -> None:
    for col in ("stage TEXT", "runtime TEXT", "labels TEXT", "sandbox_log TEXT",
                "deadline_at REAL", "outcome TEXT"):  # fmt: skip
        db.execute(f"ALTER TABLE tasks ADD COLUMN {col}")
    # A running task of a version-1 launcher ran attached, under its watchdog.
    db.execute("UPDATE tasks SET stage = 'attached' WHERE status IN ('running', 'collecting')")


def _to_v3(db: sqlite3.Connection) -> None:
    db.execute("ALTER TABLE tasks ADD COLUMN adoptions INTEGER NOT NULL DEFAULT 0")
    db.execute("CREATE INDEX IF NOT EXISTS tasks_created ON tasks (created_at)")


def _to_v4(db: sqlite3.Connection) -> None:
    # Best-of-N: the group a task is an attempt of, and its index (1-based) in it.
    db.execute("ALTER TABLE tasks ADD COLUMN group_id TEXT")
    db.execute("ALTER TABLE tasks ADD COLUMN attempt INTEGER")
    db.execute("CREATE INDEX IF NOT EXISTS tasks_group ON tasks (group_id)")


#: ``_MIGRATIONS[v]`` takes a database from version ``v`` to ``v + 1``.
_MIGRATIONS = (_to_v1, _to_v2, _to_v3, _to_v4)
assert len(_MIGRATIONS) == SCHEMA_VERSION


def migrate(db: sqlite3.Connection, *, path: Path, upto: int = SCHEMA_VERSION) -> int:
    """Bring the open database to version ``upto``, in one transaction; return the version
    it had. :class:`ConfigError` for a database newer than this code."""
    db.execute("BEGIN IMMEDIATE")  # one migrator at a time; others wait, then see it done
    try:
        old = int(db.execute("PRAGMA user_version").fetchone()[0])
        if old > SCHEMA_VERSION:
            raise ConfigError(
                f"the task store {path} is schema version {old}; this agentbox reads up to "
                f"{SCHEMA_VERSION}: run the newer agentbox that wrote it"
            )
        for version in range(old, upto):
            _MIGRATIONS[version](db)
        if upto > old:
            db.execute(f"PRAGMA user_version = {int(upto)}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return old


@dataclass(frozen=True)
class Owner:
    """A process, named by pid and start time so a recycled pid is not mistaken for it."""

    pid: int
    start: float

    @classmethod
    def me(cls) -> Owner:
        return cls.of(os.getpid()) or cls(os.getpid(), 0.0)

    @classmethod
    def of(cls, pid: int) -> Owner | None:
        try:
            return cls(pid, psutil.Process(pid).create_time())
        except (psutil.Error, ValueError):
            return None

    def alive(self) -> bool:
        """True while the very process (same pid, same start time) runs and is no zombie."""
        try:
            proc = psutil.Process(self.pid)
            if abs(proc.create_time() - self.start) > 0.01:
                return False
            return proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


@dataclass(frozen=True)
class TaskRow:
    """One row of the tasks table."""

    id: str
    status: str
    repo: str
    task: str
    model: str
    budget: int
    deadline: float
    include_uncommitted: bool
    publish: bool
    boxfile: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    exit_code: int | None
    tokens: TokenUsage
    branch: str | None
    commit_id: str | None
    error: str | None
    sandbox: str | None
    backend: str | None
    owner: Owner | None
    gateway: Owner | None
    watchdog_pid: int | None
    cancel_requested: bool
    phase: str = ""
    changed: bool | None = None
    """Whether collection found changes (None: not collected); False: no branch."""
    caller_uid: int | None = None
    """The uid that submitted the task (None: recorded before uids were; root's to see)."""
    stage: Stage | None = None
    """Finer than ``status`` while it runs (see :data:`Stage`)."""
    runtime: str | None = None
    labels: dict[str, str] | None = None
    """The labels its sandbox was launched with (re-adoption checks them)."""
    sandbox_log: str | None = None
    deadline_at: float | None = None
    """Unix time at which its sandbox's deadline passes."""
    outcome: str | None = None
    """How the agent ended (JSON), recorded before collection (re-collected from it)."""
    adoptions: int = 0
    """How many launchers re-adopted it after the one running it died."""
    group_id: str | None = None
    """The group it is an attempt of (best-of-N), or None."""
    attempt: int | None = None
    """Its index (1-based) in that group."""

    def info(self, tokens: TokenUsage | None = None) -> TaskInfo:
        """The public view of this row (``tokens`` overrides the stored totals)."""
        return TaskInfo(
            id=self.id,
            status=self.status,  # type: ignore[arg-type]
            repo=self.repo,
            task=self.task,
            model=self.model,
            budget=self.budget,
            deadline=self.deadline,
            created_at=self.created_at,
            started_at=self.started_at,
            finished_at=self.finished_at,
            exit_code=self.exit_code,
            tokens=tokens or self.tokens,
            branch=self.branch,
            changed=self.changed,
            error=self.error,
            phase=self.phase,
            uid=self.caller_uid,
            group=self.group_id,
            attempt=self.attempt,
            backend=(where := self.placement())["backend"],
            runtime=where["runtime"],
        )

    def placement(self) -> dict[str, str | None]:
        """``backend`` and ``runtime`` the task runs on, from its recorded Boxfile
        (``runtime`` None on a backend that runs no OCI runtime)."""
        box: dict[str, object] = {}
        with contextlib.suppress(ValueError, TypeError):
            loaded = json.loads(self.boxfile or "{}")
            box = loaded if isinstance(loaded, dict) else {}
        backend = self.backend or box.get("backend")
        runtime = self.runtime or box.get("runtime")
        if isinstance(backend, str):
            from agentbox.backends import backend_class
            from agentbox.errors import AgentboxError

            with contextlib.suppress(AgentboxError):
                if not backend_class(backend).runtimes:
                    runtime = None  # a microVM runs no OCI runtime: the field is ignored
        return {
            "backend": backend if isinstance(backend, str) else None,
            "runtime": runtime if isinstance(runtime, str) else None,
        }


def _tokens(raw: str | None) -> TokenUsage:
    if not raw:
        return TokenUsage()
    try:
        return TokenUsage.model_validate(json.loads(raw), strict=False)
    except ValueError:
        return TokenUsage()


def _row(r: sqlite3.Row) -> TaskRow:
    owner = Owner(r["owner_pid"], r["owner_start"] or 0.0) if r["owner_pid"] else None
    gw = Owner(r["gateway_pid"], r["gateway_start"] or 0.0) if r["gateway_pid"] else None
    return TaskRow(
        id=r["id"],
        status=r["status"],
        repo=r["repo"],
        task=r["task"],
        model=r["model"],
        budget=r["budget"],
        deadline=r["deadline"],
        include_uncommitted=bool(r["include_uncommitted"]),
        publish=bool(r["publish"]),
        boxfile=r["boxfile"],
        created_at=r["created_at"],
        started_at=r["started_at"],
        finished_at=r["finished_at"],
        exit_code=r["exit_code"],
        tokens=_tokens(r["tokens"]),
        branch=r["branch"],
        commit_id=r["commit_id"],
        error=r["error"],
        sandbox=r["sandbox"],
        backend=r["backend"],
        owner=owner,
        gateway=gw,
        watchdog_pid=r["watchdog_pid"],
        cancel_requested=bool(r["cancel_requested"]),
        phase=r["phase"] or "",
        changed=None if r["changed"] is None else bool(r["changed"]),
        caller_uid=r["caller_uid"],
        stage=r["stage"],
        runtime=r["runtime"],
        labels=_labels(r["labels"]),
        sandbox_log=r["sandbox_log"],
        deadline_at=r["deadline_at"],
        outcome=r["outcome"],
        adoptions=r["adoptions"] or 0,
        group_id=r["group_id"],
        attempt=r["attempt"],
    )


def _labels(raw: str | None) -> dict[str, str] | None:
    try:
        got = json.loads(raw) if raw else None
    except ValueError:
        return None
    if not isinstance(got, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in got.items()
    ):
        return None
    return got


def _private(path: Path) -> None:
    """Create ``path`` 0600 if it is missing, before SQLite does: SQLite makes its
    ``-wal`` and ``-shm`` files with the database's mode, and a database born under the
    usual umask (0644) gave every local user the log of recent tasks' texts."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))


class _Held:
    """One thread's connection to the store, closed when the thread (or the store) goes."""

    def __init__(self, path: Path) -> None:
        # Not checked against the thread: the store's last reference, and so this
        # close, may go in another thread; only the owning thread ever uses it.
        self.db = sqlite3.connect(path, timeout=30.0, isolation_level=None,
                                  check_same_thread=False)  # fmt: skip
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA busy_timeout=30000")
        self.synced = True

    def close(self) -> None:
        db = getattr(self, "db", None)  # None: the connect itself failed
        if db is not None:
            with contextlib.suppress(sqlite3.Error):
                db.close()

    def __del__(self) -> None:
        self.close()


class Store:
    """The tasks table in ``data_dir/state.db``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # Each thread's own connection, kept for the thread's life: a connection opened
        # per operation synced the directory at its first commit (SQLite makes a newly
        # opened log's name durable), doubling the syncs of every state change.
        self._local = threading.local()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _private(path)
            with self._conn() as db:
                db.execute("PRAGMA journal_mode=WAL")
                migrate(db, path=path)
        except (sqlite3.Error, OSError) as exc:
            # One line, never a traceback: a non-root `agentbox rm` on
            # root's data dir.
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            who = "" if os.geteuid() == 0 else f" (uid {os.geteuid()} may not: run this as root)"
            raise StoreUnreadable(f"cannot open the task store {path}: {why}{who}") from None
        for name in (path.name, f"{path.name}-wal", f"{path.name}-shm"):
            with contextlib.suppress(OSError):  # whatever mode a umask gave it
                (path.parent / name).chmod(0o600)
        # Held open (never used) for the store's life: whenever the last connection to a
        # WAL database closes, SQLite checkpoints the log into the db and deletes it,
        # syncing both and the dir; each short-lived connection below would be that last
        # one (about 30 extra syncs per task). Commits stay synced as before.
        keep = sqlite3.connect(path, check_same_thread=False)
        keep.execute("PRAGMA schema_version").fetchone()  # opened for real: lazy before
        self._keep: sqlite3.Connection | None = keep

    def close(self) -> None:
        """Let go of the held connection and this thread's (the next use still works);
        idempotent. Another thread's connection goes when that thread ends."""
        keep, self._keep = self._keep, None
        if keep is not None:
            keep.close()
        held = getattr(self._local, "held", None)
        self._local.held = None
        if held is not None:
            held.close()

    @contextlib.contextmanager
    def _conn(self, *, synced: bool = True) -> Iterator[sqlite3.Connection]:
        held: _Held | None = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = _Held(self.path)
        if held.synced != synced:  # a note (see NOTES): committed, not waited for on disk
            held.db.execute(f"PRAGMA synchronous={'FULL' if synced else 'NORMAL'}")
            held.synced = synced
        yield held.db

    def insert(self, **fields: Any) -> None:
        """Insert a new task; :class:`TaskIdRefused` if the id is taken."""
        cols = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        try:
            with self._conn() as db:
                db.execute(f"INSERT INTO tasks ({cols}) VALUES ({marks})", tuple(fields.values()))  # noqa: S608
        except sqlite3.IntegrityError as exc:
            raise TaskIdRefused(f"a task with the id {fields.get('id')} exists") from exc

    def get(self, task_id: str) -> TaskRow:
        with self._conn() as db:
            r = db.execute("SELECT * FROM tasks WHERE id = ?", (task_id,)).fetchone()
        if r is None:
            raise TaskNotFound("no such task", task_id=task_id)
        return _row(r)

    def exists(self, task_id: str) -> bool:
        with self._conn() as db:
            return db.execute("SELECT 1 FROM tasks WHERE id = ?", (task_id,)).fetchone() is not None

    def all(self, *, caller_uid: int | None = None) -> list[TaskRow]:
        """Every task, newest first; with ``caller_uid``, only the tasks that uid submitted."""
        with self._conn() as db:
            if caller_uid is None:
                rows = db.execute(
                    "SELECT * FROM tasks ORDER BY created_at DESC, rowid DESC"
                ).fetchall()
            else:
                rows = db.execute(
                    "SELECT * FROM tasks WHERE caller_uid = ? ORDER BY created_at DESC",
                    (caller_uid,),
                ).fetchall()
        return [_row(r) for r in rows]

    def group(self, group_id: str) -> list[TaskRow]:
        """The attempts of group ``group_id`` (best-of-N), by attempt index; [] if none."""
        with self._conn() as db:
            rows = db.execute(
                "SELECT * FROM tasks WHERE group_id = ? ORDER BY attempt", (group_id,)
            ).fetchall()
        return [_row(r) for r in rows]

    def update(
        self, task_id: str, *, expect: set[str] | None = None, unstaged: bool = False, **fields: Any
    ) -> bool:
        """Set ``fields`` if its status is one of ``expect`` (``unstaged``: and no worker took it,
        stage NULL); True if done. Synced unless every field is a note (:data:`NOTES`)."""
        if "tokens" in fields and isinstance(fields["tokens"], TokenUsage):
            fields["tokens"] = fields["tokens"].model_dump_json()
        if isinstance(fields.get("labels"), dict):
            fields["labels"] = json.dumps(fields["labels"], sort_keys=True)
        sets = ", ".join(f"{k} = ?" for k in fields)
        sql = f"UPDATE tasks SET {sets} WHERE id = ?"  # noqa: S608
        args: list[Any] = [*fields.values(), task_id]
        if expect:
            sql += f" AND status IN ({', '.join('?' for _ in expect)})"
            args.extend(sorted(expect))
        sql += " AND stage IS NULL" if unstaged else ""
        with self._conn(synced=not fields.keys() <= NOTES) as db:
            return db.execute(sql, args).rowcount == 1

    def claim(self, task_id: str, old: Owner | None, new: Owner) -> bool:
        """Make ``new`` the owner if ``old`` still is (one of several reconcilers wins)."""
        with self._conn() as db:
            cur = db.execute(
                "UPDATE tasks SET owner_pid = ?, owner_start = ? "
                "WHERE id = ? AND owner_pid IS ? AND owner_start IS ?",
                (new.pid, new.start, task_id, old.pid if old else None, old.start if old else None),
            )
            return cur.rowcount == 1

    def delete(self, task_id: str, *, expect: set[str]) -> bool:
        """Delete the task's row if its status is one of ``expect`` (compare-and-set)."""
        marks = ", ".join("?" for _ in expect)
        sql = f"DELETE FROM tasks WHERE id = ? AND status IN ({marks})"  # noqa: S608
        with self._conn() as db:
            return db.execute(sql, (task_id, *sorted(expect))).rowcount == 1

    def finish(self, task_id: str, status: str, **fields: Any) -> bool:
        """Move a non-terminal task to terminal ``status``; False if it already was terminal."""
        return self.update(
            task_id,
            expect={"queued", "running", "collecting"},
            status=status,
            finished_at=fields.pop("finished_at", time.time()),
            **fields,
        )
