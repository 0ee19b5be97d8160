"""How many processes one task's own git work starts: prepare, collect, publish.

A real repo, the real ``prepare``/``collect``/``publish`` in a child interpreter run
under ``strace -f -e trace=execve``, so every process counts: the git commands we
start and the ones git starts itself (``upload-pack``, ``pack-objects``,
``maintenance run --auto``, ...). A count, not a time: it fails when a change adds
git work per task, whatever the machine's load.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from git_helpers import git

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")

#: The whole cost of one task (prepare + collect + publish) as measured: 27 processes
#: (37 before the workspace's .git was filled by one pack-objects and given a copy of
#: the base index, auto-maintenance turned off, and publish's two re-reads dropped).
BUDGET = 27

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

_EXEC = re.compile(r'^\d+\s+execve\("([^"]*)", \[(.*?)\](?:, 0x| <unfinished)')


def _execs(trace: Path) -> list[str]:
    """Each successful exec's argv (``git`` options before the command dropped)."""
    out: list[str] = []
    for line in trace.read_text().splitlines():
        m = _EXEC.match(line)
        if m is None or "ENOENT" in line:
            continue
        args = re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(2))
        while len(args) > 1 and args[1].startswith("-") and args[1] != "--":
            del args[1 : 3 if args[1] in ("-c", "-C", "--shallow-file") else 2]
        out.append(" ".join([Path(args[0]).name, *args[1:2]]))
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
