"""Whole-task overhead: ``agentbox run`` versus the same ``claude -p`` run directly on the host.

Both sides run the real Claude Code binary against the same one-turn replay
script served by the same gateway code; only the wrapping differs:

* baseline: a gateway already listening on 127.0.0.1, then ``claude -p`` in a
  plain copy of the repo on the host (no sandbox, no collection);
* agentbox (API): ``Launcher.submit`` → ``wait``: validation, workspace copy,
  gateway spawn, hardened podman sandbox, collection, publish;
* agentbox (CLI): the whole ``agentbox run`` command, interpreter start included.

Usage (as root, after scripts/setup.sh and ``agentbox image build``)::

    .venv/bin/python bench/task_overhead.py [--runs 3]

Prints a table of median and min wall times and the ratio of each to the
baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentbox.config import Settings
from agentbox.launcher import Launcher, TaskRequest

ROOT = Path(__file__).resolve().parents[1]
ONE_TURN = """\
name: one-turn
turns:
  - text: "Nothing to change: the repo is fine."
"""
FLAGS = ["-p", "--output-format", "stream-json", "--verbose", "--dangerously-skip-permissions"]


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def make_repo(path: Path) -> Path:
    shutil.copytree(ROOT / "demo" / "sample-repo", path)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "-c", "user.name=b", "-c", "user.email=b@l", "commit", "-q", "-m", "s")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def baseline(base: Path, script: Path, runs: int) -> list[float]:
    """``claude -p`` on the host against a gateway already listening on loopback."""
    settings = Settings()
    port = free_port()
    token = secrets.token_urlsafe(32)
    tok = base / "token"
    tok.write_text(token)
    tok.chmod(0o600)
    gw = subprocess.Popen(
        [sys.executable, "-m", "agentbox", "gateway", "--listen", f"tcp:127.0.0.1:{port}",
         "--token-file", str(tok), "--model", "replay-demo", "--upstream", f"replay:{script}",
         "--usage-file", str(base / "usage.json")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        for _ in range(200):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        home = base / "home"
        home.mkdir()
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}",
            "ANTHROPIC_API_KEY": token,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "IS_SANDBOX": "1",  # lets root use --dangerously-skip-permissions on the host
        }
        times = []
        for i in range(runs):
            repo = make_repo(base / f"host-{i}-{secrets.token_hex(3)}")
            t0 = time.perf_counter()
            subprocess.run(
                [str(settings.claude_binary), *FLAGS, "--", "Check the repo."],
                cwd=repo, env=env, check=True, capture_output=True, timeout=300,
            )  # fmt: skip
            times.append(time.perf_counter() - t0)
        return times
    finally:
        gw.terminate()
        gw.wait(10)


def agentbox_api(settings: Settings, runs: int) -> tuple[list[float], list[float], list[float]]:
    """Launcher.submit → wait; also the time before the sandbox starts and after it stops."""
    total, before, after = [], [], []
    with Launcher(settings, max_tasks=1) as launcher:
        for i in range(runs):
            repo = make_repo(settings.repos_root / f"api-{i}-{secrets.token_hex(3)}")
            t0 = time.perf_counter()
            info = launcher.submit(
                TaskRequest(repo=str(repo), task="Check the repo.", model="one-turn",
                            deadline=300.0)
            )  # fmt: skip
            info = launcher.wait(info.id, 600)
            total.append(time.perf_counter() - t0)
            assert info.status == "done", info
            assert info.started_at is not None and info.finished_at is not None
            before.append(info.started_at - info.created_at)
            log = settings.data_dir / "tasks" / info.id / "logs" / "launcher.log"
            after.append(_collect_seconds(log))
    return total, before, after


def _collect_seconds(log: Path) -> float:
    """Seconds from 'agent exited' to 'finished' in a task's launcher log (1 s resolution)."""
    stamps = {}
    for line in log.read_text().splitlines():
        hhmmss, _, msg = line.partition(" ")
        h, m, s = (int(x) for x in hhmmss.split(":"))
        if msg.startswith("agent exited"):
            stamps["exit"] = h * 3600 + m * 60 + s
        if msg.startswith("finished"):
            stamps["end"] = h * 3600 + m * 60 + s
    return float(stamps.get("end", 0) - stamps.get("exit", 0))


def agentbox_cli(base: Path, runs: int) -> list[float]:
    env = {
        "PATH": os.environ["PATH"],
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
    }
    times = []
    for i in range(runs):
        repo = make_repo(base / "repos" / f"cli-{i}-{secrets.token_hex(3)}")
        t0 = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-m", "agentbox", "run", "--repo", str(repo), "--model", "one-turn",
             "--json", "Check the repo."],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if res.returncode != 0:
            raise SystemExit(f"agentbox run failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (the launcher drives podman as root)", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="agentbox-bench-", dir="/var/tmp"))
    base.chmod(0o711)
    try:
        script = base / "one-turn.yaml"
        script.write_text(ONE_TURN)
        (base / "models.toml").write_text(
            f'[models.one-turn]\nkind = "replay"\nupstream = "{script}"\n'
        )
        (base / "data").mkdir()
        (base / "repos").mkdir()
        settings = Settings(
            data_dir=base / "data", repos_root=base / "repos", models_file=base / "models.toml"
        )
        # One warm-up of each side (page cache, image layers), not counted.
        for sub in ("warm", "b"):
            (base / sub).mkdir()
        baseline(base / "warm", script, 1)
        agentbox_api(settings, 1)

        base_t = baseline(base / "b", script, args.runs)
        api_t, before_t, after_t = agentbox_api(settings, args.runs)
        cli_t = agentbox_cli(base, args.runs)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    ref = statistics.median(base_t)
    rows = [
        ("claude -p on the host (baseline)", base_t),
        ("agentbox Launcher API (submit→wait)", api_t),
        ("agentbox run (whole CLI command)", cli_t),
    ]
    print(f"\nwhole-task overhead, one-turn replay script, {args.runs} runs each (median / min)\n")
    print(f"| {'what':<38} | {'median s':>8} | {'min s':>7} | {'x baseline':>10} |")
    print(f"|{'-' * 40}|{'-' * 10}|{'-' * 9}|{'-' * 12}|")
    for name, ts in rows:
        med = statistics.median(ts)
        print(f"| {name:<38} | {med:8.2f} | {min(ts):7.2f} | {med / ref:10.2f} |")
    print(
        f"\nof the API time: before the sandbox starts (validate, copy, gateway) "
        f"{statistics.median(before_t):.2f} s; collection + publish ≈ "
        f"{statistics.median(after_t):.0f} s (1 s log resolution)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
