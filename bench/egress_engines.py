"""Request-level egress engines compared: our proxy extended vs mitmproxy used as a proxy.

Usage: .venv/bin/python bench/egress_engines.py --mitmdump /path/to/mitmdump [--files 3] [--runs 3]

Both terminate TLS, match a rule and inject a header into every request for the
package index's hosts (read from this host's pip, as ``bench/egress.py`` does):

* ours: a spawned proxy with ``[[network.rule]]``-style rules (dropped to the gateway
  identity when run as root), reached through the in-sandbox relay on a TCP port;
* mitmproxy: ``mitmdump`` (regular proxy mode, its own CA) with a five-line addon
  that sets the header, on a TCP port.

Per engine: median download throughput of the same real files, CPU seconds the proxy
process spent per 100 MB (less sensitive than MB/s to a loaded host), its RSS after
the runs, and p50 of keep-alive ``HEAD`` requests. mitmproxy is not a dependency: give
the path of a ``mitmdump`` installed elsewhere (``pip install mitmproxy`` in a venv).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from agentbox.config import Settings
from agentbox.egress import EgressPolicy, host_ca_bundle, spawn_proxy
from agentbox.egress.rules import Inject, NetworkRule
from agentbox.gateway import gateway_identity

sys.path.insert(0, str(Path(__file__).resolve().parent))
from egress import RELAY, _download, _file_urls, _free_port

ADDON = """
from mitmproxy import http
def request(flow: http.HTTPFlow) -> None:
    flow.request.headers["X-Agentbox-Bench"] = "Bearer bench-not-a-secret-0123456789"
"""


def _wait_port(port: int, timeout: float = 30.0) -> None:
    import socket

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {port}")


def _measure(name: str, client: httpx.Client, urls: list[str], runs: int, pids: list[int],
             heads: int) -> dict[str, float]:  # fmt: skip
    procs = [psutil.Process(p) for p in pids]
    cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)
    rates, total = [], 0
    for _ in range(runs):
        for url in urls:
            n, secs = _download(client, url)
            rates.append(n / secs / 1e6)
            total += n
    cpu = sum(sum(p.cpu_times()[:2]) for p in procs) - cpu0
    lat = []
    for i in range(heads):
        t0 = time.perf_counter()
        client.head(urls[i % len(urls)]).raise_for_status()
        lat.append((time.perf_counter() - t0) * 1000)
    rss = sum(p.memory_info().rss for p in procs)
    return {
        "mbps": statistics.median(rates),
        "cpu_per_100mb": cpu / (total / 1e8) if total else 0.0,
        "rss_mib": rss / 2**20,
        "p50_ms": statistics.median(lat) if lat else 0.0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mitmdump", required=True)
    p.add_argument("--package", default="pip")
    p.add_argument("--files", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--heads", type=int, default=30)
    args = p.parse_args()
    settings = Settings()
    policy = EgressPolicy.for_phase(settings, registries=True)
    pip = [r for r in policy.rules if r.source == "pip" and 443 in r.tls_ports]
    if not pip:
        print("this host's pip has no https index")
        return 2
    ca = str(host_ca_bundle(settings))
    tmp = Path(tempfile.mkdtemp(prefix="agentbox-bench-engines-"))
    direct = httpx.Client(verify=ca, timeout=120, follow_redirects=True)
    urls = _file_urls(direct, f"https://{pip[0].pattern}/simple", args.package, args.files)
    hosts = sorted({httpx.URL(u).host for u in urls} | {pip[0].pattern})
    rules = [NetworkRule(host=h, inject=Inject("X-Agentbox-Bench", "Bearer ${secret:B}"),
                         origin="test") for h in hosts]  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    results["direct"] = _measure("direct", direct, urls, args.runs, [os.getpid()], args.heads)
    results["direct"]["cpu_per_100mb"] = 0.0
    results["direct"]["rss_mib"] = 0.0
    # Ours.
    port = _free_port()
    sock = tmp / "egress.sock"
    with spawn_proxy(sock, policy, tmp / "egress.log", gateway_identity(settings), rules=rules,
                     secret_values={"B": "bench-not-a-secret-0123456789"}) as proxy:  # fmt: skip
        relay = subprocess.Popen([sys.executable, str(RELAY), "--port", str(port),
                                  "--socket", str(sock)])  # fmt: skip
        try:
            _wait_port(port)
            assert proxy.ca_cert is not None
            bundle = tmp / "bundle.pem"
            bundle.write_bytes(Path(ca).read_bytes() + b"\n" + proxy.ca_cert)
            with httpx.Client(verify=str(bundle), timeout=120, follow_redirects=True,
                              proxy=f"http://127.0.0.1:{port}") as c:  # fmt: skip
                results["ours (relay + proxy)"] = _measure(
                    "ours", c, urls, args.runs, [proxy.pid, relay.pid], args.heads
                )
        finally:
            relay.terminate()
            relay.wait(5)
    # mitmproxy.
    addon = tmp / "inject.py"
    addon.write_text(ADDON)
    mport = _free_port()
    confdir = tmp / "mitm"
    mitm = subprocess.Popen(
        [args.mitmdump, "-q", "--listen-host", "127.0.0.1", "--listen-port", str(mport),
         "--set", f"confdir={confdir}", "--set", f"ssl_verify_upstream_trusted_ca={ca}",
         "-s", str(addon)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_port(mport)
        mca = confdir / "mitmproxy-ca-cert.pem"
        bundle = tmp / "mbundle.pem"
        bundle.write_bytes(Path(ca).read_bytes() + b"\n" + mca.read_bytes())
        with httpx.Client(verify=str(bundle), timeout=120, follow_redirects=True,
                          proxy=f"http://127.0.0.1:{mport}") as c:  # fmt: skip
            results["mitmproxy 11.0.2 (mitmdump + addon)"] = _measure(
                "mitm", c, urls, args.runs, [mitm.pid], args.heads
            )
    finally:
        mitm.terminate()
        mitm.wait(10)
    direct.close()
    shutil.rmtree(tmp, ignore_errors=True)
    d = results["direct"]
    print(f"files: {len(urls)} of {args.package} x {args.runs} runs; {args.heads} HEAD each")
    print("| engine | median MB/s | / direct | proxy CPU s per 100 MB | RSS MiB | HEAD p50 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['mbps']:.1f} | {r['mbps'] / d['mbps']:.2f} | "
              f"{r['cpu_per_100mb']:.2f} | {r['rss_mib']:.1f} | {r['p50_ms']:.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
