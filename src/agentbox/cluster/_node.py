"""The node side: one launcher per host, fed attempts from the driver.

:class:`NodeService` is plain Python (no Ray): the node actor wraps it, and the
local executor and the unit tests use it directly. It holds this host's
:class:`~agentbox.launcher.Launcher` with this host's settings (data dir, repos
root, model registry and keys, all read from the node's own environment), so
every task runs with exactly the security of a local one. What it receives is
an :class:`~agentbox.cluster.Attempt` (task text, a model *name*, budget,
deadline, Boxfile) and the base commit as a git bundle; what it returns is a
:class:`~agentbox.cluster.NodeOutcome`.

``run`` is idempotent on the attempt id: a second call (Ray retrying, a driver
resuming) never starts a second task; it waits for the first and returns its
outcome, rebuilt from the launcher's store if this process restarted.

On a Ray node the service runs unprivileged (the node user, group ``agentbox``)
and reaches the host's root launcher only through its socket
(:meth:`NodeService.over_socket`): it may submit tasks for repos it owns (the
ones it makes from bundles) and see only its own tasks. The in-process launcher
(root) is for the local executor and the tests.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agentbox.boxfile import Boxfile
from agentbox.cluster._gitio import bundle_result, unbundle
from agentbox.cluster._spec import MAX_RESULT_BUNDLE, Attempt, NodeOutcome
from agentbox.config import Settings
from agentbox.core import host as _host
from agentbox.core.log import get_logger
from agentbox.errors import AgentboxError, RefusedError, TaskNotFound
from agentbox.launcher.api import TaskRequest
from agentbox.launcher.attempts import GroupView, attempt_id
from agentbox.launcher.client import LauncherClient

if TYPE_CHECKING:
    from agentbox.launcher import Launcher

log = get_logger(__name__)


def node_problems(settings: Settings) -> list[str]:
    """What keeps this host from running tasks: the doctor's probes a node needs
    (podman, the OCI runtime, Claude Code, the image). Empty when it may join."""
    from agentbox.image import resolve

    facilities = [
        _host.podman(),
        _host.podman_runtime(settings.runtime),
        _host.claude_code(settings.claude_binary),
    ]
    out = [f"{f.name}: {f.detail}" + (f" (fix: {f.fix})" if f.fix else "")
           for f in facilities if not f.ok]  # fmt: skip
    try:
        resolve(settings)
    except AgentboxError as exc:
        out.append(f"image: {exc}")
    return out


class NodeService:
    """This host's launcher, run on behalf of a batch driver.

    Refuses to start (:class:`~agentbox.errors.RefusedError`, with every
    reason) when :func:`node_problems` finds any, unless ``check`` is False
    (the fake-backend tests).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        slots: int,
        name: str,
        check: bool = True,
        client: LauncherClient | None = None,
        repos: Path | None = None,
    ) -> None:
        if check and client is None and (problems := node_problems(settings)):
            raise RefusedError(f"node {name} refused: " + "; ".join(problems))
        self.settings = settings
        self.name = name
        self.slots = max(1, slots)
        self._repos = repos or settings.repos_root / "agentbox-cluster"
        self.launcher: Launcher | LauncherClient
        if client is not None:
            self.launcher = client
        else:
            from agentbox.launcher import Launcher

            self.launcher = Launcher(settings, max_tasks=self.slots)
            # Tasks a previous life of this node left behind are settled (and their
            # sandboxes reaped) before new ones run: an attempt id asked again then
            # finds its task terminal, never half-alive.
            self.launcher.reconcile()
        self._lock = threading.Lock()
        self._starting: dict[str, threading.Lock] = {}
        log.info("node ready", node=name, slots=self.slots, data_dir=str(settings.data_dir))

    @classmethod
    def over_socket(
        cls, settings: Settings, socket: Path, *, slots: int, name: str, repos: Path
    ) -> NodeService:
        """The service of an unprivileged node actor: the root launcher behind ``socket``,
        the repos it makes from bundles under ``repos`` (a directory it owns, inside the
        launcher's repos root)."""
        client = LauncherClient(socket, timeout=60.0)
        client.list()  # the launcher answers this user now, or the node does not start
        return cls(settings, slots=slots, name=name, check=False, client=client, repos=repos)

    def repo_dir(self, attempt_id: str) -> Path:
        """Where this node keeps the attempt's repo (made from the bundle)."""
        return self._repos / attempt_id

    def info(self) -> dict[str, object]:
        """Name, slots and the attempts running now (for the driver's progress)."""
        return {"node": self.name, "slots": self.slots, "active": self.active()}

    def active(self) -> list[str]:
        """Attempt ids not yet finished on this node."""
        return [t.id for t in self.launcher.list() if not t.terminal]

    def run(self, attempt: Attempt, bundle: bytes) -> NodeOutcome:
        """Run ``attempt`` (once, whatever the number of calls) and return its outcome."""
        aid = attempt.attempt_id
        with self._lock:
            gate = self._starting.setdefault(aid, threading.Lock())
        timings: dict[str, float] = {"received_at": time.time()}
        with gate:  # two calls with one id: the second waits for the first to submit
            try:
                self._known(aid, attempt.attempts)
                log.info("attempt already known: not started again", attempt=aid)
            except TaskNotFound:
                t0 = time.monotonic()
                repo = self.repo_dir(aid)
                if repo.exists():  # a bundle unpacked by a life that died before submitting
                    shutil.rmtree(repo)
                unbundle(bundle, attempt.base, repo)
                timings["unbundle"] = time.monotonic() - t0
                request = TaskRequest(
                    repo=str(repo),
                    task=attempt.task,
                    model=attempt.model,
                    budget=attempt.budget,
                    deadline=attempt.deadline,
                    task_id=aid,
                )
                if isinstance(self.launcher, LauncherClient):
                    if attempt.boxfile:
                        # Over the socket the launcher takes the repo's committed Boxfile
                        # only (a socket client never chooses mounts or the runtime).
                        raise RefusedError(
                            "a batch --boxfile is not taken by a node over the launcher "
                            "socket: commit it as .agentbox/Boxfile.toml in the repo"
                        ) from None
                    if attempt.attempts > 1:
                        self.launcher.submit_group(request, attempt.attempts,
                                                   budget_split=attempt.budget_split)  # fmt: skip
                    else:
                        self.launcher.submit(request)
                else:
                    box = (
                        Boxfile.from_dict(attempt.boxfile, settings=self.settings)
                        if attempt.boxfile
                        else None
                    )
                    if attempt.attempts > 1:
                        self.launcher.submit_group(request, attempt.attempts, boxfile=box,
                                                   budget_split=attempt.budget_split)  # fmt: skip
                    else:
                        self.launcher.submit(request, boxfile=box)
        t0 = time.monotonic()
        if attempt.attempts > 1:
            return self._group_outcome(attempt, timings, t0)
        self.launcher.wait(aid)
        timings["run"] = time.monotonic() - t0
        return self.outcome(aid, base=attempt.base, timings=timings)

    def _known(self, aid: str, attempts: int) -> None:
        """TaskNotFound when this node never took ``aid`` (a task, or a group's id)."""
        if attempts <= 1:
            self.launcher.get(aid)
        else:
            self.launcher.group(aid)  # both the launcher and its client: TaskNotFound

    def _group_view(self, group: str) -> GroupView:
        if isinstance(self.launcher, LauncherClient):
            return self.launcher.group(group)
        return self.launcher.group_view(group)

    def _group_outcome(self, attempt: Attempt, timings: dict[str, float], t0: float) -> NodeOutcome:
        """A best-of-N attempt: wait for every attempt of the group, publish its pick as
        ``agentbox/<aid>`` in the node's repo (once: the launcher may have already), and
        send that branch back with the pick's report and the group's scores."""
        aid = attempt.attempt_id
        for k in range(1, attempt.attempts + 1):
            self.launcher.wait(attempt_id(aid, k))
        view = self._group_view(aid)
        if view.pick is not None and view.branch is None:
            try:
                self.launcher.publish_pick(aid, view.pick)
            except AgentboxError as exc:
                log.warning("publishing a group's pick failed", group=aid, error=str(exc))
            view = self._group_view(aid)
        timings["run"] = time.monotonic() - t0
        group = view.model_dump(mode="json")
        tokens = sum(a.tokens.total for a in view.attempts)
        if view.pick_id is None or view.branch is None:
            why = "no attempt qualifies (none ended done with its tests passing)"
            if view.pick_id is not None:
                why = f"the pick (attempt {view.pick}) could not be published on the node"
            return NodeOutcome(attempt_id=aid, node=self.name, status="failed", tokens=tokens,
                               error=f"best-of-{attempt.attempts}: {why}", group=group,
                               timings=timings)  # fmt: skip
        out = self.outcome(view.pick_id, base=attempt.base, timings=timings, repo_of=aid,
                           branch=view.branch)  # fmt: skip
        return out.model_copy(update={"attempt_id": aid, "tokens": tokens, "group": group})

    def outcome(
        self,
        aid: str,
        *,
        base: str,
        timings: dict[str, float],
        repo_of: str | None = None,
        branch: str | None = None,
    ) -> NodeOutcome:
        """The finished attempt's outcome: its branch as a bundle, report, transcript tail
        (``repo_of``/``branch``: a group's pick, whose repo is the group's and whose branch
        there is ``agentbox/<group>``)."""
        info = self.launcher.get(aid)
        res = self.launcher.result(aid)
        data = b""
        error = info.error or ""
        t0 = time.monotonic()
        if res.commit and res.branch:
            data = bundle_result(self.repo_dir(repo_of or aid), branch or res.branch, base)
            if len(data) > MAX_RESULT_BUNDLE:
                data, error = b"", f"result bundle over {MAX_RESULT_BUNDLE} bytes: not sent"
        elif res.commit:
            error = error or "the result was collected but not published on the node"
        timings["bundle"] = time.monotonic() - t0
        if info.started_at is not None:  # queue + workspace + gateway, then the sandbox
            timings["queued"] = max(0.0, info.started_at - info.created_at)
            timings["task"] = max(0.0, (info.finished_at or time.time()) - info.started_at)
        timings["done_at"] = time.time()
        transcript = ""
        with contextlib.suppress(AgentboxError, OSError, ValueError):
            transcript = self.launcher.transcript(aid, since=-200, limit=200).model_dump_json()
        if len(transcript) > 8 * 1024 * 1024:
            transcript = ""
        status = info.status if info.status in ("done", "failed", "timed_out") else "cancelled"
        return NodeOutcome(
            attempt_id=aid,
            node=self.name,
            status=status,
            commit=res.commit if data else "",
            bundle=data,
            tokens=info.tokens.total,
            report=res.report,
            transcript=transcript,
            error=error[:4000],
            timings=timings,
        )

    def cancel(self, attempt_id: str) -> bool:
        """Cancel the attempt if this node runs it; False when it does not know it."""
        try:
            self.launcher.cancel(attempt_id)
        except TaskNotFound:
            return False
        return True

    def close(self) -> None:
        """Cancel what runs, let it be collected, stop the launcher (in-process), or
        cancel this node's running attempts (over the socket)."""
        if isinstance(self.launcher, LauncherClient):
            for aid in self.active():
                with contextlib.suppress(AgentboxError):
                    self.launcher.cancel(aid)
            self.launcher.close()
        else:
            self.launcher.shutdown(grace=30.0)
