"""git bundles in and out: the only form in which repos travel through Ray.

The driver bundles each repo's base commit once per batch; a node makes a
repo of its own from it (in its repos root); the node bundles the result
branch back (prerequisite: the base); the driver fetches that bundle into a
trusted bare dir of its own and publishes from there with
:func:`agentbox.collect.publish`, the same code and rules as a local task.

Every git here runs with hooks and fsmonitor off, no system or global config or
attributes file (so no filter, diff or merge driver: git-lfs never runs on a
result), an empty ``HOME``, and ``transfer.fsckObjects`` on when it reads a bundle: a
bundle is data from another host, never configuration.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from agentbox.core import proc as _proc
from agentbox.core.proc import Result
from agentbox.errors import CommandError, TaskError

_SHA = re.compile(r"[0-9a-f]{40}")
#: No attribute-driven program either (the result's ``.gitattributes`` is agent-written):
#: no attributes file but the tree's, and the drivers of the global config are off anyway.
_SAFE = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false",
         "-c", "transfer.fsckObjects=true", "-c", "gc.auto=0",
         "-c", "core.attributesFile=/dev/null")  # fmt: skip


def _git(*args: str | os.PathLike[str], cwd: Path | None = None, timeout: float = 300) -> Result:
    with tempfile.TemporaryDirectory(prefix="agentbox-githome-") as home:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": home,
            "LC_ALL": "C",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_ATTR_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_AUTHOR_NAME": "agentbox",
            "GIT_AUTHOR_EMAIL": "agentbox@localhost",
            "GIT_COMMITTER_NAME": "agentbox",
            "GIT_COMMITTER_EMAIL": "agentbox@localhost",
        }
        return _proc.run(["git", *_SAFE, *args], cwd=cwd, env=env, timeout=timeout)


def _bytes_to_file(data: bytes, where: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix="agentbox-", suffix=".bundle", dir=where)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return Path(name)


def bundle_base(repo: Path) -> tuple[str, bytes]:
    """(base commit, bundle bytes) of ``repo``'s HEAD commit, on the driver.

    Only commits travel: uncommitted changes in ``repo`` are not part of the base.
    git runs as the caller (the repo's user) with its own config off but the repo's
    config on: it is the user's repo, read by the user.
    """
    repo = Path(repo).expanduser().resolve()
    if not (repo / ".git").exists():
        raise TaskError(f"{repo} is not a git work tree")
    base = _git("-C", repo, "rev-parse", "--verify", "HEAD^{commit}").stdout.strip()
    if not _SHA.fullmatch(base):
        raise TaskError(f"{repo}: HEAD is not a commit ({base[:60]!r})")
    with tempfile.TemporaryDirectory(prefix="agentbox-bundle-") as tmp:
        out = Path(tmp) / "base.bundle"
        _git("-C", repo, "bundle", "create", "--quiet", out, "HEAD")
        return base, out.read_bytes()


def unbundle(data: bytes, base: str, dest: Path) -> Path:
    """Make the repo ``dest`` (new) on a node from the driver's bundle, at ``base``."""
    if not _SHA.fullmatch(base):
        raise TaskError(f"not a commit id: {base[:60]!r}")
    dest.mkdir(parents=True)
    _git("init", "--quiet", "-b", "agentbox-base", dest)
    bundle = _bytes_to_file(data, dest.parent)
    try:
        _git("-C", dest, "fetch", "--quiet", "--no-tags", bundle, "HEAD:refs/agentbox/base")
    finally:
        bundle.unlink()
    got = _git("-C", dest, "rev-parse", "refs/agentbox/base").stdout.strip()
    if got != base:
        raise TaskError(f"the bundle's HEAD is {got[:12]}, not the base {base[:12]}")
    _git("-C", dest, "checkout", "--quiet", "-B", "agentbox-base", base)
    return dest


def bundle_result(repo: Path, branch: str, base: str) -> bytes:
    """The node's result ``branch`` in ``repo`` as a bundle whose prerequisite is ``base``."""
    with tempfile.TemporaryDirectory(prefix="agentbox-bundle-") as tmp:
        out = Path(tmp) / "result.bundle"
        _git("-C", repo, "bundle", "create", "--quiet", out, f"refs/heads/{branch}", f"^{base}")
        return out.read_bytes()


def ensure_shadow(shadow: Path, base_bundle: bytes, base: str) -> Path:
    """A trusted bare dir on the driver holding ``base`` as ``refs/agentbox/head``."""
    if not (shadow / "HEAD").is_file():
        shadow.mkdir(parents=True, exist_ok=True)
        _git("init", "--quiet", "--bare", shadow)
    if _head(shadow) == base:
        return shadow
    bundle = _bytes_to_file(base_bundle, shadow)
    try:
        _git(f"--git-dir={shadow}", "fetch", "--quiet", "--no-tags", bundle,
             "+HEAD:refs/agentbox/head", cwd=shadow)  # fmt: skip
    finally:
        bundle.unlink()
    return shadow


def _head(shadow: Path) -> str:
    """The base commit the shadow dir holds; "" when none."""
    try:
        res = _git(f"--git-dir={shadow}", "rev-parse", "--verify", "--quiet",
                   "refs/agentbox/head", cwd=shadow)  # fmt: skip
    except CommandError:
        return ""
    return res.stdout.strip()


def add_result(shadow: Path, data: bytes, attempt_id: str, commit: str) -> None:
    """Fetch a node's result bundle into the driver's shadow dir as ``agentbox/<attempt>``.

    The bundle is untrusted: fsck'd on the way in; its branch must be exactly
    ``commit`` and descend from the base, or TaskError (and the ref is not kept).
    """
    ref = f"refs/heads/agentbox/{attempt_id}"
    if not _SHA.fullmatch(commit):
        raise TaskError(f"not a commit id: {commit[:60]!r}", task_id=attempt_id)
    bundle = _bytes_to_file(data, shadow)
    try:
        _git(f"--git-dir={shadow}", "bundle", "verify", "--quiet", bundle, cwd=shadow)
        _git(f"--git-dir={shadow}", "fetch", "--quiet", "--no-tags", "--force", bundle,
             f"{ref}:{ref}", cwd=shadow)  # fmt: skip
    except CommandError as exc:
        raise TaskError(f"the node's result bundle is unusable: {exc}", task_id=attempt_id) from exc
    finally:
        bundle.unlink()
    got = _git(f"--git-dir={shadow}", "rev-parse", f"{ref}^{{commit}}", cwd=shadow).stdout.strip()
    try:
        _git(f"--git-dir={shadow}", "merge-base", "--is-ancestor", "refs/agentbox/head", got,
             cwd=shadow)  # fmt: skip
        ok = got == commit
    except CommandError:
        ok = False
    if not ok:
        _git(f"--git-dir={shadow}", "update-ref", "-d", ref, cwd=shadow)
        raise TaskError(
            f"the node's branch is {got[:12]}, not {commit[:12]} on the base", task_id=attempt_id
        )


def changed_paths(shadow: Path, base: str, commit: str) -> list[tuple[str, str]]:
    """``(change, path)`` of every path ``commit`` adds, modifies or deletes against ``base``
    in the driver's shadow dir (change: added | modified | deleted; no rename detection)."""
    for sha in (base, commit):
        if not _SHA.fullmatch(sha):
            raise TaskError(f"not a commit id: {sha[:60]!r}")
    out = _git(f"--git-dir={shadow}", "diff", "--name-status", "-z", "--no-renames",
               "--no-ext-diff", "--no-textconv", base, commit, cwd=shadow).stdout  # fmt: skip
    words = [w for w in out.split("\0") if w]
    kinds = {"A": "added", "D": "deleted"}
    pairs = zip(words[0::2], words[1::2], strict=False)
    return [(kinds.get(status[:1], "modified"), path) for status, path in pairs]
