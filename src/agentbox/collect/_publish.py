"""Handing the result to the user: fetch the branch from the shadow dir into their repo.

A published branch is the user's from then on: they may commit on it, check
it out, reset it. So publishing never overwrites a ref agentbox did not
write. The branch is created only if it does not exist (or moved only from a
commit agentbox itself wrote there for this task, as recorded), with a
compare-and-swap ``update-ref`` (the expected old value given), so a commit
the user makes in between is not lost either. Anything else is
:class:`~agentbox.errors.PublishRefused` with the reason; the result stays in
the shadow dir and ``agentbox publish ID --branch NAME`` publishes it later.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

from agentbox.collect._collect import branch_name
from agentbox.collect._git import (
    RepoDir,
    ShadowGit,
    as_owner,
    clean_env,
    owner_tempdir,
    repo_owner,
    user_git,
)
from agentbox.core import proc as _proc
from agentbox.errors import CollectError, CommandError, PublishRefused, RefusedError

_HEX = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")
#: Branch names we publish under: plain ASCII, no option look-alike, no control characters.
_BRANCH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]{0,199}")


#: Names git gives a meaning of its own (pseudo-refs and the special refs it writes in
#: ``.git``): a branch of that name makes every later ``git checkout NAME`` ambiguous.
_RESERVED = re.compile(r"(HEAD|[A-Z][A-Z0-9_]*_HEAD|AUTO_MERGE|stash)")
#: A name that starts like a full ref (``refs/heads/main`` would become
#: ``refs/heads/refs/heads/main``), or is all hex (an object name's spelling).
_REFLIKE = re.compile(r"refs/.*|[0-9a-fA-F]{7,64}")


def check_branch(name: str) -> str:
    """Return ``name`` if it is a branch name we may publish under, else RefusedError.

    ``git check-ref-format --branch`` (git's own rules for a branch name: it refuses
    ``HEAD``), plus names git reserves or reads as something else: a pseudo-ref
    (``FETCH_HEAD``, ``ORIG_HEAD``, any ``*_HEAD``, ``AUTO_MERGE``), ``stash``, a name
    starting with ``refs/``, and an all-hex name.
    """
    if not isinstance(name, str) or not _BRANCH.fullmatch(name):
        raise RefusedError(f"not a branch name agentbox publishes under: {name!r:.80}")
    if _RESERVED.fullmatch(name) or _REFLIKE.fullmatch(name):
        raise RefusedError(
            f"{name!r:.80} is a name git reserves or reads as a ref or object: "
            "pick another branch name"
        )
    res = _proc.run(["git", "check-ref-format", "--branch", name], check=False,
                    env=clean_env("/nonexistent"), cwd="/", timeout=30)  # fmt: skip
    if res.returncode != 0 or res.stdout.strip() != name:
        raise RefusedError(f"git refuses the branch name {name!r:.80}")
    return name


def _written(record: Path | None, repo: Path, ref: str) -> set[str]:
    """Commits agentbox wrote (or set out to write) at ``ref`` in ``repo``, per ``record``."""
    if record is None:
        return set()
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return set()
    entries = data if isinstance(data, list) else []
    return {
        str(e.get("commit"))
        for e in entries
        if isinstance(e, dict) and e.get("repo") == str(repo) and e.get("ref") == ref
    }


def _remember(record: Path | None, repo: Path, ref: str, commit: str) -> None:
    """Add (repo, ref, commit) to the record, before the ref is written (a crash after the
    write then still finds the commit there as agentbox's own)."""
    if record is None:
        return
    try:
        loaded = json.loads(record.read_text())
    except (OSError, ValueError):
        loaded = []
    entries = loaded if isinstance(loaded, list) else []
    entries.append({"repo": str(repo), "ref": ref, "commit": commit})
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_text(json.dumps(entries[-100:], indent=1))
    tmp.replace(record)


def _current(repo: RepoDir, ref: str) -> tuple[str, str]:
    """(object id, symref target) of exactly ``ref`` in ``repo``; ("", "") when absent."""
    out = user_git(
        repo, "for-each-ref", "--format=%(refname)%00%(objectname)%00%(symref)", ref
    ).stdout
    for line in out.splitlines():
        name, _, rest = line.partition("\0")
        oid, _, target = rest.partition("\0")
        if name == ref:
            return oid, target
    return "", ""


def _checked_out(repo: RepoDir, ref: str) -> str | None:
    """The worktree that has ``ref`` checked out (or as an unborn branch), if any."""
    out = user_git(repo, "worktree", "list", "--porcelain", "-z").stdout
    where = ""
    for field in out.split("\0"):
        if field.startswith("worktree "):
            where = field.removeprefix("worktree ")
        elif field == f"branch {ref}":
            return where or str(repo.path)
    return None


def _loose_ref(git_dir: Path, ref: str) -> str | None:
    """The object name in loose ref file ``ref`` of our own shadow dir, or None."""
    try:
        return (git_dir / ref).read_text("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


def publish(
    shadow_git: Path,
    repo: Path,
    *,
    task_id: str,
    commit: str,
    branch: str | None = None,
    record: Path | None = None,
    root: Path | None = None,
) -> str:
    """Put the result ``commit`` on a branch of ``repo`` (``agentbox/<task-id>`` unless
    ``branch``); return the branch name.

    Only that ref and its objects change in ``repo``. The shadow dir writes a
    bundle of the result (everything after the user's commit it was made
    from); git fetches its objects into ``repo`` **as the repo's owner** (so
    new objects are theirs and their config runs nothing as root), with hooks
    and fsmonitor off, no ``FETCH_HEAD``, no auto-gc, and never touching the
    work tree, the index or HEAD. Then ``update-ref`` creates the branch, with
    the old value it must have: none, or a commit agentbox wrote there before
    (listed in ``record``, a JSON file of the task's own that this call also
    appends to). A branch already at ``commit`` is left as is.

    Raises :class:`~agentbox.errors.PublishRefused` (nothing changed in
    ``repo``) when the branch exists at a commit agentbox did not write, is a
    symbolic ref, or is checked out; :class:`~agentbox.errors.CollectError`
    when git fails. ``commit`` must be what the shadow branch points at, so a
    shadow dir changed since collection is caught, not published.

    ``repo`` is opened once (beneath ``root``, the repos root, with no link
    followed, when given) and git runs in that descriptor, as the owner of that
    very directory.
    """
    name = check_branch(branch) if branch is not None else branch_name(task_id)
    if not _HEX.fullmatch(commit):
        raise CollectError(f"not a commit id: {commit!r:.80}")
    with RepoDir.open(Path(repo).resolve() if root is None else Path(repo), root=root) as rd:
        return _publish(rd, Path(shadow_git), task_id, commit, name, record)


def _publish(
    repo: RepoDir, shadow_git: Path, task_id: str, commit: str, name: str, record: Path | None
) -> str:
    shadow_ref = f"refs/heads/{branch_name(task_id)}"
    ref = f"refs/heads/{name}"
    if _loose_ref(Path(shadow_git), shadow_ref) != commit:
        # Not the loose ref collection writes: ask git, which also reads packed refs.
        with ShadowGit(Path(shadow_git).absolute()) as shadow:
            res = shadow.run(
                "rev-parse", "--verify", "--quiet", f"{shadow_ref}^{{commit}}", check=False
            )
        if res.stdout.strip() != commit:
            raise CollectError(
                f"{shadow_ref} in the shadow dir is {res.stdout.strip()!r}, not {commit}"
            )
    try:
        current, symref = _current(repo, ref)
        if symref:
            raise PublishRefused(f"{name} in {repo} is a symbolic ref (to {symref}); left as it is")
        if current == commit:
            return name  # already published (by us: the commit names this task)
        if current and current not in _written(record, repo.path, ref):
            raise PublishRefused(
                f"{name} already exists in {repo} at {current[:12]}, a commit agentbox did "
                f"not write: left as it is; the result {commit[:12]} is kept "
                f"(`agentbox publish {task_id} --branch NAME` publishes it under another name)"
            )
        where = _checked_out(repo, ref)
        if where is not None:
            raise PublishRefused(
                f"{name} is checked out in {where}: left as it is; the result {commit[:12]} is "
                f"kept (`agentbox publish {task_id} --branch NAME` publishes it under another name)"
            )
    except CommandError as exc:
        raise CollectError(f"cannot read {name} in {repo}: {exc}") from exc
    tmp = owner_tempdir(repo)
    try:
        bundle = tmp / "result.bundle"
        with ShadowGit(Path(shadow_git).absolute()) as shadow:
            shadow.run("bundle", "create", "--quiet", bundle, shadow_ref, "^refs/agentbox/head")
        if as_owner(repo):
            os.chown(bundle, *repo_owner(repo))
        _remember(record, repo.path, ref, commit)
        try:
            # Objects only (no destination in the refspec): the ref is written below,
            # compare-and-swap, so a ref that changed since it was read is not overwritten.
            # Sealed: the objects are the agent's; no config of the host's runs on them.
            user_git(
                repo, "fetch", "--quiet", "--no-tags", "--no-write-fetch-head", "--no-auto-gc",
                "--no-recurse-submodules", bundle, shadow_ref, sealed=True,
            )  # fmt: skip
        except CommandError as exc:
            raise CollectError(f"fetching the result into {repo} failed: {exc}") from exc
        try:
            user_git(repo, "update-ref", "--no-deref", "-m", f"agentbox: task {task_id}",
                     ref, commit, current)  # fmt: skip
        except CommandError as exc:
            with contextlib.suppress(CommandError):
                if _current(repo, ref)[0] == commit:
                    return name  # another publisher of the same result won the race
            raise PublishRefused(
                f"{name} in {repo} changed while it was being published "
                f"({exc.stderr.strip()[-300:]}): left as it is; the result {commit[:12]} is kept"
            ) from exc
        # No re-read: update-ref is a compare-and-swap that set exactly ``commit``.
    except CommandError as exc:
        raise CollectError(f"publishing {name} into {repo} failed: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return name
