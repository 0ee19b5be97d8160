"""A Boxfile committed in the repo (``.agentbox/Boxfile.toml``), read from the base commit.

It is read as a git blob of ``HEAD`` (``git ls-tree`` then ``git cat-file``,
through the caller's trusted read-only git: no hooks, no fsmonitor, nothing
of the work tree), so an uncommitted edit or a link in the work tree changes
nothing. Only a regular file (mode 100644/100755) of at most
:data:`~agentbox.boxfile.MAX_BOXFILE_BYTES` counts; anything else there is
refused by name. It is then bounded by the host settings like any Boxfile:
mounts under the mount roots, ``[network]`` hosts within the egress cap.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from agentbox.boxfile import MAX_BOXFILE_BYTES, Boxfile, loads_boxfile
from agentbox.config import Settings
from agentbox.core import proc as _proc
from agentbox.errors import BoxfileError, CommandError

#: Where a repo commits its Boxfile.
COMMITTED_BOXFILE = ".agentbox/Boxfile.toml"

GitRunner = Callable[..., _proc.Result]


def committed_boxfile(
    repo: Path, settings: Settings, git: GitRunner, *, rev: str = "HEAD"
) -> Boxfile | None:
    """The Boxfile committed at ``rev`` of ``repo``, or None if it has none.

    ``git(repo, *args)`` runs git read-only in the repo (the launcher's
    ``git_readonly``). Raises :class:`BoxfileError` (naming ``rev:path``) for one
    that is not a regular file, too large, not UTF-8 or not valid.
    """
    where = Path(f"{rev}:{COMMITTED_BOXFILE}")
    try:
        listing = git(repo, "ls-tree", "-z", "--full-tree", rev, "--", COMMITTED_BOXFILE).stdout
    except CommandError as exc:
        raise BoxfileError(f"cannot list the base commit: {exc}", path=where) from exc
    if not listing:
        return None
    head, _, _name = listing.rstrip("\0").partition("\t")
    fields = head.split()
    if len(fields) != 3 or fields[1] != "blob" or fields[0] not in ("100644", "100755"):
        raise BoxfileError("not a regular file in the commit", path=where)
    sha = fields[2]
    try:
        size = int(git(repo, "cat-file", "-s", sha).stdout.strip())
        if size > MAX_BOXFILE_BYTES:
            raise BoxfileError(
                f"too large ({size} bytes; a Boxfile may hold {MAX_BOXFILE_BYTES})", path=where
            )
        text = git(repo, "cat-file", "blob", sha).stdout
    except (CommandError, ValueError) as exc:
        raise BoxfileError(f"cannot read the committed Boxfile: {exc}", path=where) from exc
    if "\ufffd" in text:
        raise BoxfileError("not UTF-8 text", path=where)
    return loads_boxfile(text, path=where, settings=settings)


def with_overrides(box: Boxfile, overrides: dict[str, str], *, source: str) -> Boxfile:
    """``box`` with the keys ``overrides`` names replaced (each checked as a Boxfile's
    would be), every other key kept: ``--backend``/``--runtime`` override one key of
    the repo's Boxfile, never the whole of it. A combination the chosen backend cannot
    honour (``--runtime`` on a microVM backend, or a runtime the backend does not run)
    is refused with the reason; ``source`` names where the rest of the Boxfile came from.
    """
    if not overrides:
        return box
    for key, value in overrides.items():
        try:
            Boxfile.model_validate({key: value})
        except ValidationError as exc:
            raise BoxfileError(f"--{key} {value}: {exc.errors()[0]['msg']}") from exc
    from agentbox.backends import backend_class

    out = box.model_copy(update=overrides)
    runtimes = backend_class(out.backend).runtimes
    if "runtime" in overrides and out.runtime not in runtimes:
        took = f"takes {', '.join(runtimes)}" if runtimes else "runs no OCI runtime"
        raise BoxfileError(
            f"--runtime {out.runtime} cannot be honoured: the {out.backend} backend "
            f"(from {'--backend' if 'backend' in overrides else source}) {took}",
        )
    # A backend that runs OCI runtimes but not this one cannot honour it; one that runs
    # none (a microVM: its own kernel) has no use for the key, which then does not apply.
    if "backend" in overrides and runtimes and out.runtime not in runtimes:
        raise BoxfileError(
            f"--backend {out.backend} cannot be honoured: {source} asks for runtime "
            f"{out.runtime}, which the {out.backend} backend does not run "
            f"(add --runtime, or drop --backend)",
        )
    return out


def check_env_policy(box: Boxfile, settings: Settings) -> None:
    """Refuse, before anything is created, a Boxfile whose ``[setup]`` or ``[network]``
    this host cannot honour: ``[network] allow`` hosts outside the host's
    ``egress_allow_cap`` (:class:`~agentbox.errors.PolicyRefused`), ``[setup]`` or
    ``[network] allow`` on a backend whose sandboxes take no environment (its
    ``environments_refused`` says why: :class:`~agentbox.errors.UnsupportedError`)."""
    from agentbox.backends import backend_class
    from agentbox.egress import EgressPolicy
    from agentbox.errors import UnsupportedError

    if box.egress_allow or box.network_rules():
        EgressPolicy.for_phase(settings, allow=box.egress_allow, rules=box.network_rules("agent"))
        EgressPolicy.for_phase(
            settings, rules=box.network_rules("setup"), phase="setup"
        )  # each rule's host against the cap
    if box.setup is None and not box.egress_allow and not box.network_rules():
        return
    why = backend_class(box.backend).environments_refused
    if why is None:
        return
    what = "[setup]" if box.setup is not None else "[network] allow"
    raise UnsupportedError(
        f"{what} needs an environment, which the {box.backend} backend does not take: {why}",
        fix=f"use backend = one of {', '.join(map(repr, _taking()))}, or remove {what}",
    )


def _taking() -> list[str]:
    """The registered backends whose sandboxes take an environment."""
    from agentbox.backends import BACKENDS, backend_class
    from agentbox.errors import UnsupportedError

    names = []
    for name in sorted(BACKENDS):
        try:
            if backend_class(name).environments_refused is None:
                names.append(name)
        except UnsupportedError:  # a backend module that does not import here
            continue
    return names
