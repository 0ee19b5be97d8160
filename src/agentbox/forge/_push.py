"""Pushing a task's result to the repo's remote, as the repo's owner, never by force.

git runs in the user's repository as the owner of that very directory
(:func:`agentbox.collect._git.user_git`: ``setpriv`` to their uid and gid, their
``HOME``, so their own credential helper, ``ssh`` keys and ``url.*.insteadOf``
apply) and never as root: a root-owned repo is refused. Hooks are off on the
command line (``core.hooksPath=/dev/null``: no ``pre-push`` runs, whatever the
repo or its result holds), submodules are not pushed, no tag follows, nothing is
signed. The refspec is ``COMMIT:refs/heads/BRANCH`` with no ``+``: git itself
refuses anything but a fast-forward, and before that the remote's branch, if
it exists, must be an ancestor of the result, in this repo (else
:class:`~agentbox.errors.PushRefused`, nothing pushed).
"""

from __future__ import annotations

import os
import re

from agentbox.collect import RepoDir, as_owner, repo_owner, user_git
from agentbox.core.log import get_logger
from agentbox.errors import CollectError, CommandError, PushRefused

log = get_logger(__name__)

#: A remote's name as ``git remote add`` makes them; no option look-alike.
_REMOTE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
_HEX = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")
#: ``-c`` options for the push: nothing follows the branch, nothing is signed.
_PUSH_CONFIG = (
    "-c", "push.followTags=false", "-c", "push.gpgSign=false",
    "-c", "push.recurseSubmodules=no", "-c", "submodule.recurse=false",
)  # fmt: skip


def check_remote(name: str) -> str:
    """``name`` if it may be a remote's name, else :class:`~agentbox.errors.PushRefused`."""
    if not isinstance(name, str) or not _REMOTE.fullmatch(name):
        raise PushRefused(f"not a remote name: {name!r:.80}")
    return name


def _owner_check(repo: RepoDir) -> None:
    """git will run as the repo's owner, and that owner is not root."""
    uid = repo_owner(repo)[0]
    if uid == 0:
        raise PushRefused(
            f"{repo} is root's: agentbox pushes only as the repo's owner, never as root"
        )
    if os.geteuid() not in (0, uid):
        raise PushRefused(f"{repo} is uid {uid}'s: push it as that user (or through root)")
    assert os.geteuid() == uid or as_owner(repo), "git must run as the owner"


def remote_url(repo: RepoDir, remote: str) -> str:
    """The URL ``remote`` fetches from (``url.*.insteadOf`` applied), read as the owner."""
    try:
        return user_git(repo, "remote", "get-url", "--", check_remote(remote)).stdout.strip()
    except CommandError as exc:
        raise PushRefused(f"{repo} has no remote {remote!r:.80}") from exc


def push_result(repo: RepoDir, *, remote: str, branch: str, commit: str) -> bool:
    """Push ``commit`` to ``refs/heads/<branch>`` of ``remote``; False if it was there already.

    ``commit`` must be in ``repo`` (published there first). Raises
    :class:`~agentbox.errors.PushRefused` when the remote's branch is neither the
    result nor an ancestor of it, or git refuses the push as not a fast-forward;
    :class:`~agentbox.errors.CollectError` when git fails otherwise (no network,
    no credentials: git's own message, which never holds a password).
    """
    check_remote(remote)
    if not _HEX.fullmatch(commit):
        raise CollectError(f"not a commit id: {commit!r:.80}")
    _owner_check(repo)
    ref = f"refs/heads/{branch}"
    try:
        # Where the push goes (``pushurl`` when set, else ``url``): asked there.
        target = user_git(repo, "remote", "get-url", "--push", "--", remote).stdout.strip()
        out = user_git(repo, "ls-remote", "--refs", "--", target, ref).stdout
    except CommandError as exc:
        raise CollectError(f"cannot read {remote}'s branches: {exc.stderr.strip()[-400:]}") from exc
    theirs = next((ln.split()[0] for ln in out.splitlines() if ln.endswith(f"\t{ref}")), "")
    if theirs == commit:
        return False
    if theirs:
        known = user_git(repo, "cat-file", "-e", f"{theirs}^{{commit}}", check=False)
        anc = user_git(repo, "merge-base", "--is-ancestor", theirs, commit, check=False)
        if known.returncode != 0 or anc.returncode != 0:
            why = "a commit this repo does not have" if known.returncode else "not an ancestor"
            raise PushRefused(
                f"{remote} already has {branch} at {theirs[:12]}, {why} of the result "
                f"{commit[:12]}: a push would need force, and agentbox never forces; nothing "
                f"pushed (publish under another name with --branch NAME)"
            )
    try:
        user_git(
            repo, *_PUSH_CONFIG, "push", "--porcelain", "--no-follow-tags", "--no-signed",
            "--recurse-submodules=no", "--", remote, f"{commit}:{ref}", timeout=600,
        )  # fmt: skip
    except CommandError as exc:
        text = f"{exc.stdout or ''}\n{exc.stderr or ''}"
        if "non-fast-forward" in text or "[rejected]" in text or "fetch first" in text:
            raise PushRefused(
                f"{remote} refused {branch} as not a fast-forward (it moved meanwhile): "
                "nothing pushed; agentbox never forces"
            ) from exc
        why = exc.stderr.strip()[-400:]
        raise CollectError(f"pushing {branch} to {remote} failed: {why}") from exc
    log.info("pushed", branch=branch, remote=remote, commit=commit)
    return True
