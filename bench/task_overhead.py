"""Whole-task overhead: ``agentbox run`` versus the same ``claude -p`` run directly on the host.

Both sides run the real Claude Code binary against the same one-turn replay
script served by the same gateway code; only the wrapping differs:

* baseline: a gateway already listening on 127.0.0.1, then ``claude -p`` in a
  plain copy of the repo on the host (no sandbox, no collection);
* agentbox (API): ``Launcher.submit`` → ``wait``: validation, workspace copy,
  gateway spawn (it goes on starting while the sandbox starts: the time the launcher
  then still waits for it is its own row), hardened podman sandbox, collection, publish;
* agentbox (CLI): the whole ``agentbox run`` command (the console script a user
  runs), interpreter start included: run in its own process (``AGENTBOX_FRONT_END=off``)
  and served by the front end of a ``launcher serve`` started for the bench
  (``require``: :mod:`agentbox.front`), each fresh and on a warm pool.

Usage (as root, after scripts/setup.sh and ``agentbox image build``)::

    .venv/bin/python bench/task_overhead.py [--runs 3]

Prints a table of median and min wall times and the ratio of each to the
baseline measured in the same run, then the API task broken down by phase:
before the sandbox starts (validation, gateway, workspace copy: ``prepare``
shown on its own), sandbox start → the agent's first output, the agent (and the
sandbox's stop), ``collect``, ``publish``, and the rest (report, status). The
phases are timed in-process around the launcher's own calls (``prepare``,
``collect``, ``publish``), from the task's ``started_at``, and by watching its
log files for the first byte; nothing in the launcher is changed for it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentbox.backends import get_backend
from agentbox.config import Settings
from agentbox.core.wait import socket_accepts
from agentbox.launcher import Launcher, TaskRequest, _finish, _runner
from agentbox.launcher._pool import pool_template

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


def baseline(base: Path, script: Path, runs: int, *, bare: str | None = None) -> list[float]:
    """``claude -p`` on the host against a gateway already listening on loopback.

    ``bare``: the same ``claude -p`` in a bare ``podman run --rm`` of that image
    instead (host network, the repo bind-mounted, none of our hardening, relay,
    workspace disk or detach): what starting a container costs by itself.
    """
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
            argv = [str(settings.claude_binary), *FLAGS, "--", "Check the repo."]
            if bare is not None:
                repo.chmod(0o777)
                for top, dirs, files in os.walk(repo):
                    for n in (*dirs, *files):
                        os.chmod(os.path.join(top, n), 0o777, follow_symlinks=False)
                argv = [
                    "podman", "--runtime", "runc", "run", "--rm", "--network", "host",
                    "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096",
                    "--tmpfs", "/home/agent:rw,mode=1777", "-v", f"{repo}:/workspace",
                    "-w", "/workspace",
                    *(a for k, v in env.items() if k not in ("PATH", "HOME")
                      for a in ("-e", f"{k}={v}")),
                    bare, "claude", *FLAGS, "--", "Check the repo.",
                ]  # fmt: skip
            t0 = time.perf_counter()
            res = subprocess.run(argv, cwd=repo, env=env, capture_output=True, timeout=300)
            if res.returncode != 0:
                raise SystemExit(f"{argv[0]} failed ({res.returncode}):\n{res.stdout[-2000:]!r}")
            times.append(time.perf_counter() - t0)
        return times
    finally:
        gw.terminate()
        gw.wait(10)


PHASES = (
    "before the sandbox starts",
    "  of which prepare (workspace copy)",
    "sandbox start -> first output",
    "  launch (podman run -d returns)",
    "  launched -> first output (relay, claude)",
    "    of which the gateway's start, waited for",
    "agent + sandbox stop",
    "  first -> last output (the agent)",
    "  last output -> container exit",
    "  exit -> seen by the follower",
    "  seen -> podman rm starts (conmon, inspect)",
    "  podman rm (off the path: overlaps what follows)",
    "  conmon gone + disk copy-back",
    "    of which copy-back + umount",
    "  gateway stop",
    "  rest of the stop (record outcome)",
    "collect",
    "publish",
    "rest (report, status)",
)


@contextmanager
def _timed_calls(marks: dict[str, float]) -> Iterator[None]:
    """Record start/end wall times of the launcher's and the backend's own calls (see
    PHASES): each is wrapped in place for the bench's run and restored after."""
    from agentbox.backends.podman import _backend, _detach, _removals
    from agentbox.gateway import GatewayHandle

    seen: dict[str, Any] = {}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed_call(*a: Any, **kw: Any) -> Any:
            marks.setdefault(f"{name}0", time.time())
            try:
                return fn(*a, **kw)
            finally:
                marks[f"{name}1"] = time.time()

        return timed_call

    def inspect(name: str) -> Any:
        t = time.time()
        info = seen["inspect"](name)
        marks["inspect_last"] = t  # the last one before podman rm: the end seen
        state = (info or {}).get("State") or {}
        fin = _detach._when(state.get("FinishedAt"))
        if fin is not None:
            marks["exited"] = fin
        return info

    def pool_log(info: Any, log: Path) -> Path:
        path = seen["pool_log"](info, log)
        marks["log_path"] = path  # type: ignore[assignment]
        return path

    def read_exit_file(path: Any) -> Any:
        got = seen["read_exit_file"](path)
        if got is not None:  # the end, from conmon's exit file (and its time)
            marks.setdefault("seen", time.time())
            marks.setdefault("exited", got[1])
        return got

    def force_remove(name: str, *a: Any, **kw: Any) -> None:
        with contextlib.suppress(OSError):
            marks["last_output"] = Path(str(marks.get("log_path", ""))).stat().st_mtime
        marks.setdefault("seen", marks.get("inspect_last", time.time()))
        wrap("rm", seen["force_remove"])(name, *a, **kw)

    targets: list[tuple[Any, str, Callable[..., Any]]] = [
        (_runner, "prepare", lambda f: wrap("prepare", f)),
        (_finish, "collect", lambda f: wrap("collect", f)),
        (_finish, "publish", lambda f: wrap("publish", f)),
        (_runner, "settle", lambda f: wrap("settle", f)),
        (_runner, "follow_sandbox", lambda f: wrap("follow", f)),
        (_backend.PodmanBackend, "launch", lambda f: wrap("launch", f)),
        (_detach.PodmanDetached, "_settle", lambda f: wrap("disk", f)),
        (_detach, "settle_orphan_disks", lambda f: wrap("copy", f)),
        (GatewayHandle, "stop", lambda f: wrap("gwstop", f)),
        (GatewayHandle, "wait_ready", lambda f: wrap("gwready", f)),
        (_detach, "inspect", lambda f: inspect),
        (_detach, "pool_log", lambda f: pool_log),
        (_detach, "force_remove", lambda f: force_remove),
        (_removals, "force_remove", lambda f: force_remove),
        (_detach, "read_exit_file", lambda f: read_exit_file),
    ]
    targets = [t for t in targets if hasattr(t[0], t[1])]  # an older tree lacks some
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in targets]
    for obj, attr, make in targets:
        seen[attr] = getattr(obj, attr)
        setattr(obj, attr, make(getattr(obj, attr)))
    try:
        yield
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)


def _first_output(
    data_dir: Path, ids: list[str], marks: dict[str, float], stop: threading.Event
) -> None:
    """Note when the task's agent log (attached or detached) first holds a byte."""
    while not stop.wait(0.005):
        if not ids:
            continue
        d = data_dir / "tasks" / ids[0] / "logs"
        for path in (marks.get("log_path"), d / "agent.jsonl", d / "sandbox.log"):
            try:
                if path is not None and Path(str(path)).stat().st_size > 0:
                    marks["output"] = time.time()
                    return
            except OSError:
                pass


def _phases(t0: float, start: float, t_end: float, m: dict[str, float]) -> list[float]:
    """One task's PHASES from its marks (0 for a mark the run did not make)."""
    first = m.get("output", start)
    last = m.get("last_output", first)
    exited = m.get("exited", last)
    seen = m.get("seen", exited)
    publish1 = m.get("publish1", 0.0)

    def span(a: str, b: str) -> float:
        return m[b] - m[a] if a in m and b in m else 0.0

    return [
        start - t0,
        span("prepare0", "prepare1"),
        first - start,
        span("launch0", "launch1"),
        first - m.get("launch1", start),
        span("gwready0", "gwready1"),
        m["collect0"] - first,
        last - first,
        exited - last,
        seen - exited,
        m.get("rm0", seen) - seen,
        span("rm0", "rm1"),
        span("disk0", "disk1"),
        span("copy0", "copy1"),
        span("gwstop0", "gwstop1"),
        m["collect0"] - max(m.get("gwstop1", 0.0), m.get("follow1", 0.0)),
        span("collect0", "collect1"),
        span("publish0", "publish1"),
        t_end - max(m["collect1"], publish1),
    ]


def agentbox_api(
    settings: Settings, runs: int, before_each: Callable[[], object] = lambda: None
) -> tuple[list[float], list[list[float]]]:
    """Launcher.submit → wait; also each task's phases (see PHASES)."""
    total: list[float] = []
    phases: list[list[float]] = []
    with Launcher(settings, max_tasks=1) as launcher:
        for i in range(runs):
            before_each()  # not timed: e.g. a warm pool topped up, as its keeper does
            repo = make_repo(settings.repos_root / f"api-{i}-{secrets.token_hex(3)}")
            marks: dict[str, float] = {}
            ids: list[str] = []
            stop = threading.Event()
            watcher = threading.Thread(
                target=_first_output, args=(settings.data_dir, ids, marks, stop)
            )
            with _timed_calls(marks):
                t0 = time.time()
                watcher.start()
                try:
                    info = launcher.submit(
                        TaskRequest(repo=str(repo), task="Check the repo.", model="one-turn",
                                    deadline=300.0)
                    )  # fmt: skip
                    ids.append(info.id)
                    info = launcher.wait(info.id, 600)
                finally:
                    stop.set()
                    watcher.join()
                t_end = time.time()
            total.append(t_end - t0)
            assert info.status == "done", info
            assert info.started_at is not None
            phases.append(_phases(t0, info.started_at, t_end, marks))
    return total, phases


@contextmanager
def warm_pool(settings: Settings) -> Iterator[WarmPool]:
    """A warm pool of one, drained at the end (see :class:`WarmPool`)."""
    pooled = settings.model_copy(update={"pool_size": 1})
    backend = get_backend(pooled.backend, pooled)
    if backend.pool_refused(pooled.runtime) is not None:
        raise SystemExit(f"no warm pool: {backend.pool_refused(pooled.runtime)}")
    try:
        yield WarmPool(pooled, backend, pool_template(pooled))
    finally:
        backend.drain_pool()


class WarmPool:
    """Tasks that find a pooled sandbox of their shape waiting: the pool is topped up
    (untimed) before each, as ``launcher serve``'s keeper does in the background."""

    def __init__(self, settings: Settings, backend: Any, template: Any) -> None:
        self.settings, self.backend, self.template = settings, backend, template

    def fill(self) -> None:
        self.backend.fill_pool(self.template, 1, ttl=self.settings.pool_ttl)

    def api(self, runs: int) -> tuple[list[float], list[list[float]]]:
        """:func:`agentbox_api` on the pool."""
        return agentbox_api(self.settings, runs, self.fill)

    def cli(
        self, base: Path, *, served: bool = False, steps: list[list[float]] | None = None,
        repo: Path | None = None,
    ) -> tuple[list[float], list[list[float]]]:  # fmt: skip
        """One ``agentbox run`` (:func:`agentbox_cli`) that must claim the pooled sandbox:
        a foreground run's launcher claims one a service's keeper left, as here."""
        self.fill()
        return agentbox_cli(base, 1, pooled=True, served=served, steps=steps, repo=repo)


def _cli_env(base: Path) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "AGENTBOX_LOG_LEVEL": "info",  # the pool's claim is logged at info
        "AGENTBOX_DATA_DIR": str(base / "data"),
        "AGENTBOX_REPOS_ROOT": str(base / "repos"),
        "AGENTBOX_MODELS_FILE": str(base / "models.toml"),
    }


#: The console script a user runs (:func:`agentbox.front.client.entry`).
AGENTBOX = str(Path(sys.executable).parent / "agentbox")


@contextmanager
def front_service(base: Path) -> Iterator[None]:
    """``agentbox launcher serve`` for the bench's data dir, with its front end; stopped
    (and its front end with it) at the end."""
    log = (base / "serve.log").open("wb")
    proc = subprocess.Popen(
        [AGENTBOX, "launcher", "serve"], env=_cli_env(base), stdin=subprocess.DEVNULL,
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        front = base / "data" / "run" / "front.sock"
        deadline = time.monotonic() + 60
        while not socket_accepts(front):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"no front end: {(base / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


#: The whole ``agentbox run`` command by phase, from the task's own timestamps.
CLI_PHASES = (
    "process start -> task recorded (imports, parse)",
    "recorded -> sandbox starts (prepare, gateway)",
    "sandbox starts -> task finished",
    "finished -> process exit (report, exit)",
)


def agentbox_cli(
    base: Path,
    runs: int,
    *,
    pooled: bool = False,
    served: bool = False,
    steps: list[list[float]] | None = None,
    repo: Path | None = None,
) -> tuple[list[float], list[list[float]]]:
    """The whole ``agentbox run`` command; also its phases (see CLI_PHASES). ``repo``: run
    on that repo (a user's next task on the same commit), else on a new one. ``pooled``:
    each run must have claimed a pooled sandbox (its log says so); ``served``: by the
    front end (which must serve it), else in its own process; ``steps``: each run's
    :data:`STEPS` appended to it."""
    env = {
        **_cli_env(base),
        # The pool's settings, as a user's config shared by the service and the CLI
        # would give: a launcher claims from a pool only when its settings ask for one.
        **({"AGENTBOX_POOL_SIZE": "1"} if pooled else {}),
        "AGENTBOX_FRONT_END": "require" if served else "off",
    }
    times: list[float] = []
    phases: list[list[float]] = []
    for i in range(runs):
        if repo is None:
            repo = make_repo(base / "repos" / f"cli-{i}-{secrets.token_hex(3)}")
        w0, t0 = time.time(), time.perf_counter()
        res = subprocess.run(
            [AGENTBOX, "run", "--repo", str(repo), "--model", "one-turn", "--json",
             "Check the repo."],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if res.returncode != 0:
            raise SystemExit(f"agentbox run failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        times.append(time.perf_counter() - t0)
        if pooled and "pool sandbox claimed" not in res.stderr:
            raise SystemExit(f"agentbox run did not claim the pooled sandbox:\n{res.stderr}")
        task = json.loads(res.stdout)["task"]
        marks = [w0, task["created_at"], task["started_at"], task["finished_at"], w0 + times[-1]]
        phases.append([b - a for a, b in itertools.pairwise(marks)])
        if steps is not None:
            log_dir = base / "data" / "tasks" / str(task["id"]) / "logs"
            steps.append(task_steps(w0, w0 + times[-1], task, res.stderr, log_dir))
    return times, phases


#: One ``agentbox run``'s steps, each from one stamp to the next (see :func:`task_steps`):
#: ``(name, stamp that ends it)``. The stamps are the task's own: its row (created,
#: finished), its phase lines (``logs/phases.jsonl``), the launcher's log lines on the
#: command's stderr (structlog's ISO time), the sandbox's output log (conmon's time per
#: record) and conmon's exit file.
STEPS = (
    ("CLI start -> task recorded (client, fork, parse, submit)", "created"),
    ("recorded -> a worker takes it", "phase:starting the gateway"),
    ("  -> preparing (gateway fork asked)", "phase:preparing the workspace"),
    ("prepare (workspace copy, shadow git, index)", "log:prepared"),
    ("prepared -> launch (spec, checks, row)", "phase:running claude"),
    ("workspace disk (mkfs -d, loop mount)", "log:workspace disk mounted"),
    ("pool claim (binds, go-file)", "log:pool sandbox claimed"),
    ("claimed -> first output (relay, claude)", "out:first"),
    ("first -> last output (the agent)", "out:last"),
    ("last output -> container exit", "exit"),
    ("exit -> disk copied back (seen, copy-back, umount)", "log:workspace disk copied back"),
    ("copied back -> agent exit recorded", "phase:agent exited"),
    ("-> collecting (gateway stop, outcome)", "phase:collecting the workspace"),
    ("collect", "log:collected"),
    ("collected -> finished (report, publish)", "finished"),
    ("finished -> CLI exit (result, report)", "end"),
)


def _iso(text: str) -> float | None:
    """Seconds since the epoch of an ISO time with any number of fraction digits."""
    from datetime import datetime

    head, _, frac = text.rstrip("Z").partition(".")
    frac = frac.split("+")[0]
    try:
        whole = datetime.fromisoformat(head + "+00:00").timestamp()
    except ValueError:
        return None
    return whole + (float(f"0.{frac}") if frac.isdigit() else 0.0)


def task_steps(
    w0: float, end: float, task: dict[str, Any], stderr: str, log_dir: Path
) -> list[float]:
    """One run's :data:`STEPS` (seconds; a step whose stamp is missing is 0, and the
    next one counts from the last stamp found)."""
    stamps: dict[str, float] = {"created": task["created_at"], "finished": task["finished_at"]}
    stamps["end"] = end
    for line in stderr.splitlines():  # 2026-12-07T20:47:24.315213Z [info     ] prepared  ...
        when, _, rest = line.partition(" [")
        event = rest.partition("] ")[2].split("  ")[0].strip()
        if event and (t := _iso(when)) is not None:
            stamps.setdefault(f"log:{event}", t)
    with contextlib.suppress(OSError):
        for raw in (log_dir / "phases.jsonl").read_text().splitlines():
            ev = json.loads(raw)
            stamps.setdefault(f"phase:{ev['msg']}", ev["t"])
    for key in list(stamps):  # a phase line's words, by prefix
        if key.startswith("phase:"):
            for _, want in STEPS:
                if want.startswith("phase:") and key.startswith(want):
                    stamps.setdefault(want, stamps[key])
    with contextlib.suppress(OSError):
        records = (log_dir / "sandbox.log").read_bytes().splitlines()
        times = [t for r in records if (t := _iso(r.split(b" ")[0].decode(errors="replace")))]
        if times:
            stamps["out:first"], stamps["out:last"] = times[0], times[-1]
    with contextlib.suppress(OSError):
        stamps["exit"] = (log_dir / "sandbox.log.exit").stat().st_mtime
    out, prev = [], w0
    for _, want in STEPS:
        t = stamps.get(want)
        if t is None:
            out.append(0.0)
            continue
        out.append(t - prev)
        prev = t
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--quick", action="store_true", help="the baselines and the API task only (no CLI, pool)"
    )
    ap.add_argument(
        "--served",
        action="store_true",
        help="the host baseline and the served agentbox run on a warm pool only (the target"
        " row), with its steps",
    )
    ap.add_argument(
        "--fresh-repos",
        action="store_true",
        help="with --served: every run on a new repo (a first task on a commit: no base"
        " cache), not each on the same repo as a user's next task is",
    )
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
        base_t: list[float] = []
        bare_t: list[float] = []
        api_t: list[float] = []
        cli_t: list[float] = []
        cli_pool_t: list[float] = []
        cli_phases: list[list[float]] = []
        cli_pool_phases: list[list[float]] = []
        front_t: list[float] = []
        front_pool_t: list[float] = []
        front_phases: list[list[float]] = []
        front_pool_phases: list[list[float]] = []
        pool_t: list[float] = []
        phases: list[list[float]] = []
        pool_phases: list[list[float]] = []
        front_pool_steps: list[list[float]] = []
        with contextlib.ExitStack() as stack:
            pool = None if args.quick else stack.enter_context(warm_pool(settings))
            if pool is not None:
                stack.enter_context(front_service(base))
            # One warm-up of each side (page cache, image layers), not counted.
            (base / "warm").mkdir()
            baseline(base / "warm", script, 1)
            if not args.served:
                agentbox_api(settings, 1)
            # --served: one repo for every run (the warm-up's included), as a user's
            # tasks on their repo are; its result branches do not move its HEAD.
            same = None
            if args.served and not args.fresh_repos:
                same = make_repo(base / "repos" / f"cli-{secrets.token_hex(3)}")
            if pool is not None and args.served:
                pool.cli(base, served=True, repo=same)
            elif pool is not None:
                pool.api(1)
                pool.cli(base)
                agentbox_cli(base, 1, served=True)
                pool.cli(base, served=True)
            if args.served:
                assert pool is not None
                for i in range(args.runs):  # the two rows alternating, as below
                    (base / f"b{i}").mkdir()
                    base_t += baseline(base / f"b{i}", script, 1)
                    t, ph = pool.cli(base, served=True, steps=front_pool_steps, repo=same)
                    front_pool_t += t
                    front_pool_phases += ph
                    print(f"round {i + 1}/{args.runs} done", file=sys.stderr, flush=True)
            # Rounds, each row once per round: this host's speed drifts by tens of
            # percent over a minute (a VM with neighbours), and a row measured all at
            # once would carry the drift into its ratio.
            for i in range(0 if args.served else args.runs):
                for sub in (f"b{i}", f"bare{i}"):
                    (base / sub).mkdir()
                base_t += baseline(base / f"b{i}", script, 1)
                bare_t += baseline(base / f"bare{i}", script, 1, bare=settings.image)
                t, ph = agentbox_api(settings, 1)
                api_t += t
                phases += ph
                if pool is not None:
                    t, ph = agentbox_cli(base, 1)
                    cli_t += t
                    cli_phases += ph
                    t, ph = pool.cli(base)
                    cli_pool_t += t
                    cli_pool_phases += ph
                    t, ph = pool.api(1)
                    pool_t += t
                    pool_phases += ph
                    t, ph = agentbox_cli(base, 1, served=True)
                    front_t += t
                    front_phases += ph
                    t, ph = pool.cli(base, served=True, steps=front_pool_steps)
                    front_pool_t += t
                    front_pool_phases += ph
                print(f"round {i + 1}/{args.runs} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    ref = statistics.median(base_t)
    rows = [
        ("claude -p on the host (baseline)", base_t),
        ("claude -p in a bare podman run --rm", bare_t),
        ("agentbox Launcher API (submit→wait)", api_t),
        ("agentbox run (whole CLI command)", cli_t),
        ("agentbox Launcher API, warm pool", pool_t),
        ("agentbox run (whole CLI), warm pool", cli_pool_t),
        ("agentbox run, front end", front_t),
        ("agentbox run, front end, warm pool", front_pool_t),
    ]
    print(
        f"\nwhole-task overhead, one-turn replay script, {args.runs} rounds of every row"
        " (median / min)\n"
    )
    print(f"| {'what':<38} | {'median s':>8} | {'min s':>7} | {'x baseline':>10} |")
    print(f"|{'-' * 40}|{'-' * 10}|{'-' * 9}|{'-' * 12}|")
    for name, ts in rows:
        if not ts:
            continue
        med = statistics.median(ts)
        print(f"| {name:<38} | {med:8.2f} | {min(ts):7.2f} | {med / ref:10.2f} |")
    for what, names, ph in (
        ("the API task by phase, fresh sandbox", PHASES, phases),
        ("the API task by phase, warm pool", PHASES, pool_phases),
        ("agentbox run by phase, fresh sandbox", CLI_PHASES, cli_phases),
        ("agentbox run by phase, warm pool", CLI_PHASES, cli_pool_phases),
        ("agentbox run served by the front end, by phase", CLI_PHASES, front_phases),
        ("agentbox run served by the front end, warm pool", CLI_PHASES, front_pool_phases),
    ):
        if ph:
            print(f"\n{what} (median of {args.runs}; baseline {ref:.2f} s)\n")
            _phase_table(names, ph, ref)
    if front_pool_steps:
        print(
            f"\nagentbox run served by the front end, warm pool, step by step from the task's"
            f" own stamps (median of {args.runs}; baseline {ref:.2f} s)\n"
        )
        _phase_table(tuple(n for n, _ in STEPS), front_pool_steps, ref)
    return 0


def _phase_table(names: tuple[str, ...], phases: list[list[float]], ref: float) -> None:
    """One row per phase: its median and its ratio to the baseline ``ref``."""
    w = max(len(n) for n in names)
    print(f"| {'phase':<{w}} | {'median s':>8} | {'x baseline':>10} |")
    print(f"|{'-' * (w + 2)}|{'-' * 10}|{'-' * 12}|")
    for k, name in enumerate(names):
        med = statistics.median(p[k] for p in phases)
        print(f"| {name:<{w}} | {med:8.3f} | {med / ref:10.2f} |")


if __name__ == "__main__":
    sys.exit(main())
