"""Frozen environments on disk: the key, the store (freeze, ls, rm, prune), and what setup
produced, on real directories (no sandbox)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from agentbox.boxfile import Setup
from agentbox.config import Settings
from agentbox.env import EnvInfo, EnvStore, env_key
from agentbox.env._key import KeyScope
from agentbox.env._phase import _produced, _snapshot
from agentbox.errors import PathRefused

SETUP = Setup(run=("pip install -r requirements.txt",), inputs=("requirements*.txt",), key="inputs")


def _ws(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "requirements.txt").write_text("attrs\n")
    (ws / "src").mkdir()
    (ws / "src" / "a.py").write_text("x = 1\n")
    return ws


def test_key_covers_image_commands_and_input_contents(tmp_path: Path) -> None:
    ws = _ws(tmp_path)
    key, inputs = env_key("sha256:img1", SETUP, ws)
    assert inputs == ["requirements.txt"]
    assert env_key("sha256:img1", SETUP, ws)[0] == key  # stable
    assert env_key("sha256:img2", SETUP, ws)[0] != key  # another image
    other = SETUP.model_copy(update={"run": ("pip install -r requirements.txt", "true")})
    assert env_key("sha256:img1", other, ws)[0] != key  # other commands
    (ws / "src" / "a.py").write_text("x = 2\n")
    assert env_key("sha256:img1", SETUP, ws)[0] == key  # not an input
    (ws / "requirements.txt").write_text("attrs\npytest\n")
    assert env_key("sha256:img1", SETUP, ws)[0] != key  # an input's content
    (ws / "requirements-dev.txt").write_text("x\n")
    _, inputs2 = env_key("sha256:img1", SETUP, ws)
    assert inputs2 == ["requirements-dev.txt", "requirements.txt"]


def test_by_default_the_whole_tree_keys_it_not_only_the_inputs(tmp_path: Path) -> None:
    """Issue 33 §2: a file setup runs but ``inputs`` does not name (``build.sh``) changes
    the key unless the user opts into ``key = "inputs"``; so do a link's target and an
    executable bit; ``.git`` does not."""
    ws = _ws(tmp_path)
    tree = SETUP.model_copy(update={"key": "tree"})
    assert Setup(run=("true",)).key == "tree"  # the default
    key = env_key("sha256:img1", tree, ws)[0]
    (ws / "build.sh").write_text("echo one\n")
    k1 = env_key("sha256:img1", tree, ws)[0]
    (ws / "build.sh").write_text("echo two\n")
    k2 = env_key("sha256:img1", tree, ws)[0]
    assert len({key, k1, k2}) == 3
    (ws / "build.sh").chmod(0o755)
    assert env_key("sha256:img1", tree, ws)[0] != k2
    (ws / "ln").symlink_to("a")
    k3 = env_key("sha256:img1", tree, ws)[0]
    (ws / "ln").unlink()
    (ws / "ln").symlink_to("b")
    assert env_key("sha256:img1", tree, ws)[0] != k3
    (ws / ".git").mkdir()
    (ws / ".git" / "index").write_text("changes every copy\n")
    assert env_key("sha256:img1", tree, ws)[0] == env_key("sha256:img1", tree, ws)[0]
    # A resumed task keys on the whole tree even with key = "inputs".
    (ws / "build.sh").write_text("echo evil\n")
    narrow = env_key("sha256:img1", SETUP, ws)[0]
    resumed = env_key("sha256:img1", SETUP, ws, KeyScope(resumed=True))[0]
    assert resumed != narrow
    (ws / "build.sh").write_text("echo good\n")
    assert env_key("sha256:img1", SETUP, ws)[0] == narrow
    assert env_key("sha256:img1", SETUP, ws, KeyScope(resumed=True))[0] != resumed


def test_key_covers_user_repo_variables_mounts_and_egress(tmp_path: Path) -> None:
    ws = _ws(tmp_path)
    base = KeyScope(user=1000, repo="1000:/home/a/repo", env={"A": "1"},
                    mounts=[("/opt/v", "/opt/v", True)], hosts=["pypi.org"])  # fmt: skip
    key = env_key("sha256:img", SETUP, ws, base)[0]
    assert env_key("sha256:img", SETUP, ws, base)[0] == key
    for change in (
        {"user": 1001},
        {"user": None},
        {"repo": "1000:/home/a/other"},
        {"env": {"A": "2"}},
        {"env": {"A": "1", "B": "1"}},
        {"mounts": [("/opt/w", "/opt/v", True)]},
        {"hosts": ["pypi.org", "evil.example"]},
    ):
        other = KeyScope(**{**base.__dict__, **change})
        assert env_key("sha256:img", SETUP, ws, other)[0] != key, change


def test_an_input_that_is_a_link_is_refused(tmp_path: Path) -> None:
    ws = _ws(tmp_path)
    secret = tmp_path / "host-secret"
    secret.write_text("root:x\n")
    (ws / "requirements.txt").unlink()
    (ws / "requirements.txt").symlink_to(secret)
    with pytest.raises(PathRefused, match="regular file, not a link"):
        env_key("sha256:img", SETUP, ws)


def test_produced_finds_new_dirs_and_loose_files(tmp_path: Path) -> None:
    ws = _ws(tmp_path)
    before = _snapshot(ws)
    (ws / ".venv" / "bin").mkdir(parents=True)
    (ws / ".venv" / "bin" / "python").write_text("")
    (ws / "src" / "node_modules" / "x").mkdir(parents=True)
    (ws / "src" / "b.py").write_text("new file\n")
    (ws / "src" / "a.py").write_text("changed\n")
    roots, loose = _produced(ws, before)
    assert sorted(roots) == [b".venv", b"src/node_modules"]
    assert loose == [b"src/b.py"]


def test_store_freeze_list_touch_remove_prune(tmp_path: Path) -> None:
    store = EnvStore(Settings(cache_dir=tmp_path / "cache"))
    assert store.list() == []
    stage = store.staging()
    (stage / "tree" / ".venv").mkdir()
    (stage / "tree" / ".venv" / "f").write_bytes(b"x" * 1000)
    (stage / "tree" / ".venv" / "f").chmod(0o6755)  # setuid/setgid: dropped when frozen
    info = store.freeze(stage, EnvInfo(key="ab" * 16, image="img", roots=[".venv"]))
    assert (info.files, info.size) == (1, 1000)
    assert not stage.exists() and store.tree("ab" * 16).is_dir()
    assert (store.tree("ab" * 16) / ".venv" / "f").stat().st_mode & 0o7777 == 0o755
    assert oct(store.root.stat().st_mode & 0o777) == "0o700"
    # A second freeze of the same key keeps the first, drops its own staging.
    stage2 = store.staging()
    (stage2 / "tree" / "other").mkdir()
    kept = store.freeze(stage2, EnvInfo(key="ab" * 16, image="img", roots=["other"]))
    assert kept.roots == [".venv"] and not stage2.exists()
    store.touch("ab" * 16)
    got = store.get("ab" * 16)
    assert got is not None and got.uses == 1
    assert [e.key for e in store.list()] == ["ab" * 16]
    # prune keeps what was used recently, removes what was not.
    assert store.prune(3600) == []
    old = got.model_copy(update={"last_used": time.time() - 7200})
    (store.path("ab" * 16) / "meta.json").write_text(old.model_dump_json())
    assert [e.key for e in store.prune(3600)] == ["ab" * 16]
    assert store.list() == [] and not store.path("ab" * 16).exists()
    assert store.remove("cd" * 16) is False


def test_store_refuses_bad_keys(tmp_path: Path) -> None:
    store = EnvStore(Settings(cache_dir=tmp_path / "cache"))
    for bad in ("../../etc", "AB" * 16, "abc", "a/b" * 8):
        with pytest.raises(PathRefused):
            store.path(bad)


def test_prune_removes_a_dead_tasks_staging(tmp_path: Path) -> None:
    store = EnvStore(Settings(cache_dir=tmp_path / "cache"))
    stage = store.staging()
    past = time.time() - 7200
    os.utime(stage, (past, past))
    store.prune(3600)
    assert not stage.exists()


def test_a_continued_task_is_known_as_one_before_and_after_its_workspace_is_made(
    tmp_path: Path,
) -> None:
    """The setup phase keys a continued task on its whole tree (issue 33 §2): it must know
    the task continues another from the plan recorded at submit (``_pending``) and from
    the record moved into the task dir (``seed``)."""
    from agentbox.core.paths import TaskPaths
    from agentbox.launcher import _session

    settings = Settings(data_dir=tmp_path / "data")
    paths = TaskPaths(settings.data_dir, "t-000000000002")
    paths.root.mkdir(parents=True)
    assert not _session.continues(settings, paths)
    cont = _session.Continuation(previous="t-000000000001", base_commit="a" * 40,
                                 previous_status="done")  # fmt: skip
    _session.record(settings, paths.task_id, cont)
    assert _session.continues(settings, paths)
    _session.forget(settings, paths.task_id)
    assert not _session.continues(settings, paths)
    _session._write(paths.root / _session._RECORD, cont)
    assert _session.continues(settings, paths)
