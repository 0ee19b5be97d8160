"""A small HTTPS server for the egress interception tests (run in a network namespace).

``python tls_upstream.py --addr A --port P --cert C --key K --log L``: HTTP/1.1 with
keep-alive over TLS (ALPN offers h2 and http/1.1, so a proxy that asked for h2 would
get it). Every request's method, path, Host and headers are appended to ``--log`` as
a JSON line, so a test checks what the upstream really received. Paths:

- ``/headers``: 200, the request's headers as JSON;
- ``/echo``: 200, a large body with the request's ``Authorization`` value in it (also at
  offsets that straddle read boundaries) and an ``X-Echo`` header repeating it;
- ``/redirect?to=URL``: 302 to ``URL``;
- ``/size?n=N``: 200, N bytes (throughput);
- anything with a body (``POST``): 200, the body's length;
- ``/then-drop``: 200 (kept alive), then the next request on the connection is read and
  the connection closed unanswered (logged with ``"dropped": true``): a keep-alive that
  timed out as the request went out;
- ``/then-close``: 200 (kept alive, no ``Connection: close``), then the connection closed.
"""

from __future__ import annotations

import argparse
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_LOCK = threading.Lock()
_BLOCK = b"x" * 65536


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    log_path = ""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _record(self, body_len: int = 0) -> None:
        rec = {
            "method": self.command,
            "path": self.path,
            "headers": [[k, v] for k, v in self.headers.items()],
            "body": body_len,
        }
        with _LOCK, open(self.log_path, "a") as fh:
            fh.write(json.dumps(rec) + "\n")

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def handle_one_request(self) -> None:
        if not getattr(self, "drop_next", False):
            super().handle_one_request()
            return
        head = [self.rfile.readline(65537)]
        while head[-1] not in (b"\r\n", b"\n", b""):
            head.append(self.rfile.readline(65537))
        with _LOCK, open(self.log_path, "a") as fh:
            line = head[0].decode("latin-1").split()
            fh.write(json.dumps({"method": line[:1], "path": line[1:2], "dropped": True}) + "\n")
        self.close_connection = True

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self._record()
        url = urlsplit(self.path)
        q = parse_qs(url.query)
        auth = self.headers.get("Authorization", "")
        if url.path == "/headers":
            self._send(200, json.dumps(dict(self.headers.items())).encode(),
                       {"Content-Type": "application/json"})  # fmt: skip
        elif url.path == "/echo":
            a = auth.encode()
            body = b"start " + a + b" " + b"y" * 65531 + a + b" " + b"z" * 100000 + a + b" end"
            self._send(200, body, {"X-Echo": auth, "Content-Type": "text/plain"})
        elif url.path in ("/then-drop", "/then-close"):
            self._send(200, b"ok")
            self.drop_next = url.path == "/then-drop"
            self.close_connection = url.path == "/then-close"
        elif url.path == "/redirect":
            self._send(302, b"", {"Location": q.get("to", ["/"])[0]})
        elif url.path == "/size":
            n = int(q.get("n", ["0"])[0])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            while n > 0:
                k = min(n, len(_BLOCK))
                self.wfile.write(_BLOCK[:k])
                n -= k
        else:
            self._send(200, b"ok " + url.path.encode())

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length", "0"))
        data = self.rfile.read(n)
        self._record(len(data))
        self._send(200, f"got {len(data)}".encode())

    do_PUT = do_POST


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--addr", required=True)
    p.add_argument("--port", type=int, default=443)
    p.add_argument("--cert", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--log", required=True)
    a = p.parse_args()
    Handler.log_path = a.log
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(a.cert, a.key)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    srv = ThreadingHTTPServer((a.addr, a.port), Handler)
    srv.daemon_threads = True
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
