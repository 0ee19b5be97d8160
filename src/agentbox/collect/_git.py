"""Running git safely: the trusted shadow dir, and read-only commands in the user's repo.

Two kinds of git invocations exist and they never mix:

* :class:`ShadowGit` runs git with ``--git-dir=SHADOW`` (a bare repository we
  made), an environment built from nothing (no ``GIT_*`` inherited, system and
  global config off, ``HOME`` an empty temp dir), and ``-c core.hooksPath=/dev/null
  -c core.fsmonitor=false -c core.untrackedCache=false -c core.symlinks=true`` on
  every command line. It is never pointed at a work tree the agent wrote: every
  file it learns about was read by :mod:`agentbox.safepath` and handed to it.
* :func:`user_git` runs git in the user's repository, as the repository's
  owner (never as root): only read-only commands (``rev-parse``, ``status
  --no-optional-locks``), ``add -A`` into a temporary index and object dir,
  and the final ``fetch`` of the result branch, with hooks and fsmonitor off.

The user's repository may be given as a :class:`RepoDir`: the directory
opened once (``openat2`` beneath the repos root, no symlink followed), whose
descriptor every later command starts in (its working directory is
``/proc/self/fd/N``, entered before ``exec``). A path component swapped for a
link after the open cannot redirect them, and the owner git runs as is the
owner of that very directory.
"""

from __future__ import annotations

import errno
import os
import pwd
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from agentbox.core import proc as _proc
from agentbox.core.proc import Result
from agentbox.errors import PathRefused
from agentbox.safepath import (
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    openat2,
)

#: ``-c`` options on every git command line we run (the threats they answer:
#: hooks, an fsmonitor command, a stale untracked cache, symlinks written as files).
SAFE_CONFIG: tuple[str, ...] = (
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "core.fsmonitor=false",
    "-c",
    "core.untrackedCache=false",
    "-c",
    "core.symlinks=true",
)

#: ``-c`` options on every shadow-side command line, for cost not safety: a task's
#: shadow dir and the workspace's ``.git`` are small and short-lived, so no command
#: run there spawns ``git maintenance run --auto`` (or ``gc --auto``) after it.
NO_AUTO_MAINTENANCE: tuple[str, ...] = ("-c", "maintenance.auto=false", "-c", "gc.auto=0")

_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


def init_repo(git_dir: Path, fmt: str, *, head: str = "master", bare: bool = True,
              extra_config: str = "") -> None:  # fmt: skip
    """Write what ``git init --quiet --template= [--bare] --object-format=FMT`` writes.

    A git process fewer per repository we make (the shadow dir, the workspace's
    ``.git``): ``HEAD`` on ``refs/heads/<head>``, the ``[core]`` config (format
    version 1 and ``extensions.objectformat`` for sha256, ``filemode`` probed as
    git probes it), empty ``objects/{info,pack}`` and ``refs/{heads,tags}``;
    modes from the umask, as git's. ``extra_config`` is appended to the config.
    ``git_dir`` must not exist yet (``FileExistsError``).
    """
    if fmt not in ("sha1", "sha256"):
        raise ValueError(f"unknown object format {fmt!r}")
    git_dir = Path(git_dir)
    git_dir.parent.mkdir(parents=True, exist_ok=True)
    git_dir.mkdir()
    for sub in ("objects", "objects/info", "objects/pack", "refs", "refs/heads", "refs/tags"):
        (git_dir / sub).mkdir()
    (git_dir / "HEAD").write_text(f"ref: refs/heads/{head}\n")
    config = git_dir / "config"
    config.write_text("")
    # git's probe: does the executable bit stick on this filesystem?
    mode = config.stat().st_mode
    config.chmod(mode ^ 0o100)
    filemode = (config.stat().st_mode ^ mode) & 0o100 != 0
    config.chmod(mode)
    version = 1 if fmt == "sha256" else 0
    text = (
        f"[core]\n\trepositoryformatversion = {version}\n"
        f"\tfilemode = {'true' if filemode else 'false'}\n\tbare = {'true' if bare else 'false'}\n"
    )
    if fmt == "sha256":
        text += "[extensions]\n\tobjectformat = sha256\n"
    config.write_text(text + extra_config)


def clean_env(home: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for git built from nothing: no GIT_* leaks in from our caller."""
    env = {
        "PATH": os.environ.get("PATH", _DEFAULT_PATH),
        "HOME": home,
        "LC_ALL": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_ATTR_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_NO_REPLACE_OBJECTS": "1",
        "GIT_OPTIONAL_LOCKS": "0",
        "GIT_AUTHOR_NAME": "agentbox",
        "GIT_AUTHOR_EMAIL": "agentbox@localhost",
        "GIT_COMMITTER_NAME": "agentbox",
        "GIT_COMMITTER_EMAIL": "agentbox@localhost",
    }
    if extra:
        env.update(extra)
    return env


class ShadowGit:
    """git against the trusted bare shadow dir; use as a context manager (owns a temp HOME)."""

    def __init__(self, git_dir: Path, *, timeout: float = 300.0) -> None:
        self.git_dir = Path(git_dir).absolute()
        self.timeout = timeout
        self._home = tempfile.TemporaryDirectory(prefix="agentbox-githome-")

    def __enter__(self) -> ShadowGit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the temporary HOME; idempotent."""
        self._home.cleanup()

    def env(self, index: Path | None = None, **extra: str) -> dict[str, str]:
        """The environment for a shadow git command (``GIT_INDEX_FILE`` if ``index``)."""
        more = dict(extra)
        if index is not None:
            more["GIT_INDEX_FILE"] = str(Path(index).absolute())
        return clean_env(self._home.name, more)

    def argv(self, args: Sequence[str | os.PathLike[str]]) -> list[str]:
        """The full argv: git, the safe config, ``--git-dir=SHADOW``, then ``args``."""
        return ["git", *SAFE_CONFIG, *NO_AUTO_MAINTENANCE, f"--git-dir={self.git_dir}",
                *(os.fspath(a) for a in args)]  # fmt: skip

    def run(
        self,
        *args: str | os.PathLike[str],
        index: Path | None = None,
        input: bytes | str | None = None,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Result:
        """Run one git command against the shadow dir and return its output.

        ``cwd`` defaults to the shadow dir; it is the workspace only for
        ``check-ignore``, which takes paths relative to its work tree.
        """
        full_env = self.env(index)
        if env:
            full_env.update(env)
        # cwd is the shadow dir itself: never the workspace, whose .git git would discover.
        return _proc.run(
            self.argv(args),
            timeout=self.timeout,
            check=check,
            input=input,
            env=full_env,
            cwd=cwd or (self.git_dir if self.git_dir.is_dir() else self.git_dir.parent),
        )

    def run_bytes(
        self,
        *args: str | os.PathLike[str],
        input: bytes | None = None,
        cwd: Path | None = None,
        index: Path | None = None,
    ) -> tuple[int, bytes]:
        """Run one git command; return its exit code and raw stdout (paths stay bytes)."""
        out: list[bytes] = []
        err: list[bytes] = []
        with tempfile.TemporaryFile() as stdin:
            if input is not None:
                stdin.write(input)
                stdin.seek(0)
            rc = _proc.stream(
                self.argv(args),
                on_stdout=out.append,
                on_stderr=err.append,
                timeout=self.timeout,
                env=self.env(index),
                cwd=cwd or self.git_dir,
                stdin=stdin.fileno(),
            )
        return rc, b"".join(out)


class RepoDir:
    """The user's repository directory, opened once; use as a context manager.

    ``open(repo, root=R)`` opens ``repo`` (a resolved path) with ``openat2``
    beneath ``R`` (the repos root), refusing any symlink on the way
    (:class:`~agentbox.errors.PathRefused`). Without ``root`` the resolved
    path is opened with its last component not a link. Afterwards nothing
    looks the path up again: git starts in :attr:`cwd`, and :attr:`owner` is
    the directory's own. :attr:`path` is where it was when opened (for
    messages and ``safe.directory``).
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path
        st = os.fstat(fd)
        self.owner: tuple[int, int] = (st.st_uid, st.st_gid)

    @classmethod
    def open(cls, repo: Path, *, root: Path | None = None) -> Self:
        """Open ``repo`` (beneath ``root`` when given, no link followed)."""
        repo = Path(repo)
        try:
            if root is None:
                real = repo.resolve()
                fd = os.open(real, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            else:
                real_root = Path(root).resolve()
                try:
                    rel = repo.relative_to(real_root)
                except ValueError as exc:
                    raise PathRefused(f"the repo is not beneath {real_root}", path=repo) from exc
                rfd = os.open(real_root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    fd = openat2(
                        rfd, str(rel) or ".", os.O_PATH | os.O_DIRECTORY,
                        resolve=RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
                    )  # fmt: skip
                finally:
                    os.close(rfd)
        except OSError as exc:
            why = "a link on the way" if exc.errno in (errno.ELOOP, errno.EXDEV) else exc.strerror
            raise PathRefused(f"cannot open the repo ({why})", path=repo) from exc
        return cls(fd, Path(f"/proc/self/fd/{fd}").readlink())

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RepoDir({str(self.path)!r}, fd={self.fd})"

    @property
    def cwd(self) -> str:
        """A working directory for a child process: the opened directory itself.

        The child enters it before ``exec`` (while the descriptor is still open
        in it), so its working directory is this very directory, by inode.
        """
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        """Close the descriptor; idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def repo_owner(repo: Path | RepoDir) -> tuple[int, int]:
    """The uid and gid owning ``repo``'s ``.git`` (the repo itself if it has none).

    For a :class:`RepoDir`: the owner of the opened directory itself (its
    ``.git`` could be a link to someone else's, e.g. root's).
    """
    if isinstance(repo, RepoDir):
        return repo.owner
    gd = repo / ".git"
    st = gd.stat() if gd.exists() else repo.stat()
    return st.st_uid, st.st_gid


def as_owner(repo: Path | RepoDir) -> list[str]:
    """An argv prefix that drops to the repo owner's uid/gid when we run as root.

    A privileged launcher must not run git in a user's repository as root:
    that repo's config is the user's (an ``alternateRefsCommand``, a clean
    filter during ``add``), so it would run as root, and objects fetched in
    would be root-owned. With the owner's ids, whatever the config runs, runs
    as them.
    """
    uid, gid = repo_owner(repo)
    if os.geteuid() != 0 or uid == 0:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
            "--inh-caps=-all", "--"]  # fmt: skip


def owner_tempdir(repo: Path | RepoDir) -> Path:
    """A private temp dir that the repo's owner (who runs git there) may write."""
    tmp = Path(tempfile.mkdtemp(prefix="agentbox-owner-"))
    if as_owner(repo):
        os.chown(tmp, *repo_owner(repo))
    return tmp


def _owner_home(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_dir
    except KeyError:
        return "/nonexistent"


#: The environment of a sealed :func:`user_git`: the system and global config and the
#: system attributes file are not read (``git lfs install`` puts ``filter.lfs.*`` in the
#: global config; a user's global ``diff.*.textconv`` or ``merge.*.driver`` is a program).
SEALED_ENV: dict[str, str] = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_ATTR_NOSYSTEM": "1",
}
#: Drivers whose every program a sealed command line empties, configured or not.
_ALWAYS_SEALED = ("lfs",)
_DRIVER_KEYS = {
    "filter": ("process", "smudge", "clean"),
    "diff": ("command", "textconv"),
    "merge": ("driver",),
}


def _local_drivers(
    repo: Path | RepoDir,
    prefix: list[str],
    env: Mapping[str, str],
    cwd: str | Path,
    where: Path,
    timeout: float,
) -> dict[str, set[str]]:
    """The filter, diff and merge driver names the repo's own config (with its includes)
    defines, as ``{"filter": {"lfs", ...}, ...}``: read with the sealed environment."""
    argv = [*prefix, "git", "--no-optional-locks", "-c", f"safe.directory={where}",
            *([] if isinstance(repo, RepoDir) else ["-C", os.fspath(repo)]),
            "config", "--includes", "--null", "--name-only", "--get-regexp",
            r"^(filter|diff|merge)\..*\."]  # fmt: skip
    res = _proc.run(argv, timeout=timeout, check=False, env=dict(env), cwd=cwd)
    found: dict[str, set[str]] = {k: set(_ALWAYS_SEALED) for k in _DRIVER_KEYS}
    for key in res.stdout.split("\0"):
        section, _, rest = key.strip().partition(".")
        name, _, _var = rest.rpartition(".")
        if section in found and name:
            found[section].add(name)
    return found


def _sealed_config(drivers: Mapping[str, set[str]]) -> list[str]:
    """``-c`` options that empty every program of ``drivers`` (a filter with no program is
    no filter: the blob is written as it is; ``required`` off so that is not an error)."""
    out = ["-c", "core.attributesFile=/dev/null"]
    for section, keys in _DRIVER_KEYS.items():
        for name in sorted(drivers.get(section, ())):
            if "\n" in name or "=" in name:
                continue  # git cannot take it on a command line; not reachable by attributes
            out += [a for k in keys for a in ("-c", f"{section}.{name}.{k}=")]
            if section == "filter":
                out += ["-c", f"filter.{name}.required=false"]
    return out


def user_git(
    repo: Path | RepoDir,
    *args: str | os.PathLike[str],
    check: bool = True,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    sealed: bool = False,
    input: str | None = None,
) -> Result:
    """Run git in the user's repo, as its owner: hooks and fsmonitor off, no optional locks.

    The user's own global config still applies (it is theirs and trusted), but
    no ``GIT_*`` variable of our caller leaks in. ``safe.directory`` is set on
    the command line in case the owner cannot be assumed (not root). Given a
    :class:`RepoDir`, git starts in the opened directory and is never told its path.

    ``sealed``: for a command that reads agent-written content (a result's
    ``.gitattributes`` names drivers; its ``.lfsconfig`` points git-lfs at a
    server): no system or global config and no attributes file but the
    tree's own (:data:`SEALED_ENV`, ``core.attributesFile=/dev/null``), and
    every filter, diff and merge driver the repo's own ``.git/config`` defines
    (and ``lfs`` always) emptied on the command line, so no attribute runs a
    program: a filtered file is written as its blob (an LFS pointer as the
    pointer), a custom merge driver makes a conflict instead of running.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "XDG_"))}
    prefix = as_owner(repo)
    if prefix:
        base["HOME"] = _owner_home(repo_owner(repo)[0])
    base.update({"LC_ALL": "C", "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0"})
    if sealed:
        base.update(SEALED_ENV)
    if env:
        base.update(env)
    where = repo.path if isinstance(repo, RepoDir) else repo
    # cwd: somewhere the owner may enter (our own cwd may be a root-only dir); for a
    # RepoDir, the opened directory itself.
    cwd = repo.cwd if isinstance(repo, RepoDir) else repo
    seal = _sealed_config(_local_drivers(repo, prefix, base, cwd, where, timeout)) if sealed else []
    argv = [
        *prefix,
        "git",
        "--no-optional-locks",
        "-c",
        "core.hooksPath=/dev/null",
        "-c",
        "core.fsmonitor=false",
        "-c",
        f"safe.directory={where}",
        *seal,
        *([] if isinstance(repo, RepoDir) else ["-C", os.fspath(repo)]),
        *(os.fspath(a) for a in args),
    ]
    return _proc.run(argv, timeout=timeout, check=check, env=base, cwd=cwd, input=input)
