"""Best-of-N: the wall time of N attempts of one replay task over one attempt, and the
host memory per attempt, against the core count.

Usage (as root, after scripts/setup.sh and ``agentbox image build``)::

    .venv/bin/python bench/attempts.py [--ns 1,2,4] [--runs 1]

Each row is one group (:meth:`agentbox.launcher.Launcher.submit_group`) of N attempts
of the same task with the real Claude Code in hardened podman sandboxes, each with its
own gateway, driven by a 4-turn replay script (read, edit, run the tests, answer); the
launcher runs all N at once (``max_tasks`` = the largest N). Wall time: submit → every
attempt terminal (collected, branch published). Memory: every 0.5 s the PSS of each
process of the group's attempts is summed (gateway, conmon, podman client, the
sandbox's init/relay, claude and the tools it runs; classified as
``bench/density.py`` does); the row shows that sum's peak divided by N. A first
group of one, untimed, warms the image and the caches.

Ideal on C cores for CPU-bound attempts: N attempts take max(1, N / C) times one;
most of an attempt is waiting (the replay model answers at once, so the attempt's
own CPU, Claude Code's start above all, dominates here: the worst case for N > C).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agentbox.config import Settings
from agentbox.launcher import Launcher, TaskRequest
from density import classify, smaps

SCRIPT = r"""
name: bench-attempts
turns:
  - text: "Reading the module."
    tool_use:
      - name: Read
        input: {file_path: "{{cwd}}/mathx.py"}
  - text: "Fixing it."
    tool_use:
      - name: Edit
        input: {file_path: "{{cwd}}/mathx.py", old_string: "x * 3", new_string: "x * 2"}
  - text: "Running the tests."
    tool_use:
      - name: Bash
        input: {command: "cd {{cwd}} && python3 -m unittest -v 2>&1", description: "Tests"}
  - text: "Done."
"""
MODULE = "def double(x: int) -> int:\n    return x * 3\n"
TESTS = (
    "import unittest\n\nfrom mathx import double\n\n\n"
    "class T(unittest.TestCase):\n    def test_double(self) -> None:\n"
    "        self.assertEqual(double(2), 4)\n"
)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def _group(launcher: Launcher, settings: Settings, repo: Path, n: int) -> tuple[float, int, int]:
    """(wall seconds, peak group PSS KiB, attempts done) of one group of ``n``."""
    gid = f"b{n}-{secrets.token_hex(3)}"
    req = TaskRequest(repo=str(repo), task="Fix double() so the tests pass.",
                      model="replay-bench-attempts", task_id=gid, deadline=600.0)  # fmt: skip
    ids = [f"{gid}-a{k}" for k in range(1, n + 1)]
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            cats = classify(settings, ids)
            total = sum((smaps(p) or (0, 0))[0] for pids in cats.values() for p in pids)
            peak = max(peak, total)
            stop.wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    t0 = time.monotonic()
    launcher.submit_group(req, n)
    sampler.start()
    infos = [launcher.wait(i, timeout=900) for i in ids]
    wall = time.monotonic() - t0
    stop.set()
    sampler.join()
    return wall, peak, sum(1 for i in infos if i.status == "done")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="1,2,4")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    ns = [int(x) for x in args.ns.split(",")]
    base = Path(tempfile.mkdtemp(prefix="agentbox-bench-attempts-", dir="/var/tmp"))
    base.chmod(0o711)
    try:
        for sub in ("data", "repos"):
            (base / sub).mkdir()
        (base / "script.yaml").write_text(SCRIPT)
        entry = f'kind = "replay"\nupstream = "{base / "script.yaml"}"\n'
        (base / "models.toml").write_text(f"[models.replay-bench-attempts]\n{entry}")
        settings = Settings(data_dir=base / "data", repos_root=base / "repos",
                            models_file=base / "models.toml")  # fmt: skip
        repo = base / "repos" / "proj"
        repo.mkdir()
        (repo / "mathx.py").write_text(MODULE)
        (repo / "test_mathx.py").write_text(TESTS)
        _git(repo, "init", "-q", "-b", "main")
        _git(repo, "add", "-A")
        _git(repo, "-c", "user.name=b", "-c", "user.email=b@l", "commit", "-q", "-m", "bug")
        rows: dict[int, list[tuple[float, int, int]]] = {n: [] for n in ns}
        with Launcher(settings, max_tasks=max(ns)) as launcher:
            _group(launcher, settings, repo, 1)  # warm-up, untimed
            for _ in range(args.runs):
                for n in ns:
                    rows[n].append(_group(launcher, settings, repo, n))
        cores = os.cpu_count() or 1
        one = statistics.median(w for w, _, _ in rows[ns[0]]) if ns[0] == 1 else None
        print(f"cores: {cores}; runs per row: {args.runs}; replay task, real Claude Code, podman")
        print("| N | done | wall (s) | N attempts / 1 | ideal on "
              f"{cores} cores | peak PSS of the group (MiB) | per attempt (MiB) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for n in ns:
            wall = statistics.median(w for w, _, _ in rows[n])
            pss = statistics.median(p for _, p, _ in rows[n]) / 1024
            done = min(d for _, _, d in rows[n])
            ratio = f"{wall / one:.2f}x" if one else "-"
            ideal = f"{max(1.0, n / cores):.2f}x"
            print(f"| {n} | {done}/{n} | {wall:.1f} | {ratio} | {ideal} | {pss:.0f} | "
                  f"{pss / n:.0f} |")  # fmt: skip
        return 0
    finally:
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
