"""Egress proxy throughput against a direct download of the same files (target: >= 0.8x).

Usage: .venv/bin/python bench/egress.py [--package pip] [--files 4] [--runs 3]

The files are real distribution files of ``--package`` from the index this host's
pip uses (read from pip, as the proxy's allow-list is; no registry is named here).
Each file is downloaded, alternately in the same run:

* direct: httpx on the host, TLS verified against the host's CA bundle;
* proxied: the same httpx through the sandbox's path, the in-sandbox relay
  (``guest/relay.py`` on 127.0.0.1, run on the host here) → the proxy's unix socket →
  a spawned proxy process (dropped to the gateway's uid when run as root);
* proxy only: httpcore speaking to the proxy's unix socket itself (no relay), to
  tell the proxy's share from the relay's.

Prints the median throughput (MB/s) of each way and the ratio proxied / direct.
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

from agentbox.config import Settings
from agentbox.egress import EgressPolicy, host_ca_bundle, spawn_proxy, summarize
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
    port = _free_port()
    direct = httpx.Client(verify=ca, timeout=120, follow_redirects=True)
    with spawn_proxy(sock, policy, log, gateway_identity(settings)):
        relay = subprocess.Popen(
            [sys.executable, str(RELAY), "--port", str(port), "--socket", str(sock)]
        )
        try:
            time.sleep(0.5)
            proxied = httpx.Client(
                verify=ca, timeout=120, follow_redirects=True, proxy=f"http://127.0.0.1:{port}"
            )
            # The proxy alone: httpcore speaks to its unix socket directly (no relay).
            bare = httpcore.HTTPProxy(
                proxy_url="http://egress-proxy/",
                ssl_context=ssl.create_default_context(cafile=ca),
                network_backend=_UnixBackend(str(sock)),
            )
            urls = _file_urls(direct, index, args.package, args.files)
            rates: dict[str, list[float]] = {"direct": [], "proxied": [], "proxy only": []}
            total = 0
            ways: tuple[tuple[str, httpx.Client | httpcore.HTTPProxy], ...] = (
                ("direct", direct),
                ("proxied", proxied),
                ("proxy only", bare),
            )
            for _ in range(args.runs):
                for url in urls:
                    for name, client in ways:
                        n, secs = _download(client, url)
                        rates[name].append(n / secs / 1e6)
                        total += n if name == "proxied" else 0
            proxied.close()
            bare.close()
        finally:
            relay.terminate()
            relay.wait(5)
    direct.close()
    s = summarize(log)
    shutil.rmtree(tmp, ignore_errors=True)
    d, q = statistics.median(rates["direct"]), statistics.median(rates["proxied"])
    b = statistics.median(rates["proxy only"])
    print(f"files: {len(urls)} of {args.package} x {args.runs} runs, {total / 1e6:.1f} MB proxied")
    print(f"direct   median {d:8.1f} MB/s")
    print(f"proxied  median {q:8.1f} MB/s  (relay -> unix socket -> proxy process)")
    print(f"proxy    median {b:8.1f} MB/s  (unix socket -> proxy process, no relay)")
    print(f"ratio proxied/direct: {q / d:.2f}x (target >= 0.8x); proxy only/direct {b / d:.2f}x")
    print(f"egress log: {s.allowed} allowed, {s.denied} denied, {s.bytes_down / 1e6:.1f} MB down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
