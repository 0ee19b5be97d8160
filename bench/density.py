"""Density: what N idle tasks cost the host, ours against the agent's, by process.

Starts N tasks with the real Claude Code through a real :class:`Launcher` on
podman. The model is a replay script whose first turn is a ``Bash`` tool call
``tail -f /dev/null`` (Claude Code refuses a standalone ``sleep``): each agent then
sits idle, as a real agent waiting on a long tool would. Once all N agents are in
that ``tail``, every process that belongs to a task is read from
``/proc/PID/smaps_rollup`` (PSS and RSS) and put in a category:

- the agent's: ``claude`` and the tools it runs (the ``bash``/``tail`` below it);
- ours: the gateway, the per-task watchdog, the ``podman run`` client if one stays
  attached, conmon, the relay inside the sandbox, the container's init, an egress
  proxy if any, and the launcher's gateway template (``--gateway-template on``; one
  process, its PSS spread over the N tasks).

A sandbox's processes are found by its container id in ``/proc/PID/cgroup``;
gateways by their ``--listen`` socket under this run's data dir; watchdogs by
their ``--data-dir``. Also reported: the drop of ``MemAvailable`` per task (the
whole host; other work on the machine shows in it), the time from the first
submit until all N agents are idle, and the tasks started per second.

Before the rounds, the gateway's ready latency: ``--ready K`` gateways asked for one
after another from ``spawn_gateway`` (replay model, dropped and confined as a task's),
the time from the ask until it serves, exec'd and forked from the template in the
same run (the template's own start, the first fork's, is shown apart).

Everything started is cancelled and removed in a ``finally`` (Ctrl-C and SIGTERM
included), then swept: any container with this data dir's label, any gateway or
watchdog of this data dir, anything still mounted below the run's directory.

Usage (as root, after scripts/setup.sh and ``agentbox image build``)::

    .venv/bin/python bench/density.py [--n 5,10,20,40] [--timeout 600]
        [--gateway-template off|on] [--ready 10]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from agentbox.config import Settings
from agentbox.launcher import Launcher, TaskRequest
from agentbox.launcher._names import list_task_gateways, list_task_sandboxes, sandbox_name

ROOT = Path(__file__).resolve().parents[1]
IDLE = """\
name: idle
turns:
  - text: "Waiting on a long job."
    tool_use:
      - name: Bash
        input: {command: "tail -f /dev/null", description: "Follow the job log", timeout: 600000}
  - text: "Done."
"""
INITS = ("tini", "catatonit", "podman-init", "init")
OURS = ("gateway", "gateway template", "watchdog", "podman client", "conmon", "relay", "init",
        "egress")  # fmt: skip
AGENT = ("claude", "agent tools")


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def make_repo(path: Path) -> Path:
    shutil.copytree(ROOT / "demo" / "sample-repo", path)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "-c", "user.name=b", "-c", "user.email=b@l", "commit", "-q", "-m", "s")
    return path


def mem_available() -> int:
    """MemAvailable in KiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    raise RuntimeError("no MemAvailable")


def smaps(pid: int) -> tuple[int, int] | None:
    """(PSS, RSS) of ``pid`` in KiB, or None if it is gone."""
    pss = rss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif line.startswith("Rss:"):
                rss = int(line.split()[1])
    except OSError:
        return None
    return pss, rss


def procs() -> dict[int, tuple[str, list[str], str, int]]:
    """Every process: pid → (comm, cmdline, cgroup file text, parent pid)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm = (d / "comm").read_text().strip()
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            cg = (d / "cgroup").read_text()
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(d.name)] = (comm, [a.decode(errors="replace") for a in cmd if a], cg, ppid)
    return out


def container_ids(names: list[str]) -> dict[str, str]:
    """Container name → full id, for the named containers that exist."""
    res = subprocess.run(
        ["podman", "ps", "-a", "--no-trunc", "--format", "{{.ID}} {{.Names}}"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    wanted = set(names)
    ids = {}
    for line in res.stdout.splitlines():
        cid, _, name = line.partition(" ")
        if name in wanted:
            ids[name] = cid
    return ids


def classify(settings: Settings, task_ids: list[str]) -> dict[str, list[int]]:
    """Category → pids of every process that belongs to one of the tasks."""
    names = {sandbox_name(t): t for t in task_ids}
    ids = container_ids(list(names))
    table = procs()
    cats: dict[str, list[int]] = defaultdict(list)
    gw_pids = {o.pid for tid, o in list_task_gateways(settings) if tid in task_ids}
    data = str(settings.data_dir)
    in_box: dict[int, str] = {}
    for pid, (comm, cmd, cg, _) in table.items():
        line = " ".join(cmd)
        if pid in gw_pids:
            cats["gateway"].append(pid)
        elif "agentbox.gateway._template" in cmd[:3] and table[pid][3] == os.getpid():
            cats["gateway template"].append(pid)
        elif comm == "conmon" and any(cid in line for cid in ids.values()):
            cats["conmon"].append(pid)
        elif comm == "podman" and any(n in line for n in names):
            cats["podman client"].append(pid)
        elif "_watchdog.py" in line and data in line:
            cats["watchdog"].append(pid)
        elif "agentbox.egress" in line and data in line:
            cats["egress"].append(pid)
        elif any(cid in cg for cid in ids.values()) and "conmon" not in cg:
            in_box[pid] = comm
    claude = {p for p, c in in_box.items() if c == "claude"}
    for pid in in_box:
        cmd = table[pid][1]
        if pid in claude:
            cats["claude"].append(pid)
        elif table[pid][0] in INITS:
            cats["init"].append(pid)  # its argv names the relay: it runs it
        elif any(a.endswith(("relay.py", "/agentbox/relay")) for a in cmd[:4]) or table[pid][0] in (
            "agentbox-relay",
            "relay",
        ):
            cats["relay"].append(pid)
        elif _under(pid, claude, table):
            cats["agent tools"].append(pid)
        else:
            cats["init"].append(pid)  # tini/catatonit and anything else of ours in the box
    return cats


def _under(pid: int, roots: set[int], table: dict[int, tuple[str, list[str], str, int]]) -> bool:
    seen = 0
    while pid in table and seen < 64:
        pid = table[pid][3]
        if pid in roots:
            return True
        seen += 1
    return False


def idle_count(settings: Settings, task_ids: list[str]) -> int:
    """How many of the tasks' agents are in their ``tail`` tool call."""
    names = [sandbox_name(t) for t in task_ids]
    ids = container_ids(names)
    n = 0
    table = procs()
    for cid in ids.values():
        if any(c == "tail" and cid in cg for c, _, cg, _ in table.values()):
            n += 1
    return n


def sweep(settings: Settings) -> list[str]:
    """Remove whatever of this data dir is left: containers, gateways, watchdogs."""
    left = []
    for name in list_task_sandboxes(settings):
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, timeout=120)
        left.append(name)
    data = str(settings.data_dir)
    for pid, (_, cmd, _, _) in procs().items():
        line = " ".join(cmd)
        if data in line and ("_watchdog.py" in line or "gateway" in line) and pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            left.append(f"pid {pid}")
    return left


def unmount_under(base: Path) -> None:
    """Unmount whatever is still mounted below ``base``, deepest first: a workspace disk
    the backend could not settle (seen when a sandbox failed to start under load) would
    otherwise keep the run's directory, and its loop device, alive."""
    mounts = [
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[1].startswith(f"{base}/")
    ]
    for m in sorted(mounts, key=len, reverse=True):
        res = subprocess.run(["umount", m], capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            subprocess.run(["umount", "-l", m], capture_output=True, timeout=60)
        print(f"unmounted leftover {m}", file=sys.stderr)


@contextlib.contextmanager
def differing_caller(on: bool) -> Iterator[None]:
    """With ``on``: this process, for the block, as a caller unlike the process that
    started the template (a user's shell against a ``launcher serve`` unit): nice +1,
    umask 027, another core file limit, OOM score adjustment +1, one CPU fewer (when
    there are two or more); restored after."""
    if not on:
        yield
        return
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    cpus = os.sched_getaffinity(0)
    core = resource.getrlimit(resource.RLIMIT_CORE)
    oom = Path("/proc/self/oom_score_adj").read_text().strip()
    umask = os.umask(0o027)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice + 1)
        if len(cpus) > 1:
            os.sched_setaffinity(0, set(sorted(cpus)[1:]))
        resource.setrlimit(resource.RLIMIT_CORE, (4096, core[1]))
        Path("/proc/self/oom_score_adj").write_text(str(min(1000, int(oom) + 1)))
        yield
    finally:
        os.umask(umask)
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        os.sched_setaffinity(0, cpus)
        resource.setrlimit(resource.RLIMIT_CORE, core)
        Path("/proc/self/oom_score_adj").write_text(oom)


def ready_latency(base: Path, k: int, *, differs: bool = False) -> dict[str, list[float]]:
    """Ms from asking ``spawn_gateway`` for a gateway until it serves, ``k`` times each
    way: ``exec`` (a new interpreter) and ``template`` (forked; its first ask, which
    starts the template, is ``template start``). ``differs``: every ask but the one that
    starts the template made from a posture unlike the template's (:func:`differing_caller`)."""
    from agentbox.gateway import _forkspawn, gateway_identity, spawn_gateway

    out: dict[str, list[float]] = {"exec": [], "template start": [], "template": []}
    for mode in ("exec", "template"):
        data = base / f"ready-{mode}"
        data.mkdir()
        settings = Settings(data_dir=data, models_file=base / "models.toml",
                            gateway_template=mode == "template")  # fmt: skip
        _forkspawn.stop_template()
        for i in range(k + (mode == "template")):
            task = data / f"t{i}"
            (task / "gw").mkdir(parents=True)
            token = task / "token"
            token.write_text(secrets.token_urlsafe(24))
            token.chmod(0o600)
            with differing_caller(differs and not (mode == "template" and i == 0)):
                t0 = time.monotonic()
                gw = spawn_gateway(
                    socket_path=task / "gw" / "gateway.sock",
                    token_file=token,
                    model="idle",
                    budget=10**6,
                    usage_file=task / "usage.json",
                    settings=settings,
                    log_file=task / "gateway.log",
                    run_as=gateway_identity(settings),
                    exit_at=time.time() + 120,
                )
                ms = (time.monotonic() - t0) * 1000
            if (
                mode == "template"
                and i > 0
                and differs
                and not isinstance(gw._proc, _forkspawn.ForkedProcess)
            ):
                key = "template refused: exec'd"
                out.setdefault(key, []).append(ms)
                gw.stop(grace=2.0)
                continue
            gw.stop(grace=2.0)
            key = "template start" if mode == "template" and i == 0 else mode
            out[key].append(ms)
    _forkspawn.stop_template()
    return out


def report_ready(lat: dict[str, list[float]]) -> None:
    k = len(lat["exec"])
    print(f"\n### Gateway ready latency: ask → serving, {k} gateways one after another\n")
    print("| path | n | median ms | p90 ms | max ms |")
    print("|---|---:|---:|---:|---:|")
    for mode, xs in lat.items():
        if not xs:
            continue
        ys = sorted(xs)
        p90 = ys[min(len(ys) - 1, round(0.9 * (len(ys) - 1)))]
        print(f"| {mode} | {len(ys)} | {statistics.median(ys):.1f} | {p90:.1f} | {ys[-1]:.1f} |")
    if lat["exec"] and lat["template"]:
        ratio = statistics.median(lat["template"]) / statistics.median(lat["exec"])
        print(f"\nforked / exec'd (medians): {ratio:.3f}x")


def run_round(base: Path, n: int, timeout: float, template: bool) -> dict[str, object]:
    """Start n idle tasks, measure, tear everything down."""
    data = base / f"data-{n}"
    repos = base / "repos"
    data.mkdir()
    settings = Settings(data_dir=data, repos_root=repos, models_file=base / "models.toml",
                        gateway_template=template)  # fmt: skip
    tids: list[str] = []
    mem0 = mem_available()
    launcher = Launcher(settings, max_tasks=n)
    try:
        t0 = time.monotonic()
        for i in range(n):
            repo = make_repo(repos / f"r{n}-{i}")
            info = launcher.submit(
                TaskRequest(repo=str(repo), task="Wait for the job.", model="idle",
                            deadline=max(timeout * 2, 900.0), publish=False)
            )  # fmt: skip
            tids.append(info.id)
        t_submitted = time.monotonic() - t0
        t_running = None
        deadline = time.monotonic() + timeout
        while True:
            infos = [launcher.get(t) for t in tids]
            bad = [i for i in infos if i.status not in ("queued", "preparing", "running")]
            if bad:
                raise RuntimeError(f"task ended early: {bad[0].id} {bad[0].status} {bad[0].error}")
            if t_running is None and all(i.status == "running" for i in infos):
                t_running = time.monotonic() - t0
            if idle_count(settings, tids) == n:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"not all {n} agents idle within {timeout:g} s")
            time.sleep(0.5)
        t_idle = time.monotonic() - t0
        time.sleep(3)  # let start-up garbage settle
        cats = classify(settings, tids)
        mem1 = mem_available()
        usage: dict[str, tuple[int, int, int]] = {}
        for cat, pids in cats.items():
            got = [m for m in map(smaps, pids) if m is not None]
            usage[cat] = (len(got), sum(p for p, _ in got), sum(r for _, r in got))
        return {
            "n": n,
            "usage": usage,
            "mem_drop_kib": mem0 - mem1,
            "t_submitted": t_submitted,
            "t_running": t_running,
            "t_idle": t_idle,
        }
    finally:
        for tid in tids:
            with contextlib.suppress(Exception):
                launcher.cancel(tid)
        with contextlib.suppress(Exception):
            launcher.shutdown(grace=20)
        with contextlib.suppress(Exception):
            launcher.close(wait=True)
        from agentbox.gateway import _forkspawn

        _forkspawn.stop_template()
        left = sweep(settings)
        if left:
            print(f"swept after N={n}: {left}", file=sys.stderr)


def report(rows: list[dict[str, object]], template: bool) -> None:
    how = "gateways forked from the template" if template else "gateways exec'd"
    for r in rows:
        n = int(r["n"])  # type: ignore[call-overload]
        usage: dict[str, tuple[int, int, int]] = r["usage"]  # type: ignore[assignment]
        print(f"\n### N = {n} idle tasks (real Claude Code, podman; {how})\n")
        print("| process | count | PSS MiB/task | RSS MiB/task |")
        print("|---|---:|---:|---:|")
        tot: dict[str, list[float]] = {"ours": [0, 0], "agent": [0, 0]}
        for cat in (*OURS, *AGENT):
            if cat not in usage:
                continue
            cnt, pss, rss = usage[cat]
            side = "ours" if cat in OURS else "agent"
            tot[side][0] += pss / 1024 / n
            tot[side][1] += rss / 1024 / n
            print(f"| {cat} ({side}) | {cnt} | {pss / 1024 / n:.1f} | {rss / 1024 / n:.1f} |")
        for side in ("ours", "agent"):
            print(f"| **all {side}** | | **{tot[side][0]:.1f}** | **{tot[side][1]:.1f}** |")
        drop = int(r["mem_drop_kib"]) / 1024 / n  # type: ignore[call-overload]
        t_idle = float(r["t_idle"])  # type: ignore[arg-type]
        print(f"\nMemAvailable drop per task: {drop:.1f} MiB · submitted in "
              f"{float(r['t_submitted']):.1f} s · all running {float(r['t_running'] or 0):.1f} s"  # type: ignore[arg-type]
              f" · all agents idle {t_idle:.1f} s · {n / t_idle:.2f} tasks started/s")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="5,10,20,40", help="comma-separated task counts")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for N agents to idle")
    ap.add_argument(
        "--gateway-template",
        choices=("off", "on"),
        default="off",
        help="fork the tasks' gateways from the template (setting gateway_template)",
    )
    ap.add_argument("--ready", type=int, default=10,
                    help="gateways to time from ask to serving, each way (0: none)")  # fmt: skip
    ap.add_argument("--caller-differs", action="store_true",
                    help="--ready's gateways asked from a posture unlike the template's "
                         "(nice, umask, affinity, a limit, OOM score)")  # fmt: skip
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (the launcher drives podman as root)", file=sys.stderr)
        return 2

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    base = Path(tempfile.mkdtemp(prefix="agentbox-density-", dir="/var/tmp"))
    base.chmod(0o711)
    rows = []
    try:
        script = base / "idle.yaml"
        script.write_text(IDLE)
        (base / "models.toml").write_text(
            f'[models.idle]\nkind = "replay"\nupstream = "{script}"\n'
        )
        (base / "repos").mkdir()
        if args.ready > 0:
            lat = ready_latency(base, args.ready, differs=args.caller_differs)
        template = args.gateway_template == "on"
        for n in (int(x) for x in args.n.split(",") if x.strip() != "0"):
            try:
                rows.append(run_round(base, n, args.timeout, template))
            except (RuntimeError, TimeoutError) as exc:
                print(f"N={n}: {exc}", file=sys.stderr)
                break
    finally:
        unmount_under(base)
        shutil.rmtree(base, ignore_errors=True)
    if args.ready > 0:
        report_ready(lat)
    report(rows, template)
    return 0 if rows or args.ready > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
