"""How many processes one task's own git work starts: prepare, collect, publish.

A real repo, the real ``prepare``/``collect``/``publish`` in a child interpreter run
under ``strace -f -e trace=execve``, so every process counts: the git commands we
start and the ones git starts itself (``upload-pack``, ``pack-objects``,
``maintenance run --auto``, ...). A count, not a time: it fails when a change adds
git work per task, whatever the machine's load.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentbox.collect._git import init_repo
from git_helpers import git

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")

#: The whole cost of one task (prepare + collect + publish) as measured: 26 processes
#: (37 before: the workspace's .git is filled by one pack-objects and given a copy of
#: the base index, both repos are made without ``git init``, auto-maintenance is off,
#: and publish's two re-reads are gone), plus one: publish runs git sealed on the result
#: and reads the user's repo's own filter, diff and merge driver names to empty them
#: (``git config --get-regexp``: the host's git-lfs must never run on agent content).
BUDGET = 26

_TASK = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from agentbox.collect import collect, prepare, publish
    repo, work = Path(sys.argv[1]), Path(sys.argv[2])
    ws, shadow, index = work / "ws", work / "shadow.git", work / "base.index"
    base = prepare(repo, ws, shadow, index)
    (ws / "README.md").write_text("changed\\n")
    (ws / "new.txt").write_text("new\\n")
    got = collect(ws, shadow, index, base, task_id="t-cost", message="cost")
    print(publish(shadow, repo, task_id="t-cost", commit=got.commit))
    """
)

_EXEC = re.compile(r'^(\d+)\s+execve\("([^"]*)", \[(.*?)\](?:, 0x| <unfinished)')
_RESUMED = re.compile(r"^(\d+)\s+<\.\.\. execve resumed>")


def _execs(trace: Path) -> list[str]:
    """Each successful exec's argv (``git`` options before the command dropped).

    An exec that overlaps another process's is split by strace (``<unfinished ...>``,
    then ``<... execve resumed>``): it counts only if the resumed half succeeded (a
    PATH search's misses fail with ENOENT).
    """
    out: list[str] = []
    pending: dict[str, str] = {}
    for line in trace.read_text().splitlines():
        resumed = _RESUMED.match(line)
        if resumed is not None:
            cmd = pending.pop(resumed.group(1), None)
            if cmd is not None and "= -1" not in line:
                out.append(cmd)
            continue
        m = _EXEC.match(line)
        if m is None or "ENOENT" in line:
            continue
        args = re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(3))
        while len(args) > 1 and args[1].startswith("-") and args[1] != "--":
            del args[1 : 3 if args[1] in ("-c", "-C", "--shallow-file") else 2]
        cmd = " ".join([Path(args[0]).name, *args[1:2]])
        if "<unfinished" in line:
            pending[m.group(1)] = cmd
        else:
            out.append(cmd)
    return out


def test_one_tasks_git_work_stays_within_its_process_budget(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for i in range(12):
        (repo / f"f{i}.txt").write_text(f"file {i}\n")
    (repo / "README.md").write_text("hello\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "init")
    work = tmp_path / "work"
    work.mkdir()
    trace = tmp_path / "trace"
    res = subprocess.run(
        ["strace", "-f", "-qq", "-s", "256", "-e", "trace=execve", "-e", "signal=none",
         "-o", str(trace), sys.executable, "-c", _TASK, str(repo), str(work)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "agentbox/t-cost"
    assert git(repo, "show", "agentbox/t-cost:new.txt") == "new\n"
    execs = [e for e in _execs(trace) if not e.startswith("python")]
    assert execs, "strace saw no process at all"
    assert not [e for e in execs if "maintenance" in e], execs
    # The workspace's .git is filled from the shadow dir without a fetch (no upload-pack
    # of the shadow dir: only the user's repo is fetched from, once).
    assert sum(e.startswith("git-upload-pack") for e in execs) == 1, execs
    assert len(execs) <= BUDGET, f"{len(execs)} processes: {execs}"


_CACHED = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from agentbox.collect import prepare
    repo, work, cache = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    n = sys.argv[4]
    prepare(repo, work / n / "ws", work / n / "shadow.git", work / n / "base.index",
            cache=cache)
    """
)


def test_a_prepare_from_the_base_cache_starts_three_git_processes(tmp_path: Path) -> None:
    """The second task on a commit: rev-parse and status in the user's repo, one
    cat-file for the files; no fetch, upload-pack, ls-tree, read-tree or pack-objects."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for i in range(12):
        (repo / f"f{i}.txt").write_text(f"file {i}\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "init")
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    args = [str(repo), str(work), str(cache)]
    subprocess.run([sys.executable, "-c", _CACHED, *args, "first"], check=True, timeout=300)
    trace = tmp_path / "trace"
    res = subprocess.run(
        ["strace", "-f", "-qq", "-s", "256", "-e", "trace=execve", "-e", "signal=none",
         "-o", str(trace), sys.executable, "-c", _CACHED, *args, "second"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    execs = sorted(e for e in _execs(trace) if not e.startswith("python"))
    assert execs == ["git cat-file", "git rev-parse", "git status"], execs
    assert (work / "second/ws/f3.txt").read_text() == "file 3\n"


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
@pytest.mark.parametrize(("head", "bare"), [("master", True), ("main", False)])
def test_init_repo_writes_what_git_init_writes(
    tmp_path: Path, fmt: str, head: str, bare: bool
) -> None:
    """The shadow dir and the workspace's .git are made without ``git init``: the same
    files, modes and bytes as ``git init --template=`` (then ``bare = false``) makes."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    init_repo(ours, fmt, head=head, bare=bare)
    env = {"PATH": os.environ["PATH"], "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}
    subprocess.run(["git", "init", "--quiet", "--template=", "--bare", f"--initial-branch={head}",
                    f"--object-format={fmt}", str(theirs)], env=env, check=True)  # fmt: skip
    if not bare:
        cfg = theirs / "config"
        cfg.write_text(cfg.read_text().replace("\tbare = true\n", "\tbare = false\n"))

    def listing(root: Path) -> list[tuple[str, int, bytes]]:
        return sorted(
            (str(p.relative_to(root)), p.stat().st_mode, b"" if p.is_dir() else p.read_bytes())
            for p in root.rglob("*")
        )

    assert listing(ours) == listing(theirs)
    git_env = {**env, "GIT_DIR": str(ours)}
    out = subprocess.run(["git", "rev-parse", "--show-object-format", "--is-bare-repository"],
                         env=git_env, capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.split() == [fmt, "true" if bare else "false"]


_COLLECT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import agentbox.collect._collect as c
    from agentbox.collect import collect, prepare
    from agentbox.collect._model import Base
    repo, work, step = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if sys.argv[4] == "git diff-files":
        c.SMALL_BASE_KEYS = -1  # git judges, however small the base
    ws, shadow, index = work / "ws", work / "shadow.git", work / "base.index"
    if step == "prepare":
        (work / "base.json").write_text(prepare(repo, ws, shadow, index).model_dump_json())
        sys.exit(0)
    base = Base.model_validate_json((work / "base.json").read_text())
    if step == "change":
        (ws / "f3.txt").write_text("changed\\n")
    elif step == "revert":
        (ws / "f3.txt").write_text("file 3\\n")
    got = collect(ws, shadow, index, base, task_id="t-same", message="m")
    print(got.changed, got.branch)
    """
)


@pytest.mark.parametrize("judge", ["own lstat", "git diff-files"])
def test_a_collection_that_finds_nothing_changed_runs_no_update_ref(
    tmp_path: Path, judge: str
) -> None:
    """An agent that changed nothing: the first collection starts no git process (a small
    base: our own lstat of each entry) or one (git's stat oracle), never an ``update-ref
    -d`` of a branch that was never made. A branch an earlier collection made is still
    deleted when the workspace is back to its base."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    for i in range(6):
        (repo / f"f{i}.txt").write_text(f"file {i}\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "init")
    work = tmp_path / "work"
    work.mkdir()

    def step(name: str) -> tuple[str, list[str]]:
        trace = tmp_path / f"trace-{name}"
        res = subprocess.run(
            ["strace", "-f", "-qq", "-s", "256", "-e", "trace=execve", "-e", "signal=none",
             "-o", str(trace), sys.executable, "-c", _COLLECT, str(repo), str(work), name,
             judge],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        return res.stdout.strip(), sorted(e for e in _execs(trace) if not e.startswith("python"))

    step("prepare")
    out, execs = step("same")
    assert out == "False"
    assert execs == ([] if judge == "own lstat" else ["git diff-files"]), execs
    out, _ = step("change")
    assert out == "True agentbox/t-same"
    assert git(work / "shadow.git", "rev-parse", "--verify", "-q", "agentbox/t-same")
    out, execs = step("revert")
    assert out == "False"
    assert "git update-ref" in execs, execs
    res = subprocess.run(
        ["git", "--git-dir", str(work / "shadow.git"), "rev-parse", "--verify", "-q",
         "refs/heads/agentbox/t-same"], capture_output=True, check=False,
    )  # fmt: skip
    assert res.returncode != 0, "the branch of an earlier collection was left"
