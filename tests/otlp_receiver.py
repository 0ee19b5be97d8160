"""A real OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with a protobuf
``ExportTraceServiceRequest`` (decoded with the ``opentelemetry-proto`` messages, as a
collector does), on a loopback port, in a thread. The OpenTelemetry Collector itself is
not installable here; this speaks the same wire format to the standard exporter."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Received:
    spans: list[Any] = field(default_factory=list)
    requests: int = 0
    bad: list[str] = field(default_factory=list)
    got: threading.Event = field(default_factory=threading.Event)

    def by_name(self, name: str) -> list[Any]:
        return [s for s in self.spans if s.name == name]


@contextmanager
def otlp_receiver() -> Iterator[tuple[str, Received]]:
    """Yields (endpoint base URL, what was received)."""
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or "protobuf" not in self.headers.get("Content-Type", ""):
                received.bad.append(f"{self.path} {self.headers.get('Content-Type')}")
                self.send_response(404)
                self.end_headers()
                return
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    received.spans.extend(ss.spans)
            received.requests += 1
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            received.got.set()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def attrs(span: Any) -> dict[str, Any]:
    """A span's attributes as plain values."""
    out: dict[str, Any] = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [x.string_value for x in v.array_value.values]
        else:
            out[kv.key] = getattr(v, kind)
    return out
