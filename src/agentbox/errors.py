"""The one exception tree of agentbox.

Every error agentbox raises on purpose derives from :class:`AgentboxError`;
errors of lower layers (subprocess, podman, QEMU, HTTP, sqlite) are translated
at the boundary with ``raise ... from exc`` (:func:`map_exceptions` does it for
a block) and never leak raw. The tree is grouped by what the caller can do
about it; every timeout is also an :class:`AgentboxTimeout`::

    AgentboxError
    ├── ConfigError            bad settings, Boxfile, model registry: fix the input
    │   ├── BoxfileError       names the offending key (key, path)
    │   ├── InvalidValue       plain data checked by hand (the gateway's registry entry, usage,
    │   │                      replay script, a secret's name or value): (key, what) pairs
    │   │                      (errors; also a ValueError)
    │   └── SecretNotFound     a secret a task names is neither the user's nor shared by root:
    │                          set it (name, uid)
    ├── RefusedError           a request that is well-formed but not allowed
    │   ├── PathRefused        a path outside its root, through a link, wrong owner (path)
    │   │   └── SizeRefused    a file, or the running total, over its size cap
    │   ├── TaskIdRefused      an id that does not match ^[0-9a-z-]{1,64}$
    │   ├── PolicyRefused      a capability, a network, a command that is not claude …
    │   │   └── UncommittedChanges  a dirty repo delegated without its changes (each front
    │   │                      end names its own option: with_option)
    │   ├── PublishRefused     a branch agentbox did not write, or one checked out: kept as
    │   │   │                  is (also a CollectError: the result is kept, unpublished)
    │   │   └── PushRefused    the remote's branch is not an ancestor of the result (a push
    │   │                      would need force): nothing pushed
    │   └── StoreUnreadable    the task store cannot be opened by this user (run as root)
    ├── UnsupportedError       the host lacks a facility (runtime, KVM, binary): install it (fix)
    ├── CommandError           a subprocess failed (argv, returncode, stderr tail)
    │   └── CommandTimeout     ... or ran past its timeout (timeout)
    ├── PrivilegeDropError     a process could not become its unprivileged identity, or the
    │                          drop did not take (the gateway, the egress proxy, the MCP server)
    ├── ImageError             building, verifying or finding an image failed
    ├── SandboxError           a sandbox could not be created, run or destroyed (sandbox)
    │   ├── GuestError         a microVM guest misbehaved (bad frame, wrong kernel, no answer)
    │   │   └── GuestTimeout   the guest did not answer in time
    │   └── SandboxGone        no such sandbox (any more): removed, never made, not ours
    ├── GatewayError           the per-task model gateway failed to start or serve
    │   ├── UpstreamError      the upstream broke the protocol or the connection
    │   │   ├── UpstreamConnectError  no connection to the upstream
    │   │   └── UpstreamTimeout       the upstream did not answer in time
    │   ├── Refusal            a request the budget does not allow (reason)
    │   ├── BodyTooLarge       a request body over the configured cap
    │   └── PolicyViolation    a request the gateway's policy refuses (400; also a ValueError)
    ├── EgressError            the per-task egress proxy failed to start or serve
    ├── SecretStoreError       the host's secret store cannot be read or written (not root's,
    │                          not private, not a store): fix its dir or run as root
    ├── ForgeError             a forge (GitHub, GitLab) API call failed or the remote is not
    │                          a forge's: the branch stays pushed, no pull request (status)
    ├── CollectError           result collection failed; the workspace is kept
    └── TaskError              a task-level failure (task_id)
        └── TaskNotFound

    AgentboxTimeout            mixed into every timeout above: CommandTimeout,
                               GuestTimeout, UpstreamTimeout (``except AgentboxTimeout``)

Exceptions not in the tree, on purpose: private control-flow exceptions that
never leave their module (``_Cancelled``, ``_Stale`` …), and the guest agent's
``ProtocolError`` (:mod:`agentbox.guest` runs *inside* the sandbox on the bare
standard library; the host translates what it reports into :class:`GuestError`),
and :class:`agentbox.cli.reap.Terminated`, a ``KeyboardInterrupt``: a signal, not an error.
``tests/unit/test_errors_tree.py`` imports every module and holds every other
exception class to this tree and this drawing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

__all__ = [
    "AgentboxError",
    "AgentboxTimeout",
    "BodyTooLarge",
    "BoxfileError",
    "CollectError",
    "CommandError",
    "CommandTimeout",
    "ConfigError",
    "EgressError",
    "ForgeError",
    "GatewayError",
    "GuestError",
    "GuestTimeout",
    "ImageError",
    "InvalidValue",
    "PathRefused",
    "PolicyRefused",
    "PolicyViolation",
    "PrivilegeDropError",
    "PublishRefused",
    "PushRefused",
    "Refusal",
    "RefusedError",
    "SandboxError",
    "SandboxGone",
    "SecretNotFound",
    "SecretStoreError",
    "SizeRefused",
    "StoreUnreadable",
    "TaskError",
    "TaskIdRefused",
    "TaskNotFound",
    "UncommittedChanges",
    "UnsupportedError",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamTimeout",
]
# map_exceptions is public too, but not in __all__: that lists the exception classes only.


class AgentboxError(Exception):
    """Root of every error agentbox raises on purpose."""


class AgentboxTimeout(AgentboxError):
    """Mixed into every timeout of the tree (``except AgentboxTimeout`` catches them all)."""


class ConfigError(AgentboxError):
    """Settings, a Boxfile or a registry file is invalid."""


class InvalidValue(ConfigError, ValueError):
    """Plain data checked by hand is wrong; ``errors`` holds ``(key, what)`` pairs in the
    order found (``str()``: ``key: what`` joined by ``; ``)."""

    def __init__(self, errors: Sequence[tuple[str, str]]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(f"{k}: {w}" for k, w in self.errors))


class BoxfileError(ConfigError):
    """A Boxfile key is unknown or has a bad value; ``key`` names it."""

    def __init__(self, message: str, *, key: str | None = None, path: Path | None = None) -> None:
        where = f"{path}: " if path else ""
        named = f"[{key}] " if key else ""
        super().__init__(f"{where}{named}{message}")
        self.key = key
        self.path = path


class RefusedError(AgentboxError):
    """A well-formed request that policy does not allow. Nothing was started."""


class PathRefused(RefusedError):
    """A path resolves outside its allowed root, through a link, or has the wrong owner."""

    def __init__(self, message: str, *, path: Path | str | None = None) -> None:
        super().__init__(f"{message}: {path}" if path is not None else message)
        self.path = path


class SizeRefused(PathRefused):
    """A file (or the running total) is over its size cap."""


class TaskIdRefused(RefusedError):
    """A task id that does not match ``^[0-9a-z-]{1,64}$``."""


class PolicyRefused(RefusedError):
    """A capability, host networking, a non-``claude`` command, an env var not allowed…"""


class UncommittedChanges(PolicyRefused):
    """A repo with uncommitted changes, delegated without asking for them to be copied.

    The launcher's message ends "commit them or include them"; how to include them is
    the front end's word (``--include-uncommitted`` on the command line,
    ``include_uncommitted=true`` over MCP): :meth:`with_option`.
    """

    def with_option(self, option: str) -> str:
        """The message naming the front end's ``option``."""
        return f"{self} with {option}"


class UnsupportedError(AgentboxError):
    """The host lacks a facility (a runtime, KVM, a binary); ``fix`` says how to get it."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(f"{message} (fix: {fix})" if fix else message)
        self.fix = fix


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


class CommandError(AgentboxError):
    """A subprocess failed. Carries argv, the exit code and the tail of stderr."""

    def __init__(
        self, argv: Sequence[str], returncode: int | None, stderr: str = "", stdout: str = ""
    ) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout
        shown = " ".join(self.argv[:12]) + (" …" if len(self.argv) > 12 else "")
        msg = f"command failed (exit {returncode}): {shown}"
        if stderr.strip():
            msg += f"\n{_tail(stderr)}"
        super().__init__(msg)


class CommandTimeout(CommandError, AgentboxTimeout):
    """A subprocess ran past its timeout and was killed."""

    def __init__(self, argv: Sequence[str], timeout: float, stderr: str = "") -> None:
        super().__init__(argv, None, stderr)
        self.timeout = timeout
        self.args = (f"command timed out after {timeout:g}s: {' '.join(self.argv[:12])}",)


class PrivilegeDropError(AgentboxError):
    """A process could not drop to its unprivileged identity, or the drop did not take
    (a capability, a root id or no ``no_new_privs`` left): it must not go on."""


class ImageError(AgentboxError):
    """Building, verifying or finding a sandbox image failed."""


class SandboxError(AgentboxError):
    """A sandbox could not be created, run or destroyed; ``sandbox`` names it."""

    def __init__(self, message: str, *, sandbox: str | None = None) -> None:
        super().__init__(f"sandbox {sandbox}: {message}" if sandbox else message)
        self.sandbox = sandbox


class GuestError(SandboxError):
    """A microVM guest misbehaved: a malformed frame, the host's kernel, no answer."""


class GuestTimeout(GuestError, AgentboxTimeout):
    """The guest did not answer in time (the channel itself may still be fine)."""


class SandboxGone(SandboxError):
    """No sandbox of that name exists (any more): removed, never made, or not this backend's.

    What :meth:`~agentbox.backends.base.Backend.follow` raises for a detached sandbox
    another process already followed to its end and removed.
    """


class GatewayError(AgentboxError):
    """The per-task model gateway failed to start or to serve."""


class UpstreamError(GatewayError):
    """The upstream broke the protocol or the connection."""


class UpstreamConnectError(UpstreamError):
    """No connection to the upstream."""


class UpstreamTimeout(UpstreamError, AgentboxTimeout):
    """The upstream did not answer in time."""


class Refusal(GatewayError):
    """A request the budget does not allow; ``reason`` is the usage-file key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class BodyTooLarge(GatewayError):
    """The request body passed the configured cap."""


class PolicyViolation(GatewayError, ValueError):
    """A request the policy refuses (400); the message names the part and why."""


class EgressError(AgentboxError):
    """The per-task egress proxy failed to start or to serve."""


class SecretStoreError(AgentboxError):
    """The host's secret store cannot be read or written: its dir is not root's or not
    private, a file is not a store, or the caller is not root. Never carries a value."""


class SecretNotFound(ConfigError):
    """A secret a task (or a command) names is not set for its user, and root has not
    shared one of that name; ``name`` and ``uid`` say which. The message says how to set it."""

    def __init__(self, name: str, *, uid: int | None = None) -> None:
        who = f" for uid {uid}" if uid is not None else ""
        super().__init__(
            f"secret {name} is not set{who} (set it with `agentbox secret set {name}`, "
            "or ask root to share one with `agentbox secret set --shared`)"
        )
        self.name = name
        self.uid = uid


class CollectError(AgentboxError):
    """Result collection failed. The workspace is kept so it can be retried."""


class PublishRefused(CollectError, RefusedError):
    """Publishing a result would overwrite a ref agentbox did not write (or a branch that is
    checked out). Nothing in the user's repo changed; the result is kept in the shadow dir."""


class PushRefused(PublishRefused):
    """Pushing a result would need force: the remote already has the branch at a commit
    that is not an ancestor of the result (or one this repo does not have). Nothing was
    pushed; the result is kept."""


class ForgeError(AgentboxError):
    """A forge's API (GitHub, GitLab) refused or failed a call, or a remote is not on a
    forge agentbox knows; ``status`` is the HTTP status when there was one. The pushed
    branch stays; no pull request was opened. Never carries a token."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class StoreUnreadable(RefusedError):
    """The launcher's task store cannot be opened: not this user's to read, or not a
    database. The message says which, in one line."""


class TaskError(AgentboxError):
    """A task-level failure; ``task_id`` names the task."""

    def __init__(self, message: str, *, task_id: str | None = None) -> None:
        super().__init__(f"task {task_id}: {message}" if task_id else message)
        self.task_id = task_id


class TaskNotFound(TaskError):
    """No task with that id is known to the launcher."""


@contextlib.contextmanager
def map_exceptions(
    mapping: Mapping[type[BaseException], Callable[[str], AgentboxError]],
    *,
    what: str = "",
) -> Iterator[None]:
    """Translate lower-layer exceptions at a boundary, as httpcore's ``map_exceptions``.

    Inside the block, an exception that is an instance of a key of ``mapping``
    (checked in order) is raised again as ``mapping[type](message)`` from it; the
    message is ``what: <the original>`` when ``what`` is given. An
    :class:`AgentboxError` passes through untouched::

        with map_exceptions({OSError: SandboxError, ValueError: ConfigError}, what="read"):
            ...
    """
    try:
        yield
    except AgentboxError:
        raise
    except BaseException as exc:
        for kind, make in mapping.items():
            if isinstance(exc, kind):
                text = str(exc) or type(exc).__name__
                raise make(f"{what}: {text}" if what else text) from exc
        raise
