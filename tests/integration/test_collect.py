"""prepare / collect / publish with real git: the ordinary paths and the refusals."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_collect_support import git, make_repo, prepare_in, repo_state

from agentbox.collect import Limits, Report, Tokens, collect, publish
from agentbox.errors import CollectError, PathRefused, RefusedError
from agentbox.launcher.api import TokenUsage

FILES = {
    "README.md": "hello\n",
    "src/app.py": "def f():\n    return 1\n",
    "src/util/helpers.py": "X = 1\n",
    "bin/run.sh": "#!/bin/sh\necho run\n",
    "docs/a.txt": "a\n",
    ".gitignore": "*.pyc\n__pycache__/\n",
    "crlf.txt": b"one\r\ntwo\r\n",
}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = make_repo(tmp_path / "user repo", FILES, mode_x=("bin/run.sh",))
    os.symlink("src/app.py", r / "app-link")
    git(r, "add", "app-link")
    git(r, "commit", "-q", "-m", "link")
    return r


def _collect(p, task_id: str = "t-1", **kw):  # type: ignore[no-untyped-def]
    return collect(p.ws, p.shadow, p.index, p.base, task_id=task_id, message="the task", **kw)


def test_prepare_makes_an_exact_copy_with_its_own_git(repo: Path, tmp_path: Path) -> None:
    before = repo_state(repo)
    p = prepare_in(tmp_path / "task", repo)
    assert p.base.base_commit == git(repo, "rev-parse", "HEAD").strip()
    assert p.base.tree == git(repo, "rev-parse", "HEAD^{tree}").strip()
    assert (p.ws / "crlf.txt").read_bytes() == b"one\r\ntwo\r\n"  # exact bytes, no filter
    assert os.readlink(p.ws / "app-link") == "src/app.py"
    assert os.stat(p.ws / "bin/run.sh").st_mode & 0o777 == 0o755
    # The agent's repo: one commit of the base tree, clean, no hooks.
    assert git(p.ws, "rev-parse", "HEAD^{tree}").strip() == p.base.tree
    assert git(p.ws, "status", "--porcelain") == ""
    assert not (p.ws / ".git/hooks").exists()
    assert p.index.is_file() and Path(str(p.index) + ".stat").is_file()
    assert repo_state(repo) == before


@pytest.mark.parametrize("oracle", [True, False], ids=["git-oracle", "fallback"])
def test_collect_records_changes_as_a_commit_on_the_base(
    oracle: bool, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not oracle:  # git diff-files "failed": every entry is judged by our own lstat
        from agentbox.collect import _collect as cmod

        monkeypatch.setattr(cmod, "_git_changed", lambda *a: None)
    p = prepare_in(tmp_path / "task", repo)
    (p.ws / "src/app.py").write_text("def f():\n    return 2\n")
    (p.ws / "new/deep").mkdir(parents=True)
    (p.ws / "new/deep/file.txt").write_text("new\n")
    (p.ws / "docs/a.txt").unlink()
    (p.ws / "README.md").chmod(0o755)
    (p.ws / "app-link").unlink()
    os.symlink("README.md", p.ws / "app-link")
    (p.ws / "src/util").rename(p.ws / "src/util2")  # a directory moved
    (p.ws / "mod.pyc").write_bytes(b"ignored")  # ignored by .gitignore: left out
    got = _collect(p)
    assert got.branch == "agentbox/t-1"
    assert got.changed
    sh = ["--git-dir", str(p.shadow)]
    assert git(tmp_path, *sh, "rev-parse", f"{got.commit}^").strip() == p.base.base_commit
    assert git(tmp_path, *sh, "rev-parse", "refs/heads/agentbox/t-1").strip() == got.commit
    author = git(tmp_path, *sh, "log", "-1", "--format=%an <%ae>%n%B", got.commit)
    assert author.startswith("agentbox <agentbox@localhost>") and "agentbox-task: t-1" in author
    names = git(tmp_path, *sh, "diff", "--name-status", "--no-renames", p.base.base_commit,
                got.commit).splitlines()  # fmt: skip
    assert sorted(names) == sorted([
        "M\tREADME.md", "M\tapp-link", "D\tdocs/a.txt", "A\tnew/deep/file.txt",
        "M\tsrc/app.py", "D\tsrc/util/helpers.py", "A\tsrc/util2/helpers.py",
    ])  # fmt: skip
    ls = git(tmp_path, *sh, "ls-tree", "-r", got.commit)
    assert "120000 blob" in next(x for x in ls.splitlines() if x.endswith("app-link"))
    assert "100755" in next(x for x in ls.splitlines() if x.endswith("README.md"))
    assert got.files_ignored == 1
    assert got.diffstat.files_changed == 7
    assert "+    return 2" in got.diff
    # Only what changed was read: unchanged files cost a stat, not a read.
    assert got.files_read == 5


def test_unchanged_workspace_gives_no_commit_and_no_branch(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    git(p.ws, "commit", "-q", "--allow-empty", "-m", "agent commit")  # the agent's .git: ignored
    got = _collect(p)
    assert not got.changed and got.files_read == 0 and got.diffstat.files_changed == 0
    assert (got.commit, got.branch, got.diff, got.diff_truncated) == ("", "", "", False)
    assert got.tree == p.base.tree
    sh = ["--git-dir", str(p.shadow)]
    assert git(tmp_path, *sh, "for-each-ref", "refs/heads/agentbox/") == ""
    r = Report(task_id="t-1", status="done", exit_code=0)
    r.add_collected(got)
    assert (r.changed, r.commit, r.branch) == (False, None, None)
    assert "changes   no changes: the agent left every file as it was" in r.to_text()


def test_changes_undone_are_no_changes_and_drop_an_earlier_branch(
    repo: Path, tmp_path: Path
) -> None:
    p = prepare_in(tmp_path / "task", repo)
    original = (p.ws / "README.md").read_bytes()
    (p.ws / "README.md").write_text("edited\n")
    (p.ws / "scratch.txt").write_text("temporary\n")
    first = _collect(p)
    assert first.changed and first.commit and first.branch == "agentbox/t-1"
    # The agent puts everything back (same bytes, new mtimes) and commits in its own .git.
    (p.ws / "README.md").write_bytes(original)
    (p.ws / "scratch.txt").unlink()
    git(p.ws, "commit", "-q", "--allow-empty", "-am", "agent commit")
    again = _collect(p)
    assert not again.changed and again.commit == "" and again.diff == ""
    assert again.files_read == 1  # README.md's stat changed: read, found equal
    sh = ["--git-dir", str(p.shadow)]
    assert git(tmp_path, *sh, "for-each-ref", "refs/heads/agentbox/") == ""


def test_caps_and_truncated_diff(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    (p.ws / "big.bin").write_bytes(b"x" * 5000)
    for i in range(5):
        (p.ws / f"f{i}.txt").write_text(f"{i}\n" * 450)
    got = _collect(p, limits=Limits(max_file_size=4000, max_total_size=3000, max_diff_bytes=500))
    reasons = {s.path: s.reason for s in got.skipped}
    assert "per-file cap" in reasons["big.bin"]
    assert any("total cap" in r for r in reasons.values())
    assert got.diff_truncated and "[diff truncated at 500 bytes" in got.diff


def test_collect_twice_replaces_the_branch(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    (p.ws / "a.txt").write_text("1\n")
    first = _collect(p)
    (p.ws / "a.txt").write_text("2\n")
    second = _collect(p)
    assert first.commit != second.commit
    assert git(tmp_path, "--git-dir", str(p.shadow), "rev-parse", f"{second.commit}^").strip() \
        == p.base.base_commit  # fmt: skip


def test_publish_adds_only_the_branch(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    (p.ws / "src/app.py").write_text("changed\n")
    got = _collect(p)
    before = repo_state(repo)
    assert publish(p.shadow, repo, task_id="t-1", commit=got.commit) == "agentbox/t-1"
    assert repo_state(repo) == before
    assert git(repo, "rev-parse", "agentbox/t-1").strip() == got.commit
    assert git(repo, "show", "agentbox/t-1:src/app.py") == "changed\n"
    with pytest.raises(CollectError):
        publish(p.shadow, repo, task_id="t-1", commit="0" * 40)


def test_publish_refuses_a_checked_out_branch(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    (p.ws / "x").write_text("x\n")
    got = _collect(p)
    git(repo, "checkout", "-q", "-b", "agentbox/t-1")
    with pytest.raises(CollectError):
        publish(p.shadow, repo, task_id="t-1", commit=got.commit)


def test_owner_chown_before_snapshot(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo, owner=(164000, 164000))
    assert all(
        os.lstat(Path(d, n)).st_uid == 164000 for d, ds, fs in os.walk(p.ws) for n in ds + fs
    )
    (p.ws / "README.md").write_text("x\n")
    assert _collect(p).files_read == 1


def test_include_uncommitted(repo: Path, tmp_path: Path) -> None:
    (repo / "README.md").write_text("local edit\n")
    (repo / "untracked.txt").write_text("u\n")
    (repo / "junk.pyc").write_text("ignored\n")
    before = repo_state(repo)
    with pytest.raises(RefusedError, match="uncommitted"):
        prepare_in(tmp_path / "refused", repo)
    assert not any((tmp_path / "refused").iterdir())
    p = prepare_in(tmp_path / "task", repo, include_uncommitted=True)
    assert (p.ws / "README.md").read_text() == "local edit\n"
    assert (p.ws / "untracked.txt").exists() and not (p.ws / "junk.pyc").exists()
    assert p.base.base_commit != p.base.head_commit
    (p.ws / "new.txt").write_text("n\n")
    got = _collect(p)
    publish(p.shadow, repo, task_id="t-1", commit=got.commit)
    assert repo_state(repo) == before
    assert git(repo, "rev-parse", "agentbox/t-1~2").strip() == p.base.head_commit


@pytest.mark.parametrize("case", ["not-git", "no-commit", "bad-name", "not-top", "empty"])
def test_prepare_refuses_before_writing(case: str, repo: Path, tmp_path: Path) -> None:
    target, commit = repo, "HEAD"
    if case == "not-git":
        target = tmp_path / "plain"
        target.mkdir()
    elif case == "no-commit":
        commit = "f" * 40
    elif case == "bad-name":
        commit = "--upload-pack=touch /tmp/x"
    elif case == "not-top":
        target = repo / "src"
    elif case == "empty":
        target = tmp_path / "empty"
        target.mkdir()
        git(target, "init", "-q")
    with pytest.raises(RefusedError):
        prepare_in(tmp_path / "task", target, commit=commit)
    assert not (tmp_path / "task").exists() or not any((tmp_path / "task").iterdir())


def test_prepare_refuses_existing_paths_and_cleans_up(repo: Path, tmp_path: Path) -> None:
    (tmp_path / "task").mkdir()
    (tmp_path / "task/ws").mkdir()
    with pytest.raises(PathRefused):
        prepare_in(tmp_path / "task", repo)
    assert not (tmp_path / "task/shadow.git").exists()
    shutil.rmtree(tmp_path / "task/ws")
    p = prepare_in(tmp_path / "task", repo, commit="HEAD~1")
    assert not (p.ws / "app-link").exists()


def test_report_json_and_text(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    os.mkfifo(p.ws / "pipe")
    (p.ws / "README.md").write_text("new\n")
    got = _collect(p)
    r = Report(task_id="t-1", status="done", exit_code=0, final_message="Done.\nAll good.",
               tokens=Tokens(input=10, output=5))  # fmt: skip
    r.add_collected(got)
    again = Report.model_validate_json(r.to_json())
    assert again == r and again.changed is True
    text = r.to_text()
    assert "agentbox/t-1" in text and "pipe: fifo" in text and "tokens    15" in text
    assert "1 file(s) changed" in text and "  All good." in text
    # One token model: the report's is the launcher's wire model, with the same JSON.
    assert Tokens is TokenUsage
    assert json.loads(r.to_json())["tokens"] == {
        "input": 10, "output": 5, "cache_creation": 0, "cache_read": 0, "cost_usd": None,
    }  # fmt: skip


@pytest.mark.timeout(120)
def test_git_is_only_a_stat_oracle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """diff-files must never open a workspace file: a FIFO .gitattributes would hang it."""
    from agentbox.collect import _collect as cmod

    repo = make_repo(tmp_path / "r", {"pkg/__init__.py": "", "pkg/m.py": "x\n",
                                      ".gitattributes": "*.py text\n"})  # fmt: skip
    p = prepare_in(tmp_path / "task", repo)
    os.utime(p.ws / "pkg/__init__.py", (1, 1))  # an empty tracked file with a new stat
    (p.ws / ".gitattributes").unlink()
    os.mkfifo(p.ws / ".gitattributes")
    os.mkfifo(p.ws / "pkg/.gitattributes")
    reported: list[set[str] | None] = []
    orig = cmod._git_changed

    def spy(*args):  # type: ignore[no-untyped-def]
        reported.append(orig(*args))
        return reported[-1]

    monkeypatch.setattr(cmod, "_git_changed", spy)
    monkeypatch.setattr(cmod, "SMALL_BASE_KEYS", -1)  # git judges, however small the base
    got = _collect(p)
    assert reported and reported[0] is not None  # git answered, no fallback
    assert "pkg/__init__.py" in reported[0] and "pkg/m.py" not in reported[0]
    assert {s.path for s in got.skipped} == {".gitattributes", "pkg/.gitattributes"}
    assert got.files_read == 1 and got.diffstat.files_changed == 0  # same (empty) content


@pytest.mark.parametrize("route", ["objects", "index"])
def test_tree_matches_what_git_add_would_make(
    route: str, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our tree builder (and the index route) against git itself, on D/F swaps and deletions."""
    if route == "index":
        from agentbox.collect import _collect as cmod

        def refuse(*a: object) -> str:
            raise ValueError("force the index route")

        monkeypatch.setattr(cmod, "build_tree", refuse)
    p = prepare_in(tmp_path / "task", repo)
    ws = p.ws
    (ws / "README.md").unlink()
    (ws / "README.md").mkdir()  # a file becomes a directory
    (ws / "README.md/inner.txt").write_text("inner\n")
    shutil.rmtree(ws / "src/util")
    (ws / "src/util").write_text("now a file\n")  # a directory becomes a file
    shutil.rmtree(ws / "docs")  # a whole directory goes
    (ws / "bin/run.sh").unlink()  # a directory is emptied
    (ws / "a/b/c/d").mkdir(parents=True)
    (ws / "a/b/c/d/deep.txt").write_text("deep\n")
    (ws / "a/b/c/empty").mkdir()  # git keeps no empty directory
    (ws / "app-link").unlink()
    (ws / "app-link").write_text("was a link\n")
    os.symlink("README.md/inner.txt", ws / "new-link")
    (ws / "crlf.txt").chmod(0o755)
    (ws / "z.txt").write_text("z\n")
    got = _collect(p)
    check = tmp_path / "check"
    shutil.copytree(ws, check, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    git(check, "init", "-q")
    git(check, "add", "-A")
    assert got.tree == git(check, "write-tree").strip()
    sh = ["--git-dir", str(p.shadow)]
    subprocess.run(["git", *sh, "fsck", "--strict", "--no-dangling"], check=True,
                   capture_output=True)  # fmt: skip


def test_sha256_repository(tmp_path: Path) -> None:
    repo = tmp_path / "r256"
    repo.mkdir()
    git(repo, "init", "-q", "--object-format=sha256", "-b", "main")
    (repo / "a.txt").write_text("a\n")
    (repo / "d").mkdir()
    (repo / "d/b.txt").write_text("b\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "i")
    p = prepare_in(tmp_path / "task", repo)
    assert p.base.object_format == "sha256" and len(p.base.base_commit) == 64
    (p.ws / "d/b.txt").write_text("changed\n")
    (p.ws / "d/c.txt").write_text("new\n")
    got = _collect(p)
    assert got.diffstat.files_changed == 2
    publish(p.shadow, repo, task_id="t-1", commit=got.commit)
    assert git(repo, "show", "agentbox/t-1:d/c.txt") == "new\n"


def test_walk_limit_deletes_nothing_unseen(repo: Path, tmp_path: Path) -> None:
    p = prepare_in(tmp_path / "task", repo)
    (p.ws / "src/app.py").write_text("changed\n")
    got = _collect(p, limits=Limits(max_files=3))
    assert any("walk stopped" in s.reason for s in got.skipped)
    # The one change lies beyond the walk: nothing changed that was seen, nothing deleted.
    assert not got.changed and got.tree == p.base.tree
    names = git(tmp_path, "--git-dir", str(p.shadow), "ls-tree", "-r", "--name-only",
                got.tree).split()  # fmt: skip
    assert sorted(names) == sorted(git(repo, "ls-tree", "-r", "--name-only", "HEAD").split())


def test_public_surface() -> None:
    import agentbox.collect as c
    import agentbox.safepath as s

    assert set(c.__all__) == {"Base", "Collected", "DiffStat", "Limits", "Report", "Skipped",
                              "Tokens", "apply_result", "branch_name", "collect", "prepare",
                              "prepare_unsettled",
                              "publish", "risky_reason", "user_git",
                              "RepoDir", "as_owner", "repo_owner"}  # fmt: skip
    assert {"SafeWriter", "Tree", "openat2", "supported", "check_name"} <= set(s.__all__)
    assert all(hasattr(c, n) for n in c.__all__) and all(hasattr(s, n) for n in s.__all__)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a repo as another user")
def test_repo_of_another_user() -> None:
    """As root (the launcher), git runs in a user's repo as its owner; new objects are theirs."""
    # Not under tmp_path: pytest's base dir is root-only, the owner must reach the repo.
    with tempfile.TemporaryDirectory(prefix="abx-owner-test-") as top:
        tmp_path = Path(top)
        tmp_path.chmod(0o755)
        repo = make_repo(tmp_path / "theirs", {"a.txt": "a\n", "d/b.txt": "b\n"})
        (repo / "d/b.txt").write_text("uncommitted\n")
        (repo / "new.txt").write_text("untracked\n")
        subprocess.run(["chown", "-R", "12345:12345", str(repo)], check=True)
        before = repo_state(repo)
        p = prepare_in(tmp_path / "task", repo, include_uncommitted=True)
        assert (p.ws / "d/b.txt").read_text() == "uncommitted\n" and (p.ws / "new.txt").exists()
        (p.ws / "a.txt").write_text("agent\n")
        got = _collect(p)
        publish(p.shadow, repo, task_id="t-1", commit=got.commit)
        assert repo_state(repo) == before
        owners = {(st.st_uid, st.st_gid) for d, ds, fs in os.walk(repo / ".git")
                  for st in [os.lstat(Path(d, n)) for n in ds + fs]}  # fmt: skip
        assert owners == {(12345, 12345)}
        assert git(repo, "show", "agentbox/t-1:a.txt") == "agent\n"


def test_unchanged_directories_are_not_read(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only directories whose names changed are read; forging a directory's mtime does not help."""
    from agentbox.collect import _walk as cmod

    p = prepare_in(tmp_path / "task", repo)
    st = os.stat(p.ws / "src/util")
    (p.ws / "src/util/sneaky.py").write_text("hidden\n")
    os.utime(p.ws / "src/util", ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime back; ctime moves
    (p.ws / "src/app.py").write_text("edited in place\n")  # a file edit changes no directory
    read: list[str] = []
    orig = cmod._read_dir

    def spy(w, tree, prefix, stack, *, trust):  # type: ignore[no-untyped-def]
        read.append(prefix)
        return orig(w, tree, prefix, stack, trust=trust)

    monkeypatch.setattr(cmod, "_read_dir", spy)
    # With git judging the files (a small base's own lstat of each reads every directory).
    monkeypatch.setattr("agentbox.collect._collect.SMALL_BASE_KEYS", -1)
    got = _collect(p)
    assert read == ["src/util/"]
    names = git(tmp_path, "--git-dir", str(p.shadow), "diff", "--name-only", p.base.base_commit,
                got.commit).split()  # fmt: skip
    assert sorted(names) == ["src/app.py", "src/util/sneaky.py"]


_OPS = ["edit", "same_size", "delete", "add", "add_dir", "rmtree", "file_to_dir", "dir_to_file",
        "chmod", "to_link", "link_to_file", "rename", "add_ignored"]  # fmt: skip


def _apply(ws: Path, op: str, pick: int) -> None:
    files = sorted(p for p in ws.rglob("*") if ".git" not in p.parts and not p.is_dir())
    dirs = sorted(p for p in ws.rglob("*") if ".git" not in p.parts and p.is_dir()
                  and not p.is_symlink())  # fmt: skip
    f = files[pick % len(files)] if files else None
    d = dirs[pick % len(dirs)] if dirs else ws
    if op == "edit" and f and not f.is_symlink():
        f.write_bytes(f.read_bytes() + b"more\n")
    elif op == "same_size" and f and not f.is_symlink():
        data = f.read_bytes()
        f.write_bytes(bytes(reversed(data)) if data else b"")
    elif op == "delete" and f:
        f.unlink()
    elif op == "add":
        (d / f"new{pick}.txt").write_text(f"new {pick}\n")
    elif op == "add_dir":
        (d / f"nd{pick}/deeper").mkdir(parents=True, exist_ok=True)
        (d / f"nd{pick}/deeper/x.txt").write_text("x\n")
    elif op == "rmtree" and d != ws:
        shutil.rmtree(d)
    elif op == "file_to_dir" and f:
        f.unlink()
        f.mkdir()
        (f / "inside.txt").write_text("inside\n")
    elif op == "dir_to_file" and d != ws:
        shutil.rmtree(d)
        d.write_text("was a dir\n")
    elif op == "chmod" and f and not f.is_symlink():
        f.chmod(f.stat().st_mode ^ 0o100)
    elif op == "to_link" and f:
        f.unlink()
        os.symlink(f"target-{pick}", f)
    elif op == "link_to_file" and f and f.is_symlink():
        f.unlink()
        f.write_text("no longer a link\n")
    elif op == "rename" and f:
        f.rename(d / f"renamed{pick}")
    elif op == "add_ignored":
        (d / f"junk{pick}.log").write_text("ignored\n")


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(_OPS), st.integers(0, 50)), min_size=1, max_size=8))
def test_collect_equals_git_add_on_random_edits(ops: list[tuple[str, int]]) -> None:
    with tempfile.TemporaryDirectory(prefix="abx-prop-") as top:
        tmp = Path(top)
        repo = make_repo(tmp / "r", {"a.txt": "a\n", "e.txt": "", "d/b.txt": "b\n",
                                     "d/sub/c.txt": "c\n", "d/sub/e.py": "e\n",
                                     "x/y/z.txt": "z\n", ".gitignore": "*.log\n"})  # fmt: skip
        p = prepare_in(tmp / "task", repo)
        for op, pick in ops:
            _apply(p.ws, op, pick)
        got = _collect(p)
        check = tmp / "check"
        shutil.copytree(p.ws, check, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        git(check, "init", "-q")
        git(check, "add", "-A")
        assert got.tree == git(check, "write-tree").strip(), ops


def test_submodule_pointer_is_kept(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r", {"a.txt": "a\n"})
    head = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "update-index", "--add", "--cacheinfo", f"160000,{head},sub")
    git(repo, "commit", "-q", "-m", "a submodule")
    p = prepare_in(tmp_path / "task", repo)
    assert (p.ws / "sub").is_dir() and not any((p.ws / "sub").iterdir())
    (p.ws / "sub/planted.txt").write_text("inside the submodule\n")
    (p.ws / "a.txt").write_text("changed\n")
    got = _collect(p)
    ls = git(tmp_path, "--git-dir", str(p.shadow), "ls-tree", "-r", got.commit)
    assert f"160000 commit {head}\tsub" in ls and "planted" not in ls
    assert got.diffstat.files_changed == 1
