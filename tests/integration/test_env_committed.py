"""A Boxfile committed at ``.agentbox/Boxfile.toml`` (issue 12, section 5), with real git and
the real launcher: read from the commit, never the work tree; bounded by the host settings;
a failed ``[setup]`` fails the task with its output and starts no agent."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbox.backends import backend_class
from agentbox.config import Settings
from agentbox.env import committed_boxfile
from agentbox.errors import BoxfileError, PolicyRefused, UnsupportedError
from agentbox.launcher import Launcher, TaskRequest
from agentbox.launcher._validate import git_readonly
from git_helpers import git

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the launcher runs as root")


@pytest.fixture
def settings() -> Iterator[Settings]:
    import shutil

    base = Path(tempfile.mkdtemp(prefix="agentbox-envc-", dir="/var/tmp"))
    base.chmod(0o711)
    for sub in ("data", "repos"):
        (base / sub).mkdir()
    yield Settings(
        data_dir=base / "data", repos_root=base / "repos", egress_allow_cap=("*.ok.example",)
    )
    shutil.rmtree(base, ignore_errors=True)


def _repo(settings: Settings, boxfile: str | None, name: str = "r") -> Path:
    repo = settings.repos_root / name
    repo.mkdir()
    (repo / "README").write_text("hi\n")
    if boxfile is not None:
        (repo / ".agentbox").mkdir()
        (repo / ".agentbox" / "Boxfile.toml").write_text(boxfile)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "init")
    return repo


def test_no_committed_boxfile_is_none(settings: Settings) -> None:
    assert committed_boxfile(_repo(settings, None), settings, git_readonly) is None


def test_the_commit_is_read_never_the_work_tree(settings: Settings) -> None:
    repo = _repo(settings, 'deadline = 1234\n[network]\nallow = ["a.ok.example"]\n')
    # Uncommitted edits (even a link to elsewhere) change nothing: the blob of HEAD is read.
    (repo / ".agentbox" / "Boxfile.toml").write_text("deadline = 99\n")
    box = committed_boxfile(repo, settings, git_readonly)
    assert box is not None and box.deadline == 1234 and box.egress_allow == ("a.ok.example",)
    (repo / ".agentbox" / "Boxfile.toml").unlink()
    (repo / ".agentbox" / "Boxfile.toml").symlink_to("/etc/passwd")
    box = committed_boxfile(repo, settings, git_readonly)
    assert box is not None and box.deadline == 1234


def test_a_committed_link_or_oversized_or_bad_boxfile_is_refused(settings: Settings) -> None:
    repo = _repo(settings, None, "link")
    (repo / ".agentbox").mkdir()
    (repo / ".agentbox" / "Boxfile.toml").symlink_to("/etc/passwd")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "link")
    with pytest.raises(BoxfileError, match="not a regular file"):
        committed_boxfile(repo, settings, git_readonly)
    big = _repo(settings, "#" * (1 << 20) + "\n", "big")
    with pytest.raises(BoxfileError, match="too large"):
        committed_boxfile(big, settings, git_readonly)
    bad = _repo(settings, 'network = "host"\n', "bad")
    with pytest.raises(BoxfileError, match="no network") as exc:
        committed_boxfile(bad, settings, git_readonly)
    assert "HEAD:.agentbox/Boxfile.toml" in str(exc.value)


def test_submit_uses_the_committed_boxfile_bounded_by_the_host(settings: Settings) -> None:
    launcher = Launcher(settings)
    try:
        outside = _repo(settings, '[network]\nallow = ["evil.example"]\n', "outside")
        with pytest.raises(PolicyRefused, match="outside this host's egress cap"):
            launcher.submit(TaskRequest(repo=str(outside), task="t"))
        # A backend whose environments_refused says why takes no environment: refused at
        # submit with that reason, naming the backends that do.
        for name in ("docker", "firecracker"):
            why = backend_class(name).environments_refused
            if why is None:
                continue
            other = _repo(settings, f'backend = "{name}"\n[setup]\nrun = ["true"]\n', name)
            with pytest.raises(UnsupportedError, match=f"the {name} backend does not take") as exc:
                launcher.submit(TaskRequest(repo=str(other), task="t"))
            assert why in str(exc.value)
            assert exc.value.fix and "'podman'" in exc.value.fix and "'qemu'" in exc.value.fix
        assert launcher.list() == []  # refused requests create nothing
    finally:
        launcher.close()


@pytest.mark.podman
def test_a_failed_setup_fails_the_task_and_starts_no_agent(
    settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentbox.image import build_default

    build_default(Settings())
    repo = _repo(settings, '[setup]\nrun = ["echo installing; echo boom >&2; exit 7"]\n')
    launcher = Launcher(settings)
    try:
        info = launcher.submit(TaskRequest(repo=str(repo), task="never runs", deadline=120))
        info = launcher.wait(info.id, timeout=300)
        res = launcher.result(info.id)
    finally:
        launcher.close()
    assert info.status == "failed"
    assert info.error is not None and "setup failed (exit 7)" in info.error
    setup = res.report["setup"]
    assert setup["cache"] == "failed" and setup["exit_code"] == 7
    assert "installing" in setup["output_tail"] and "boom" in setup["output_tail"]
    logs = settings.data_dir / "tasks" / info.id / "logs"
    assert (logs / "setup.log").is_file()
    assert not (logs / "agent.jsonl").exists()  # no agent started
    assert not res.branch and not info.branch
    # show's changes row says the agent never started, not "files_changed 0 …" (issue 34 §10)
    from agentbox.cli._view import report_text

    assert res.report["agent_ran"] is False
    capsys.readouterr()
    report_text(info, res)
    shown = capsys.readouterr().out
    assert "none: the agent never started" in shown and "files_changed" not in shown, shown


@pytest.mark.podman
def test_a_setup_that_changes_the_repos_files_fails_the_task(settings: Settings) -> None:
    """Decided in env/_tracked.py: setup may only add files. One that edits or removes a
    file of the repo fails the task, naming them in the setup report and the task error;
    nothing is frozen and no agent starts."""
    from agentbox.env import EnvStore
    from agentbox.image import build_default

    build_default(Settings())
    steps = ["mkdir .venv && echo ok > .venv/f", "echo edited >> README", "rm .gitignore",
             "echo new > untracked.txt"]  # fmt: skip
    repo = _repo(settings, "[setup]\nrun = " + repr(steps).replace("'", '"') + "\n")
    (repo / ".gitignore").write_text(".venv/\n")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@l", "commit", "-q", "-m", "ignore")
    launcher = Launcher(settings)
    try:
        info = launcher.submit(TaskRequest(repo=str(repo), task="never runs", deadline=120))
        info = launcher.wait(info.id, timeout=300)
        res = launcher.result(info.id)
    finally:
        launcher.close()
    assert info.status == "failed"
    assert info.error is not None and "setup changed 2 file(s) of the repo" in info.error
    assert ".gitignore" in info.error and "README" in info.error
    setup = res.report["setup"]
    assert setup["cache"] == "failed" and setup["exit_code"] == 0
    assert setup["tracked_changed"] == [".gitignore", "README"]
    assert EnvStore(settings).get(setup["key"]) is None  # nothing frozen
    assert not (settings.data_dir / "tasks" / info.id / "logs" / "agent.jsonl").exists()
