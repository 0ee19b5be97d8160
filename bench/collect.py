"""Collection time on a 50,000-file repo with 100 changed files, against `git status`.

Usage: .venv/bin/python bench/collect.py [--files 50000] [--changed 100] [--runs 7]
       [--prepare-runs 3] [--where DIR] [--small-tasks 20] [--only-small]

``--where`` puts the repo and the workspaces on another filesystem (an XFS or
btrfs mount: the workspace files are then reflinks of the repo's).

Builds the repo with `git fast-import` in a temp dir, prepares a workspace with
agentbox.collect.prepare, changes files (80 edited, 10 added, 10 deleted), then
times, alternately in the same run:

* baseline: `git status --porcelain` in the workspace (its own fresh .git, index
  refreshed once beforehand so git uses its stat cache, as a user's would);
* agentbox: collect() (d_type walk while `git diff-files` stats the tracked
  files against the stat-filled base index, then blobs, index, commit, diff);
* git diff-files alone: the stat oracle collect() runs (for the breakdown);
* agentbox fallback: collect() without git's stat oracle (we lstat every entry).

Prints medians and the ratio to `git status` (target: collect <= 1.5x). Then
the two other ends of a task, each against what a plain copy costs:

* prepare() (the workspace, its own .git, the shadow dir, the stat-filled base
  index) against `cp -a` of the repo's work tree and `.git`;
* publish() (fetch of the result branch into the user's repo) against a plain
  `git fetch` of the same commit from the shadow dir.

And the per-task fixed cost, where the repo is tiny and git's process start-ups are
most of it (``--small-tasks N``, ``--only-small`` for this row alone): N tasks of a
13-file repo, each prepare() + two changed files + collect() + publish(), medians
per phase (the process count per task is tests/integration/test_collect_git_cost.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from agentbox.collect import _collect, collect, prepare, publish

ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "LC_ALL": "C",
}


def make_repo(path: Path, nfiles: int) -> None:
    """A repo with ``nfiles`` small files, 20 per directory (like real repos), via fast-import."""
    subprocess.run(["git", "init", "-q", "-b", "main", str(path)], env=ENV, check=True)
    lines = [b"commit refs/heads/main\ncommitter b <b@b> 0 +0000\ndata 4\ninit\n"]
    for i in range(nfiles):
        data = b"line %d of a generated source file\n" % i * 4
        d = i // 20
        rel = b"pkg%02d/mod%03d/file%05d.py" % (d % 50, d // 50, i)
        lines.append(b"M 100644 inline %s\ndata %d\n%s\n" % (rel, len(data), data))
    subprocess.run(["git", "fast-import", "--quiet"], cwd=path, input=b"".join(lines),
                   env=ENV, check=True)  # fmt: skip
    subprocess.run(["git", "checkout", "-q", "main"], cwd=path, env=ENV, check=True)


def change(ws: Path, nchanged: int) -> None:
    """Edit 80%, add 10%, delete 10% of ``nchanged`` files, spread over the tree."""
    files = sorted(p for p in ws.glob("pkg*/mod*/*.py"))
    step = max(1, len(files) // nchanged)
    picked = files[::step][:nchanged]
    n_edit = nchanged * 8 // 10
    n_add = nchanged // 10
    for i, p in enumerate(picked):
        if i < n_edit:
            if i % 2:
                p.write_bytes(p.read_bytes().replace(b"line", b"LINE", 1))  # same size
            else:
                p.write_bytes(p.read_bytes() + b"# edited\n")
        elif i < n_edit + n_add:
            (p.parent / f"new_{i}.py").write_text(f"NEW = {i}\n")
        else:
            p.unlink()


def timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=50_000)
    ap.add_argument("--changed", type=int, default=100)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--prepare-runs", type=int, default=3)
    ap.add_argument("--where", type=Path, default=None, help="a directory on the fs to test")
    ap.add_argument("--small-tasks", type=int, default=20, help="tiny-repo tasks to time")
    ap.add_argument("--only-small", action="store_true", help="only the tiny-repo tasks")
    args = ap.parse_args()
    if args.small_tasks:
        with tempfile.TemporaryDirectory(prefix="abx-collect-bench-", dir=args.where) as tmp_s:
            small_tasks(Path(tmp_s), args.small_tasks)
    if args.only_small:
        return
    with tempfile.TemporaryDirectory(prefix="abx-collect-bench-", dir=args.where) as tmp_s:
        tmp = Path(tmp_s)
        t0 = time.perf_counter()
        make_repo(tmp / "repo", args.files)
        t_make = time.perf_counter() - t0
        ends = prepare_and_publish(tmp, args.prepare_runs)
        t0 = time.perf_counter()
        base = prepare(tmp / "repo", tmp / "ws", tmp / "shadow.git", tmp / "base.index")
        t_prepare = time.perf_counter() - t0
        ws = tmp / "ws"
        # The workspace's own .git has no stat data yet; one refresh, as a user's clone has.
        subprocess.run(["git", "update-index", "-q", "--refresh"], cwd=ws, env=ENV, check=False)
        change(ws, args.changed)

        def git_status() -> None:
            subprocess.run(["git", "status", "--porcelain"], cwd=ws, env=ENV, check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip

        def ours() -> None:
            got = collect(ws, tmp / "shadow.git", tmp / "base.index", base,
                          task_id="bench", message="bench")  # fmt: skip
            assert got.diffstat.files_changed == args.changed, got.diffstat

        def oracle_only() -> None:
            subprocess.run(["git", f"--git-dir={tmp / 'shadow.git'}", f"--work-tree={ws}",
                            "diff-files", "-z", "--name-only", "--ignore-submodules=all"],
                           env={**ENV, "GIT_INDEX_FILE": str(tmp / "base.index")}, check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip

        def fallback() -> None:
            oracle = _collect._git_changed
            _collect._git_changed = lambda *a: None  # type: ignore[assignment]
            try:
                ours()
            finally:
                _collect._git_changed = oracle

        git_status()
        ours()  # warm the page cache and imports for both
        rows: dict[str, list[float]] = {"git status": [], "collect": [], "git diff-files alone": []}
        for _ in range(args.runs):
            rows["git status"].append(timed(git_status))
            rows["collect"].append(timed(ours))
            rows["git diff-files alone"].append(timed(oracle_only))
        rows["collect, fallback (no git)"] = [timed(fallback) for _ in range(3)]
    base_t = statistics.median(rows["git status"])
    print(f"repo: {args.files} files, {args.changed} changed; made in {t_make:.1f} s, "
          f"prepare() in {t_prepare:.1f} s; {args.runs} runs, medians")  # fmt: skip
    print(f"{'what':<28} {'median s':>9} {'min s':>8} {'vs git status':>14}")
    for name, vals in rows.items():
        med = statistics.median(vals)
        print(f"{name:<28} {med:>9.3f} {min(vals):>8.3f} {med / base_t:>13.2f}x")
    ratio = statistics.median(rows["collect"]) / base_t
    print(f"target collect <= 1.5x git status: {'met' if ratio <= 1.5 else 'NOT met'} "
          f"({ratio:.2f}x)")  # fmt: skip
    print(f"\n{'the other ends':<28} {'median s':>9} {'min s':>8} {'vs baseline':>14}")
    for (name, vals), (_bname, bvals) in zip(ends[1::2], ends[0::2], strict=True):
        med = statistics.median(vals)
        print(f"{name:<28} {med:>9.3f} {min(vals):>8.3f} {med / statistics.median(bvals):>13.2f}x")
    for name, vals in ends[0::2]:
        print(f"{'  baseline: ' + name:<28} {statistics.median(vals):>9.3f} {min(vals):>8.3f}")


def prepare_and_publish(tmp: Path, runs: int) -> list[tuple[str, list[float]]]:
    """prepare() vs `cp -a`, publish() vs `git fetch`, alternately, ``runs`` times each."""
    repo = tmp / "repo"
    cp_t, prep_t, fetch_t, pub_t = [], [], [], []
    for i in range(runs):
        d = tmp / f"ends{i}"
        d.mkdir()
        cp_t.append(timed(lambda d=d: subprocess.run(  # type: ignore[misc]
            ["cp", "-a", str(repo), str(d / "copy")], check=True)))  # fmt: skip
        base = None

        def prep(d: Path = d) -> None:
            nonlocal base
            base = prepare(repo, d / "ws", d / "shadow.git", d / "base.index")

        prep_t.append(timed(prep))
        assert base is not None
        (d / "ws" / "pkg00" / "added.py").write_text("X = 1\n")
        got = collect(d / "ws", d / "shadow.git", d / "base.index", base,
                      task_id=f"ends-{i}", message="bench")  # fmt: skip
        fetch_t.append(timed(lambda d=d, c=got.commit: subprocess.run(  # type: ignore[misc]
            ["git", "-C", str(d / "copy"), "fetch", "-q", str(d / "shadow.git"),
             f"{c}:refs/heads/plain"], env=ENV, check=True)))  # fmt: skip
        pub_t.append(timed(lambda d=d, c=got.commit, i=i: publish(  # type: ignore[misc]
            d / "shadow.git", repo, task_id=f"ends-{i}", commit=c)))  # fmt: skip
        subprocess.run(["rm", "-rf", str(d)], check=True)
    return [("cp -a of the repo", cp_t), ("prepare()", prep_t),
            ("git fetch of the result", fetch_t), ("publish()", pub_t)]  # fmt: skip


def small_tasks(tmp: Path, runs: int) -> None:
    """Per-task fixed cost: prepare/collect/publish of a 13-file repo, ``runs`` times."""
    repo = tmp / "small"
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], env=ENV, check=True)
    for i in range(12):
        (repo / f"f{i}.txt").write_text(f"file {i}\n")
    (repo / "README.md").write_text("hello\n")
    subprocess.run(["git", "add", "-A"], cwd=repo, env=ENV, check=True)
    subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "i"],
                   cwd=repo, env=ENV, check=True)  # fmt: skip
    rows: dict[str, list[float]] = {"prepare()": [], "collect()": [], "publish()": [], "task": []}
    for i in range(runs):
        d = tmp / f"t{i}"
        d.mkdir()
        t0 = time.perf_counter()
        base = prepare(repo, d / "ws", d / "shadow.git", d / "base.index")
        t1 = time.perf_counter()
        (d / "ws" / "README.md").write_text("changed\n")
        (d / "ws" / "new.txt").write_text("new\n")
        got = collect(d / "ws", d / "shadow.git", d / "base.index", base,
                      task_id=f"small-{i}", message="bench")  # fmt: skip
        t2 = time.perf_counter()
        publish(d / "shadow.git", repo, task_id=f"small-{i}", commit=got.commit)
        t3 = time.perf_counter()
        for name, dt in zip(rows, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            rows[name].append(dt)
        subprocess.run(["rm", "-rf", str(d)], check=True)
    print(f"tiny repo (13 files), {runs} tasks, medians (load {os.getloadavg()[0]:.2f})")
    for name, vals in rows.items():
        print(f"  {name:<26} {statistics.median(vals) * 1000:>8.1f} ms  min "
              f"{min(vals) * 1000:.1f} ms")  # fmt: skip
    print()


if __name__ == "__main__":
    main()
