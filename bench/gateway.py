"""Benchmark: latency the gateway adds, and its request rate, against the replay model.

Same run, same machine: the replay model is called directly (the baseline) and
through a gateway (``--upstream http://127.0.0.1:…``), each a separate process.
The one-core request rate is measured as requests per CPU-second the gateway
process itself used (from /proc), which holds on a machine shared with other
work; ``--gateway-cpu N`` pins it as well. The client is a minimal keep-alive
HTTP/1.1 client on asyncio (httpx's own per-request cost would hide the gateway's).

Reports p50/p99 of full-stream latency at 1, 4 and 64 concurrent streaming
clients, the difference (what the gateway adds), and requests/s for small
non-streamed calls; plus the host's load average before and after (the box is
shared).

Realistic neighbours (issue 15): ``--busy 20`` (the default) first starts 20 other
gateway processes, each with its in-process replay model and one client streaming
from it without pause (50 events/s per stream, as a model streams), so the
measured gateway shares the host with 20 busy tasks' gateways. ``--compare-src
DIR`` runs a second measured gateway from another source tree (e.g. ``git archive``
of an older commit) in the same run, interleaved round by round, for a
before/after in one table. Everything started is stopped in a ``finally``.

Where the time goes (issue 15): each row also reports, for the measured gateway
during its own rounds, its CPU per request and its threads' run-queue wait per
request (/proc/<pid>/task/*/schedstat: ns runnable but not on a CPU; ``gw CPU/req``
is the gateway's own CPU time per request, and ``compare CPU/req`` the compared
gateway's in its interleaved rounds: robust on a loaded host), and the
machine's runnable count (/proc/stat procs_running, sampled every 20 ms). Control
rows (``--control``) repeat the 4-stream series with the measured gateway alone at
nice -20 or SCHED_FIFO, and with the whole measured path (client, replay models,
gateway) at SCHED_FIFO: if the added latency falls to about the gateway's own CPU
per request, the rest was waiting for a core. Bench-only: the product never raises
a gateway above other tasks'.

    .venv/bin/python bench/gateway.py [--requests 400] [--busy 20] [--compare-src DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SCRIPT = """
name: bench
main: all
chunk_size: 16
turns:
  - text: "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over it again."
    usage: {input_tokens: 12, output_tokens: 20}
"""


BUSY_SCRIPT = """
name: busy
main: all
chunk_size: 8
turns:
  - text: "%s"
    chunk_delay: %s
    usage: {input_tokens: 12, output_tokens: 200}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(port)


def request_bytes(port: int, token: str, stream: bool) -> bytes:
    body = json.dumps(
        {
            "model": "bench",
            "max_tokens": 64,
            "stream": stream,
            "messages": [{"role": "user", "content": "Say something short."}],
        }
    ).encode()
    head = (
        f"POST /v1/messages HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"x-api-key: {token}\r\nanthropic-version: 2023-06-01\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Conn:
    """One keep-alive HTTP/1.1 connection that reads whole responses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        return cls(r, w)

    async def call(self, req: bytes) -> int:
        self.w.write(req)
        head = await self.r.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            while True:
                size_line = await self.r.readuntil(b"\r\n")
                size = int(size_line.strip().split(b";")[0], 16)
                await self.r.readexactly(size + 2)
                if size == 0:
                    break
        else:
            i = lower.index(b"content-length:")
            n = int(lower[i + 15 : lower.index(b"\r\n", i)])
            await self.r.readexactly(n)
        return status

    def close(self) -> None:
        self.w.close()


async def latencies(port: int, token: str, clients: int, per_client: int) -> list[float]:
    req = request_bytes(port, token, stream=True)
    out: list[float] = []

    async def one() -> None:
        c = await Conn.open(port)
        await c.call(req)  # warm the connection
        for _ in range(per_client):
            t = time.perf_counter()
            status = await c.call(req)
            out.append(time.perf_counter() - t)
            assert status == 200, status
        c.close()

    await asyncio.gather(*[one() for _ in range(clients)])
    return out


async def rate(port: int, token: str, clients: int, total: int) -> float:
    req = request_bytes(port, token, stream=False)
    per = max(1, total // clients)  # at least one call each: a rate of 0 divides nothing
    conns = [await Conn.open(port) for _ in range(clients)]
    for c in conns:
        await c.call(req)

    async def run(c: Conn) -> None:
        for _ in range(per):
            assert await c.call(req) == 200

    t = time.perf_counter()
    await asyncio.gather(*[run(c) for c in conns])
    dt = time.perf_counter() - t
    for c in conns:
        c.close()
    return per * clients / dt


async def stream_forever(ports: list[int], token: str) -> None:
    """One client per port, each streaming one request after another (the busy neighbours)."""

    async def one(port: int) -> None:
        req = request_bytes(port, token, stream=True)
        c = await Conn.open(port)
        while True:
            await c.call(req)

    await asyncio.gather(*[one(p) for p in ports])


def gateway_argv(
    port: int, token_file: Path, upstream: str, usage: Path, *, lean: bool = True
) -> list[str]:
    """A gateway as the launcher starts one (``python -m agentbox.gateway``), on TCP.

    ``lean=False`` for a source tree older than ``--builtin-models``."""
    return [sys.executable, "-m", "agentbox.gateway", "--listen", f"tcp:127.0.0.1:{port}",
            "--token-file", str(token_file), "--model", "replay-demo",
            *(["--builtin-models"] if lean else []),
            "--budget", str(10**13), "--upstream", upstream, "--max-concurrency", "256",
            "--usage-file", str(usage)]  # fmt: skip


def start_busy(
    n: int, rate: float, tmp: Path, token_file: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """n gateways with in-process replay models, and one process streaming from all of them
    (each stream ``rate`` SSE events per second)."""
    script = tmp / "busy.yaml"
    script.write_text(BUSY_SCRIPT % ("streaming tokens at a model's pace " * 12, 1 / rate))
    ports = []
    for i in range(n):
        port = free_port()
        procs.append(subprocess.Popen(
            gateway_argv(port, token_file, f"replay:{script}", tmp / f"busy-{i}.json"),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        ports.append(port)
    for port, proc in zip(ports, procs[-n:], strict=True):
        wait_port(port, proc)
    procs.append(subprocess.Popen(
        [sys.executable, __file__, "--busy-clients", ",".join(map(str, ports)),
         "--token-file", str(token_file)],
    ))  # fmt: skip


def cpu_seconds(pid: int) -> float:
    """CPU time all of a process's threads have used so far (schedstat: ns, not clock ticks)."""
    return sum(v[0] for v in Sched(pid).snap().values()) / 1e9


def add(a: tuple[int, int, int], b: tuple[int, int, int], sign: int = 1) -> tuple[int, int, int]:
    return (a[0] + sign * b[0], a[1] + sign * b[1], a[2] + sign * b[2])


class Sched:
    """Scheduler accounting of one process, summed over its threads (/proc/<pid>/task/*/schedstat).

    schedstat's fields: ns on a CPU, ns runnable but waiting for one (run-queue wait),
    and timeslices. Per thread too, so the event loop's thread can be told from the
    usage file's writer."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def snap(self) -> dict[str, tuple[int, int, int]]:
        out: dict[str, tuple[int, int, int]] = {}
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                f = (task / "schedstat").read_text().split()
                comm = (task / "comm").read_text().strip()
            except OSError:  # a thread that just ended
                continue
            key = "main" if task.name == str(self.pid) else f"thread:{comm}"
            run, wait, slices = out.get(key, (0, 0, 0))
            out[key] = (run + int(f[0]), wait + int(f[1]), slices + int(f[2]))
        return out

    @staticmethod
    def delta(
        a: dict[str, tuple[int, int, int]], b: dict[str, tuple[int, int, int]]
    ) -> dict[str, tuple[int, int, int]]:
        keys = set(a) | set(b)
        z = (0, 0, 0)
        return {k: add(b.get(k, z), a.get(k, z), -1) for k in keys}


class LoadSampler:
    """Samples the machine's runnable count (/proc/stat procs_running) every 20 ms while on."""

    def __init__(self) -> None:
        import threading

        self.samples: list[int] = []
        self._on = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._on.wait(0.2)
            if self._on.is_set():
                for line in Path("/proc/stat").read_text().splitlines():
                    if line.startswith("procs_running"):
                        self.samples.append(int(line.split()[1]))
                time.sleep(0.02)

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        self._on.set()
        try:
            yield
        finally:
            self._on.clear()

    def take(self) -> list[int]:
        out, self.samples = self.samples, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._on.set()
        self._thread.join(5)


def boost(pid: int, how: str) -> None:
    """Raise (``nice``: -20; ``fifo``: SCHED_FIFO 1) or reset (``normal``) every thread of pid.

    For the control row only: the product never runs its gateway above other tasks'."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        tid = int(task.name)
        with contextlib.suppress(ProcessLookupError):
            if how == "fifo":
                os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
            else:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, -20 if how == "nice" else 0)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per latency series")
    ap.add_argument("--rate-requests", type=int, default=4000)
    ap.add_argument("--gateway-cpu", type=int, default=-1, help="pin the gateway (-1: no pin)")
    ap.add_argument("--upstream-cpu", type=int, default=-1, help="pin the replay model")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--busy", type=int, default=20, help="other busy gateways on the host")
    ap.add_argument("--busy-rate", type=float, default=50.0, help="SSE events/s per busy stream")
    ap.add_argument("--compare-src", type=Path, help="also measure a gateway from this src dir")
    ap.add_argument("--clients", default="1,4,64", help="concurrent streams per series")
    ap.add_argument(
        "--control",
        default="nice,fifo,path",
        help="control rows: the measured gateway at nice -20 or SCHED_FIFO, or (path) the "
        "whole measured path at SCHED_FIFO ('' for none)",
    )
    ap.add_argument("--control-clients", type=int, default=4)
    ap.add_argument("--busy-clients", help=argparse.SUPPRESS)
    ap.add_argument("--token-file", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.busy_clients:
        token = args.token_file.read_text()
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(stream_forever([int(p) for p in args.busy_clients.split(",")], token))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    tmp = Path(tempfile.mkdtemp(prefix="agentbox-bench-"))
    script = tmp / "bench.yaml"
    script.write_text(SCRIPT)
    token = secrets.token_urlsafe(24)
    (tmp / "token").write_text(token)
    gw_port, old_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # One replay model per measured path: each has its own connection cap (128), and
        # 64 streams through each of three paths with pooled connections would pass it.
        def replay() -> tuple[subprocess.Popen[bytes], int]:
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "agentbox", "model", "serve", "--script", str(script),
                 "--listen", f"tcp:127.0.0.1:{port}"], stderr=subprocess.DEVNULL,
            )  # fmt: skip
            procs.append(proc)
            return proc, port

        up, up_port = replay()
        gw_up, gw_up_port = replay()
        gw = subprocess.Popen(gateway_argv(gw_port, tmp / "token",
                              f"http://127.0.0.1:{gw_up_port}", tmp / "usage.json"))  # fmt: skip
        procs.append(gw)
        waits = [(up_port, up), (gw_up_port, gw_up), (gw_port, gw)]
        old = old_up = None
        if args.compare_src is not None:
            env = {**os.environ, "PYTHONPATH": str(args.compare_src.resolve())}
            old_up, old_up_port = replay()
            old = subprocess.Popen(
                gateway_argv(old_port, tmp / "token", f"http://127.0.0.1:{old_up_port}",
                             tmp / "old.json", lean=False),
                env=env,
            )  # fmt: skip
            procs.append(old)
            waits += [(old_up_port, old_up), (old_port, old)]
        for port, proc in waits:
            wait_port(port, proc)
        if args.busy:
            start_busy(args.busy, args.busy_rate, tmp, tmp / "token", procs)
            time.sleep(2)  # the neighbours are streaming
        ncpu = os.cpu_count() or 1
        if args.gateway_cpu >= 0:
            os.sched_setaffinity(gw.pid, {args.gateway_cpu % ncpu})
        if args.upstream_cpu >= 0:
            os.sched_setaffinity(up.pid, {args.upstream_cpu % ncpu})
        load0 = os.getloadavg()
        sampler = LoadSampler()
        sched = Sched(gw.pid)
        rows = []

        def series(clients: int, control: str = "") -> dict[str, Any]:
            per = max(40, args.requests // clients)
            d: list[float] = []
            g: list[float] = []
            o: list[float] = []
            sched_d: dict[str, tuple[int, int, int]] = {}
            old_cpu_s = 0.0
            # Interleave direct and gateway rounds so load changes hit both alike.
            rounds = 5
            for _ in range(rounds):
                d += asyncio.run(latencies(up_port, token, clients, max(1, per // rounds)))
                s0 = sched.snap()
                with sampler.measuring():
                    g += asyncio.run(latencies(gw_port, token, clients, max(1, per // rounds)))
                for k, v in Sched.delta(s0, sched.snap()).items():
                    sched_d[k] = add(sched_d.get(k, (0, 0, 0)), v)
                if old is not None:
                    o0 = cpu_seconds(old.pid)
                    o += asyncio.run(latencies(old_port, token, clients, max(1, per // rounds)))
                    old_cpu_s += cpu_seconds(old.pid) - o0
            # Each measured request is one warm-up-free call; the warm-up call per client
            # per round also ran through the gateway.
            n_gw = len(g) + clients * rounds
            run_ns = sum(v[0] for v in sched_d.values())
            wait_ns = sum(v[1] for v in sched_d.values())
            _, main_wait, main_slices = sched_d.get("main", (0, 0, 0))
            running = sampler.take()
            row = {
                "clients": clients,
                "control": control or "-",
                "n": len(d),
                "direct_p50_ms": pct(d, 50),
                "gateway_p50_ms": pct(g, 50),
                "added_p50_ms": pct(g, 50) - pct(d, 50),
                "direct_p99_ms": pct(d, 99),
                "gateway_p99_ms": pct(g, 99),
                "added_p99_ms": pct(g, 99) - pct(d, 99),
                "direct_mean_ms": statistics.mean(d) * 1000,
                "gateway_mean_ms": statistics.mean(g) * 1000,
                # The gateway process during its rounds: CPU it used and time its threads
                # sat runnable waiting for a CPU, per request (all threads; main = the loop).
                "gw_cpu_ms_per_req": run_ns / n_gw / 1e6,
                "gw_wait_ms_per_req": wait_ns / n_gw / 1e6,
                "gw_loop_wait_ms_per_req": main_wait / n_gw / 1e6,
                "gw_loop_wait_ms_per_slice": main_wait / max(1, main_slices) / 1e6,
                "gw_req_per_cpu_s": n_gw / (run_ns / 1e9) if run_ns else float("nan"),
                "gw_threads": {k: [v[0] / 1e6, v[1] / 1e6, v[2]] for k, v in sched_d.items()},
                "procs_running_mean": statistics.mean(running) if running else float("nan"),
                "procs_running_max": max(running, default=0),
                "loadavg_1m": os.getloadavg()[0],
            }
            if o:
                row |= {"compare_req_per_cpu_s": (len(o) + clients * rounds) / old_cpu_s,
                        "compare_cpu_ms_per_req": old_cpu_s * 1000 / (len(o) + clients * rounds),
                        "compare_added_p50_ms": pct(o, 50) - pct(d, 50),
                        "compare_added_p99_ms": pct(o, 99) - pct(d, 99)}  # fmt: skip
            return row

        for clients in (int(c) for c in args.clients.split(",")):
            rows.append(series(clients))
        for how in [c for c in args.control.split(",") if c]:
            # The control: the same streams with the measured gateway (only) above its
            # neighbours. If its added latency falls to about its own CPU per request, the
            # rest was waiting for a core, not work of the gateway's.
            # ``path``: FIFO for every process of the measured path (this client, both
            # replay models, the gateway), so what is left of the added latency is the
            # gateway's own work with no queueing in front of any hop.
            boosted = [gw.pid] + ([os.getpid(), up.pid, gw_up.pid] if how == "path" else [])
            if old is not None:
                # The compared gateway (and, for ``path``, its replay model) gets the same
                # boost for its own rounds, so the control rows compare like with like.
                boosted += [old.pid] + ([old_up.pid] if how == "path" else [])
            for pid in boosted:
                boost(pid, "fifo" if how == "path" else how)
            try:
                rows.append(series(args.control_clients, control=how))
            finally:
                for pid in boosted:
                    boost(pid, "normal")
        sampler.close()
        rds, rgs = [], []
        gw_cpu = up_cpu_direct = old_cpu = 0.0
        n_rate = (args.rate_requests // 3 // 16) * 16
        for _ in range(3):
            c0 = cpu_seconds(up.pid)
            rds.append(asyncio.run(rate(up_port, token, 16, n_rate)))
            up_cpu_direct += cpu_seconds(up.pid) - c0
            g0 = cpu_seconds(gw.pid)
            rgs.append(asyncio.run(rate(gw_port, token, 16, n_rate)))
            gw_cpu += cpu_seconds(gw.pid) - g0
            if old is not None:
                o0 = cpu_seconds(old.pid)
                asyncio.run(rate(old_port, token, 16, n_rate))
                old_cpu += cpu_seconds(old.pid) - o0
        rd, rg = max(rds), max(rgs)
        # CPU seconds the process itself used per request: what one whole core would do,
        # whatever else the shared machine was running.
        gw_core_rps = 3 * n_rate / gw_cpu if gw_cpu else float("nan")
        up_core_rps = 3 * n_rate / up_cpu_direct if up_cpu_direct else float("nan")
        old_core_rps = 3 * n_rate / old_cpu if old_cpu else float("nan")
        load1 = os.getloadavg()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "latency": rows,
        "rate": {
            "direct_rps": rd,
            "gateway_rps": rg,
            "ratio": rg / rd if rd else float("nan"),
            "gateway_rps_per_cpu_second": gw_core_rps,
            "replay_rps_per_cpu_second": up_core_rps,
            "compare_rps_per_cpu_second": old_core_rps,
        },
        "loadavg_before": load0,
        "loadavg_after": load1,
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"host: {os.cpu_count()} CPUs, load average before {load0[0]:.2f}, after {load1[0]:.2f}; "
          f"{args.busy} busy gateways streaming {args.busy_rate:g} events/s each")  # fmt: skip
    print("\nstreaming latency (full stream, ms)\n")
    cmp = args.compare_src is not None
    extra = (" compare added p50 | compare added p99 | compare CPU/req | compare req/CPU-s |"
             if cmp else "")  # fmt: skip
    head = ("| clients | control | n | direct p50 | gw p50 | added p50 | direct p99 | gw p99 "
            "| added p99 | gw CPU/req | gw run-queue wait/req (loop thread) | req/CPU-s "
            "| runnable mean/max |")  # fmt: skip
    print(head + extra)
    print("|---:" * (13 + 4 * cmp) + "|")
    for r in rows:
        line = (
            f"| {r['clients']} | {r['control']} | {r['n']} | {r['direct_p50_ms']:.2f} "
            f"| {r['gateway_p50_ms']:.2f} | {r['added_p50_ms']:.2f} | {r['direct_p99_ms']:.2f} "
            f"| {r['gateway_p99_ms']:.2f} | {r['added_p99_ms']:.2f} "
            f"| {r['gw_cpu_ms_per_req']:.2f} "
            f"| {r['gw_wait_ms_per_req']:.2f} ({r['gw_loop_wait_ms_per_req']:.2f}) "
            f"| {r['gw_req_per_cpu_s']:.0f} "
            f"| {r['procs_running_mean']:.1f}/{r['procs_running_max']} |"
        )
        if cmp:
            line += (f" {r['compare_added_p50_ms']:.2f} | {r['compare_added_p99_ms']:.2f} "
                     f"| {r['compare_cpu_ms_per_req']:.2f} "
                     f"| {r['compare_req_per_cpu_s']:.0f} |")  # fmt: skip
        print(line)
    print("\nper thread of the measured gateway (ms on CPU, ms waiting for a CPU, slices):")
    for r in rows:
        threads = ", ".join(
            f"{k} {v[0]:.0f}/{v[1]:.0f}/{v[2]}" for k, v in sorted(r["gw_threads"].items())
        )
        print(f"  {r['clients']} streams {r['control']}: {threads}")
    print()
    print("non-streamed small calls, 16 keep-alive clients (best of 3 rounds)")
    print(f"  direct {rd:8.0f} req/s   gateway {rg:8.0f} req/s   ratio {rg / rd:.2f}")
    print(
        f"  per CPU-second of the process: gateway {gw_core_rps:.0f} req, "
        f"replay model {up_core_rps:.0f} req"
        + (f", compared gateway {old_core_rps:.0f} req" if cmp else "")
    )
    print(
        f"  gateway CPU per request: {1000 / gw_core_rps:.3f} ms"
        + (f" (compared gateway {1000 / old_core_rps:.3f} ms)" if cmp else "")
    )


if __name__ == "__main__":
    main()
