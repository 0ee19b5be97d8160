"""Issue 34 (items 1, 4, 5, 7): what a new user hit in the first hour, through the real CLI.

Tasks are made by the real launcher on the in-process FakeBackend (the sandbox is the
only fake part). ``agentbox run`` runs in this process (``agentbox.cli.main``, as the
console script calls it), so the fake stands in for podman there too; ``show`` runs as
its own process on the same data dir.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from agentbox.backends.fake import FakeBackend, FakeScript
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.errors import BoxfileError
from agentbox.launcher import Launcher, TaskRequest
from git_helpers import git

sys.path.insert(0, str(Path(__file__).parent))
import test_lifecycle_fake
from test_cli_new_user import _cli

#: The fake as the default backend with the stand-in gateway (test_lifecycle_fake.fake).
fake = test_lifecycle_fake.fake

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher chowns the workspace to the sandbox uid (root)"
)

SETUP_BOXFILE = '[setup]\nrun = ["python3 -m venv .venv"]\n'


@pytest.fixture
def repo(settings: Settings) -> Path:
    path = settings.repos_root / "proj"
    (path / "sub").mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "README.md").write_text("hello\n")
    (path / "sub" / "x.py").write_text("x = 1\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return path


def _main(monkeypatch: pytest.MonkeyPatch, settings: Settings, cwd: Path, *args: str) -> int:
    """``agentbox ARGS`` in this process, from ``cwd``; its exit code."""
    from agentbox.cli import main

    monkeypatch.setenv("AGENTBOX_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("AGENTBOX_REPOS_ROOT", str(settings.repos_root))
    monkeypatch.setattr(sys, "argv", ["agentbox", *args])
    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as exc:
        main()
    code = exc.value.code
    return code if isinstance(code, int) else (0 if code is None else 1)


def _done_task(settings: Settings, repo: Path, **req: object) -> str:
    """A finished task on the fake that writes one file; ``req``: TaskRequest fields."""
    with (
        Launcher(settings, max_tasks=1) as la,
        FakeBackend.scripted(FakeScript(files={"a.txt": b"a\n"})),
    ):
        tid = la.submit(TaskRequest(repo=str(repo), task="do it", **req)).id  # type: ignore[arg-type]
        la.wait(tid, timeout=30)
    return tid


# -- item 1: --backend/--runtime override one key of the committed Boxfile -------------


@needs_root
def test_backend_flag_keeps_the_committed_boxfile(
    settings: Settings,
    fake: type[FakeBackend],
    repo: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The repo's committed Boxfile has a [setup]; ``--backend`` must not drop it. The
    fake (installed as podman) takes no environment, so the launcher refuses the task
    for its [setup], which shows the committed Boxfile was read under the flag (the old
    CLI built an empty Boxfile: the task ran, without its setup, and ended done)."""
    (repo / ".agentbox").mkdir()
    (repo / ".agentbox" / "Boxfile.toml").write_text(SETUP_BOXFILE)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "boxfile")
    code = _main(monkeypatch, settings, repo, "run", "--repo", str(repo), "--backend",
                 "podman", "do it")  # fmt: skip
    err = capsys.readouterr().err
    assert code == 4, err
    assert "[setup] needs an environment" in err, err
    assert FakeBackend.events == [] or all(e[0] != "create" for e in FakeBackend.events)


def test_overrides_replace_one_key_and_refuse_what_cannot_be_honoured() -> None:
    from agentbox.backends import BACKENDS, backend_class
    from agentbox.env import with_overrides

    box = Boxfile.from_dict({"setup": {"run": ["make"]}, "resources": {"memory": "3GiB"}})
    gv = with_overrides(box, {"runtime": "runsc"}, source="the repo's Boxfile")
    assert gv.runtime == "runsc" and gv.setup == box.setup and gv.resources == box.resources
    assert with_overrides(box, {}, source="x") is box
    with pytest.raises(BoxfileError, match=r"--runtime runsc cannot be honoured.*qemu"):
        with_overrides(box, {"backend": "qemu", "runtime": "runsc"}, source="x")
    crun = Boxfile.from_dict({"runtime": "crun"})
    for name in BACKENDS:  # a backend that runs OCI runtimes but not this one: refused
        runtimes = backend_class(name).runtimes
        if runtimes and "crun" not in runtimes:
            with pytest.raises(BoxfileError, match=f"--backend {name} cannot be honoured.*crun"):
                with_overrides(crun, {"backend": name}, source="the repo's Boxfile")
    # A microVM runs no OCI runtime: the Boxfile's runtime does not apply there.
    assert with_overrides(crun, {"backend": "qemu"}, source="x").backend == "qemu"
    with pytest.raises(BoxfileError, match="--runtime kata"):
        with_overrides(box, {"runtime": "kata"}, source="x")


# -- item 4: run without --repo takes the repo containing the current directory -------


@needs_root
def test_run_without_repo_takes_the_repo_of_the_current_directory(
    settings: Settings,
    repo: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # An unknown model is refused after the repo was found: the refusal shows it was.
    code = _main(monkeypatch, settings, repo / "sub", "run", "--model", "nope", "do it")
    err = capsys.readouterr().err
    assert code == 3 and "unknown model 'nope'" in err, err
    assert "Missing option" not in err
    outside = tmp_path / "not-a-repo"
    outside.mkdir()
    code = _main(monkeypatch, settings, outside, "run", "do it")
    err = capsys.readouterr().err
    # click's error panel wraps a long path over lines: read the words, not the layout.
    words = " ".join(err.replace("│", " ").split())
    assert code == 2 and "not inside a git repository" in words, err


# -- item 5: untracked files left out are said ------------------------------------------


@needs_root
def test_untracked_files_not_copied_are_said(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    (repo / "notes.txt").write_text("mine\n")
    (repo / "sub" / "new.py").write_text("y = 2\n")
    (repo / ".gitignore").write_text("*.log\n")  # itself untracked: counted
    (repo / "build.log").write_text("ignored: never counted\n")
    tid = _done_task(settings, repo)
    show = _cli(settings, "show", tid, "--json")
    rep = json.loads(show.stdout)["result"]["report"]
    assert rep["untracked_not_copied"] == 3, rep
    assert "3 untracked files not copied" in rep["untracked_note"]
    assert "--include-uncommitted" in rep["untracked_note"]
    text = _cli(settings, "show", tid).stdout
    assert "3 untracked files not copied" in text, text
    events = _cli(settings, "logs", tid).stdout
    assert "3 untracked files not copied" in events, events
    # With --include-uncommitted they are copied, and nothing is said.
    with_them = _done_task(settings, repo, include_uncommitted=True)
    rep = json.loads(_cli(settings, "show", with_them, "--json").stdout)["result"]["report"]
    assert "untracked_not_copied" not in rep


# -- item 7: the backend and runtime are recorded ----------------------------------------


@needs_root
def test_backend_and_runtime_are_in_the_report_show_json_and_mcp(
    settings: Settings, fake: type[FakeBackend], repo: Path
) -> None:
    from agentbox.mcp._format import info_dict

    tid = _done_task(settings, repo)
    doc = json.loads(_cli(settings, "show", tid, "--json").stdout)
    assert doc["task"]["backend"] == "podman" and doc["task"]["runtime"] == "runc", doc["task"]
    assert doc["result"]["report"]["backend"] == "podman"
    assert "runtime" in doc["result"]["report"]
    text = _cli(settings, "show", tid).stdout
    assert "sandbox" in text and "podman (runtime runc)" in text, text
    with Launcher(settings, max_tasks=1) as la:
        d = info_dict(la.get(tid))
    assert d["backend"] == "podman" and "runtime" in d
