"""Egress proxy throughput against a direct download of the same files (target: >= 0.8x).

Usage: .venv/bin/python bench/egress.py [--package pip] [--files 4] [--runs 3] [--latency 40]

The files are real distribution files of ``--package`` from the index this host's
pip uses (read from pip, as the proxy's allow-list is; no registry is named here).
Each file is downloaded, alternately in the same run:

* direct: httpx on the host, TLS verified against the host's CA bundle;
* proxied: the same httpx through the sandbox's path, the in-sandbox relay
  (``guest/relay.py`` on 127.0.0.1, run on the host here) → the proxy's unix socket →
  a spawned proxy process (dropped to the gateway's uid when run as root);
* proxy only: httpcore speaking to the proxy's unix socket itself (no relay), to
  tell the proxy's share from the relay's;
* intercepted: the same httpx through the relay to a second proxy that has a
  request-level rule for the index's hosts (``[[network.rule]]`` with an injected
  header): TLS terminated with the task CA, each request matched, the header added,
  the answer scanned for the secret (target: >= 0.7x direct).

Then ``--latency`` small requests (``HEAD`` of each file, keep-alive) direct and
intercepted: the added latency per request, p50 (target: <= 5 ms), both as the
difference of the two medians and as the median of paired differences (each
intercepted HEAD less the direct one just before it: the index's own jitter mostly
cancels). Last, each proxy process's memory (RSS) after the runs.

Prints the median throughput (MB/s) of each way and the ratio to direct.
"""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpcore
import httpx
import psutil

from agentbox.config import Settings
from agentbox.egress import EgressPolicy, host_ca_bundle, spawn_proxy, summarize
from agentbox.egress.rules import Inject, NetworkRule
from agentbox.gateway import gateway_identity

RELAY = Path(__file__).resolve().parent.parent / "src/agentbox/guest/relay.py"


class _UnixBackend(httpcore.SyncBackend):
    """Every TCP connection httpcore makes goes to the proxy's unix socket instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None, socket_options: object = None,
                    ) -> httpcore.NetworkStream:  # fmt: skip
        return self.connect_unix_socket(self.path, timeout)


def _cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _file_urls(client: httpx.Client, index: str, package: str, count: int) -> list[str]:
    """The ``count`` largest-looking files of the newest releases on the package's index page."""
    page = client.get(f"{index.rstrip('/')}/{package}/", follow_redirects=True)
    page.raise_for_status()
    links = re.findall(r'href="([^"]+\.(?:whl|tar\.gz))(?:#[^"]*)?"', page.text)
    urls = [str(page.url.join(link)) for link in links]
    return urls[-count:]


def _download(client: httpx.Client | httpcore.HTTPProxy, url: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = 0
    if isinstance(client, httpcore.HTTPProxy):
        with client.stream("GET", url) as r:
            assert r.status == 200, r.status
            for chunk in r.iter_stream():
                n += len(chunk)
        return n, time.perf_counter() - t0
    with client.stream("GET", url) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes(1 << 16):
            n += len(chunk)
    return n, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--package", default="pip")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--latency", type=int, default=40, help="HEAD requests per way")
    args = p.parse_args()
    settings = Settings()
    policy = EgressPolicy.for_phase(settings, registries=True)
    pip = [r for r in policy.rules if r.source == "pip" and 443 in r.tls_ports]
    if not pip:
        print("this host's pip has no https index")
        return 2
    index = f"https://{pip[0].pattern}/simple"
    ca = str(host_ca_bundle(settings))
    tmp = Path(tempfile.mkdtemp(prefix="agentbox-bench-egress-"))
    sock, log = tmp / "egress.sock", tmp / "egress.log"
    isock, ilog = tmp / "intercept.sock", tmp / "intercept.log"
    port, iport = _free_port(), _free_port()
    direct = httpx.Client(verify=ca, timeout=120, follow_redirects=True)
    urls = _file_urls(direct, index, args.package, args.files)
    hosts = sorted({httpx.URL(u).host for u in urls} | {pip[0].pattern})
    rules = [
        NetworkRule(host=h, inject=Inject("X-Agentbox-Bench", "Bearer ${secret:BENCH}"),
                    origin="test")
        for h in hosts
    ]  # fmt: skip
    ident = gateway_identity(settings)
    relays: list[subprocess.Popen[bytes]] = []
    with (
        spawn_proxy(sock, policy, log, ident) as tunnel,
        spawn_proxy(isock, policy, ilog, ident, rules=rules, stderr_file=tmp / "i.stderr",
                    secret_values={"BENCH": "bench-not-a-secret-0123456789"}) as icpt,
    ):  # fmt: skip
        for s_, p_ in ((sock, port), (isock, iport)):
            relays.append(subprocess.Popen(
                [sys.executable, str(RELAY), "--port", str(p_), "--socket", str(s_)]
            ))  # fmt: skip
        try:
            time.sleep(0.5)
            assert icpt.ca_cert is not None
            bundle = tmp / "bundle.pem"
            bundle.write_bytes(Path(ca).read_bytes() + b"\n" + icpt.ca_cert)
            proxied = httpx.Client(
                verify=ca, timeout=120, follow_redirects=True, proxy=f"http://127.0.0.1:{port}"
            )
            intercepted = httpx.Client(
                verify=str(bundle), timeout=120, follow_redirects=True,
                proxy=f"http://127.0.0.1:{iport}",
            )  # fmt: skip
            # The proxy alone: httpcore speaks to its unix socket directly (no relay).
            bare = httpcore.HTTPProxy(
                proxy_url="http://egress-proxy/",
                ssl_context=ssl.create_default_context(cafile=ca),
                network_backend=_UnixBackend(str(sock)),
            )
            rates: dict[str, list[float]] = {
                "direct": [], "proxied": [], "proxy only": [], "intercepted": []
            }  # fmt: skip
            total = 0
            ways: tuple[tuple[str, httpx.Client | httpcore.HTTPProxy], ...] = (
                ("direct", direct),
                ("proxied", proxied),
                ("proxy only", bare),
                ("intercepted", intercepted),
            )
            pids = {"proxied": tunnel.pid, "intercepted": icpt.pid}
            cpu = dict.fromkeys(pids, 0.0)
            moved = dict.fromkeys(pids, 0)
            for _ in range(args.runs):
                for url in urls:
                    for name, client in ways:
                        c0 = _cpu(pids[name]) if name in pids else 0.0
                        n, secs = _download(client, url)
                        if name in pids:
                            cpu[name] += _cpu(pids[name]) - c0
                            moved[name] += n
                        rates[name].append(n / secs / 1e6)
                        total += n if name == "intercepted" else 0
            lat: dict[str, list[float]] = {"direct": [], "intercepted": []}
            for i in range(args.latency):
                url = urls[i % len(urls)]
                for name, cl in (("direct", direct), ("intercepted", intercepted)):
                    t0 = time.perf_counter()
                    cl.head(url).raise_for_status()
                    lat[name].append((time.perf_counter() - t0) * 1000)
            # Each intercepted HEAD less the direct one just before it: the upstream's own
            # jitter (tens of ms to a public index) cancels in the pair far better than
            # between two medians of different requests.
            pairs = [b - a for a, b in zip(lat["direct"], lat["intercepted"], strict=True)]
            rss = {
                "tunnel": psutil.Process(tunnel.pid).memory_info().rss,
                "intercepting": psutil.Process(icpt.pid).memory_info().rss,
            }
            proxied.close()
            intercepted.close()
            bare.close()
        finally:
            for r in relays:
                r.terminate()
                r.wait(5)
    direct.close()
    s = summarize(log)
    si = summarize(ilog)
    shutil.rmtree(tmp, ignore_errors=True)
    d, q = statistics.median(rates["direct"]), statistics.median(rates["proxied"])
    b = statistics.median(rates["proxy only"])
    t = statistics.median(rates["intercepted"])
    ld, li = statistics.median(lat["direct"]), statistics.median(lat["intercepted"])
    print(f"files: {len(urls)} of {args.package} x {args.runs} runs, {total / 1e6:.1f} MB "
          "intercepted")  # fmt: skip
    print("| way | median MB/s | / direct |")
    print("|---|---:|---:|")
    print(f"| direct | {d:.1f} | 1.00 |")
    print(f"| proxied (tunnel: relay -> socket -> proxy) | {q:.1f} | {q / d:.2f} |")
    print(f"| proxy only (socket -> proxy, no relay) | {b:.1f} | {b / d:.2f} |")
    print(f"| intercepted (TLS terminated, rule, injection) | {t:.1f} | {t / d:.2f} |")
    print(f"latency, {args.latency} HEAD each (keep-alive): direct p50 {ld:.1f} ms, "
          f"intercepted p50 {li:.1f} ms, added {li - ld:+.1f} ms (target <= 5 ms)")  # fmt: skip
    q1, q2, q3 = statistics.quantiles(pairs, n=4)
    print(f"latency, paired (intercepted - the direct HEAD just before it): p50 {q2:+.1f} ms, "
          f"quartiles {q1:+.1f} / {q3:+.1f} ms")  # fmt: skip
    print("proxy CPU seconds per 100 MB (the proxy process only; robust to a loaded host): "
          f"tunnel {cpu['proxied'] / (moved['proxied'] / 1e8):.2f}, "
          f"intercepting {cpu['intercepted'] / (moved['intercepted'] / 1e8):.2f}")  # fmt: skip
    print(f"proxy RSS after the runs: tunnel {rss['tunnel'] / 2**20:.1f} MiB, "
          f"intercepting {rss['intercepting'] / 2**20:.1f} MiB")  # fmt: skip
    print(f"egress logs: tunnel {s.allowed} allowed, {s.denied} denied; intercepted "
          f"{si.allowed} requests, {si.injected} injected, {si.denied} denied")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
