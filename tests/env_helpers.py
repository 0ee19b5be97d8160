"""The environment scenarios' (issue 12) common ground, for tests/e2e/conftest.py's
``env_lab`` fixture: a private data dir and repos root, a replay model, committed repos,
tasks run on one launcher, the pip index this host uses, the sandbox kinds under test.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agentbox.config import Settings
from agentbox.launcher import Launcher, TaskInfo, TaskRequest, TaskResult
from git_helpers import git

#: The Python scenario's tests: they pass only with attrs installed in the project's venv.
PY_TEST_FILE = """\
import attrs


@attrs.define
class Point:
    x: int
    y: int


def test_point():
    assert Point(1, 2).x == 1


def test_attrs_is_installed():
    assert attrs.__version__
"""


@dataclass
class EnvRun:
    """One finished task of a scenario."""

    info: TaskInfo
    result: TaskResult
    repo: Path
    task_dir: Path

    @property
    def setup(self) -> dict[str, object]:
        return self.result.report.get("setup") or {}

    def agent_log(self) -> str:
        return (self.task_dir / "logs" / "agent.jsonl").read_text(errors="replace")


@dataclass
class EnvLab:
    """A scenario's ground: ``settings`` over a private ``base`` dir, one launcher."""

    base: Path
    settings: Settings
    model: str
    launcher: Launcher
    keys: set[str] = field(default_factory=set)
    #: (tag, content hash) of the images it built; docker's copy is named by the hash.
    images: list[tuple[str, str | None]] = field(default_factory=list)

    def repo(self, name: str, files: dict[str, str]) -> Path:
        """A git repo ``name`` holding ``files`` (relative path: text), committed."""
        path = self.settings.repos_root / name
        for rel, text in files.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_text(text)
        git(path, "init", "-q", "-b", "main")
        commit(path, "a project")
        return path

    def image(self, containerfile: str, tag: str) -> str:
        """``agentbox image build --containerfile`` of ``containerfile`` as ``tag`` (the tag
        is removed at the end). The build is cached by content and the cached image stays
        for the session: modules that build the same Containerfile (on any xdist worker)
        build it once, the others wait for that build on a lock named by the content."""
        from agentbox.image import build_containerfile

        ctx = Path(tempfile.mkdtemp(prefix="ctx-", dir=self.base))
        (ctx / "Containerfile").write_text(containerfile)
        digest = hashlib.sha256(containerfile.encode()).hexdigest()[:16]
        with open(f"/var/tmp/agentbox-test-image-{digest}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            info = build_containerfile(Settings(), ctx / "Containerfile", tag=tag)
        self.images.append((tag, info.hash))
        return tag

    def submit(self, name: str, repo: Path, deadline: float, **kw: object) -> str:
        req = TaskRequest(
            repo=str(repo), task=f"env {name}: run the tests", model=self.model,
            deadline=deadline, task_id=f"{name}-{self.base.name[-8:]}".replace("_", "-"),
        )  # fmt: skip
        return self.launcher.submit(req, **kw).id  # type: ignore[arg-type]

    def finish(self, task_id: str, repo: Path, timeout: float) -> EnvRun:
        info = self.launcher.wait(task_id, timeout=timeout)
        task_dir = self.settings.data_dir / "tasks" / task_id
        run = EnvRun(info, self.launcher.result(task_id), repo, task_dir)
        if key := run.setup.get("key"):
            self.keys.add(str(key))
        return run

    def run(self, name: str, repo: Path, deadline: float = 600.0, **kw: object) -> EnvRun:
        """Submit a task on ``repo`` and wait for it (up to 1.5x its deadline)."""
        return self.finish(self.submit(name, repo, deadline, **kw), repo, deadline * 1.5)


def commit(repo: Path, msg: str) -> None:
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", msg)


def pip_index() -> tuple[str, str]:
    """The attrs page of the first http(s) index this host's pip uses, and its host."""
    from agentbox.egress import host_registries

    pip = [(sch, h, p) for src, sch, h, p in host_registries() if src == "pip"]
    if not pip:
        pytest.skip("this host's pip names no http(s) index")
    sch, h, p = pip[0]
    return f"{sch}://{h}:{p}/simple/attrs/", h


def require_backend(name: str) -> None:
    """Skip unless the sandbox kind ``name`` (runc, runsc, qemu) can run here."""
    if name == "qemu":
        from agentbox.core import host as _host

        if not _host.qemu(Settings().qemu_binary).ok:
            pytest.skip("no usable qemu here")
    elif name == "runsc" and shutil.which("runsc") is None:
        pytest.skip("runsc (gVisor) is not installed")
    elif name == "docker":
        from agentbox.backends.docker._facility import facility

        found = facility(Settings())
        if not found.ok:
            pytest.skip(f"docker: {found.detail}")


#: A Boxfile's head per sandbox kind under test (the scenario adds image and [setup]).
BACKEND_HEADS = {
    "runc": 'backend = "podman"\n',
    "runsc": 'backend = "podman"\nruntime = "runsc"\n',
    "qemu": 'backend = "qemu"\n[resources]\ncpus = 2\nmemory = "2GiB"\n',
    "docker": 'backend = "docker"\n',
}
