"""The launcher's Prometheus metrics, read from what the launcher already keeps.

``agentbox launcher serve --metrics 127.0.0.1:PORT`` (or ``agentbox serve --metrics``)
serves ``/metrics`` with the standard client library. Nothing is counted twice in
memory: each scrape reads the task store, each finished task's files once (cached by
id: a finished task does not change), and the live tasks' files every time. So the
figures survive a launcher restart, and a counter falls only when ``agentbox rm`` or
``prune`` removes tasks (Prometheus reads that as a counter reset).

The names and labels are in ``docs/reference/metrics.md``; ``deploy/grafana/`` has a
dashboard that uses only them (a unit test holds it to that).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from agentbox.config import Settings
from agentbox.core.files import read_regular
from agentbox.core.listen import parse_loopback
from agentbox.core.paths import TaskPaths
from agentbox.core.tally import LAUNCHER_STARTS, POOL_CLAIMS, count_one, tally
from agentbox.launcher._store import Store, TaskRow
from agentbox.launcher.api import TERMINAL
from agentbox.observe.phases import PHASE_NAMES, task_phases

#: Histogram buckets for task and phase durations, in seconds (a second to a day).
BUCKETS = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 14400.0, 86400.0)
_MAX_JSON = 1 << 20


@dataclass
class _Finished:
    """What a finished task contributes, read once."""

    backend: str
    model: str
    duration: float | None
    phases: dict[str, float]
    refusals: dict[str, int]
    egress_allowed: int
    egress_refused: int


@dataclass
class _Hist:
    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    total: float = 0.0
    n: int = 0

    def observe(self, v: float) -> None:
        self.n += 1
        self.total += v
        for i, edge in enumerate(BUCKETS):
            if v <= edge:
                self.counts[i] += 1

    def buckets(self) -> list[tuple[str, float]]:
        out = [(_edge(edge), float(c)) for edge, c in zip(BUCKETS, self.counts, strict=True)]
        return [*out, ("+Inf", float(self.n))]


def _edge(v: float) -> str:
    return f"{v:g}" if v != int(v) else f"{int(v)}.0"


def _read_json(path: Path) -> dict[str, Any]:
    raw = read_regular(path, _MAX_JSON)
    try:
        data = json.loads(raw) if raw is not None else None
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _egress_counts(log_dir: Path) -> tuple[int, int]:
    from agentbox.egress import summarize

    allowed = refused = 0
    for name in ("egress-setup.jsonl", "egress-agent.jsonl"):
        path = log_dir / name
        if path.is_file() and not path.is_symlink():
            s = summarize(path)
            allowed += s.allowed
            refused += s.denied
    return allowed, refused


def _refusals(usage: dict[str, Any]) -> dict[str, int]:
    raw = usage.get("refusals")
    if not isinstance(raw, dict):
        return {}
    return {
        str(k)[:40]: v for k, v in raw.items() if isinstance(v, int) and not isinstance(v, bool)
    }


def note_launcher_start(settings: Settings) -> None:
    """Count one launcher start on ``settings``' data dir."""
    run = settings.data_dir / "run"
    with contextlib.suppress(OSError):
        run.mkdir(mode=0o700, exist_ok=True)
    count_one(run / LAUNCHER_STARTS)


class LauncherCollector:
    """A Prometheus collector over one data dir's tasks (see the module's docstring)."""

    def __init__(self, settings: Settings, *, node: str | None = None) -> None:
        self.settings = settings
        self.node = node or socket.gethostname()
        self._store: Store | None = None
        self._finished: dict[str, _Finished] = {}
        self._lock = threading.Lock()

    def _rows(self) -> list[TaskRow]:
        if self._store is None:
            self._store = Store(self.settings.data_dir / "state.db")
        return self._store.all()

    def _finished_of(self, row: TaskRow) -> _Finished:
        got = self._finished.get(row.id)
        if got is not None:
            return got
        paths = TaskPaths(self.settings.data_dir, row.id)
        phases = task_phases(paths.log_dir, row.created_at)
        usage = _read_json(paths.usage_file)
        allowed, refused = _egress_counts(paths.log_dir)
        duration = (
            row.finished_at - row.created_at
            if row.finished_at is not None and row.finished_at >= row.created_at
            else None
        )
        got = _Finished(
            backend=row.backend or "unknown",
            model=row.model,
            duration=duration,
            phases={s.name: s.seconds for s in phases.spans},
            refusals=_refusals(usage),
            egress_allowed=allowed,
            egress_refused=refused,
        )
        self._finished[row.id] = got
        return got

    def describe(self) -> Iterable[Metric]:
        return []  # collected on demand: no scrape at registration

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            yield from self._collect()

    def _collect(self) -> Iterator[Metric]:
        node = self.node
        rows = self._rows()
        live = {r.id for r in rows}
        for gone in set(self._finished) - live:
            del self._finished[gone]

        tasks = GaugeMetricFamily(
            "agentbox_tasks", "Tasks in the store by status and backend.",
            labels=["node", "status", "backend"],
        )  # fmt: skip
        by: dict[tuple[str, str], int] = {}
        for r in rows:
            key = (r.status, r.backend or "unknown")
            by[key] = by.get(key, 0) + 1
        for (status, backend), n in sorted(by.items()):
            tasks.add_metric([node, status, backend], n)
        yield tasks

        duration = _Hist()
        phases = {name: _Hist() for name in PHASE_NAMES}
        tokens: dict[tuple[str, str], int] = {}
        cost: dict[str, float] = {}
        refusals: dict[str, int] = {}
        egress = {"allowed": 0, "refused": 0}
        readoptions = 0
        sandboxes = gateways = 0
        for r in rows:
            readoptions += r.adoptions
            for kind in ("input", "output", "cache_creation", "cache_read"):
                tokens[(r.model, kind)] = tokens.get((r.model, kind), 0) + getattr(r.tokens, kind)
            if r.tokens.cost_usd is not None:
                cost[r.model] = cost.get(r.model, 0.0) + r.tokens.cost_usd
            if r.status not in TERMINAL:
                if r.status == "running" and r.sandbox:
                    sandboxes += 1
                if r.gateway is not None and r.gateway.alive():
                    gateways += 1
                continue
            fin = self._finished_of(r)
            if fin.duration is not None:
                duration.observe(fin.duration)
            for name, secs in fin.phases.items():
                phases[name].observe(secs)
            for reason, n in fin.refusals.items():
                refusals[reason] = refusals.get(reason, 0) + n
            egress["allowed"] += fin.egress_allowed
            egress["refused"] += fin.egress_refused

        h = HistogramMetricFamily(
            "agentbox_task_duration_seconds", "Finished tasks: submission to end.",
            labels=["node"],
        )  # fmt: skip
        h.add_metric([node], duration.buckets(), duration.total)
        yield h
        ph = HistogramMetricFamily(
            "agentbox_phase_duration_seconds",
            "Finished tasks' phases: queue, setup, start, agent, collect.",
            labels=["node", "phase"],
        )
        for name in PHASE_NAMES:
            ph.add_metric([node, name], phases[name].buckets(), phases[name].total)
        yield ph

        tok = CounterMetricFamily(
            "agentbox_tokens", "Tokens metered by the tasks' gateways, by model and kind.",
            labels=["node", "model", "kind"],
        )  # fmt: skip
        for (model, kind), n in sorted(tokens.items()):
            tok.add_metric([node, model, kind], n)
        yield tok
        usd = CounterMetricFamily(
            "agentbox_cost_usd", "Dollars charged at the model registry's prices, by model.",
            labels=["node", "model"],
        )  # fmt: skip
        for model, v in sorted(cost.items()):
            usd.add_metric([node, model], v)
        yield usd
        ref = CounterMetricFamily(
            "agentbox_budget_refusals", "Model requests the task's budget refused, by reason.",
            labels=["node", "reason"],
        )  # fmt: skip
        for reason, n in sorted(refusals.items()):
            ref.add_metric([node, reason], n)
        yield ref
        eg = CounterMetricFamily(
            "agentbox_egress_requests", "Finished tasks' egress proxy requests, by verdict.",
            labels=["node", "verdict"],
        )  # fmt: skip
        for verdict, n in egress.items():
            eg.add_metric([node, verdict], n)
        yield eg

        yield _gauge("agentbox_sandboxes_live", "Task sandboxes running now.", node, sandboxes)
        yield _gauge("agentbox_gateways_live", "Task model gateways alive now.", node, gateways)
        pool = self.settings.data_dir / "pool"
        ready = 0
        with contextlib.suppress(OSError):
            ready = sum(1 for d in (pool / "slots").iterdir() if (d / "ready").is_file())
        yield _gauge("agentbox_pool_ready", "Warm-pool sandboxes ready to claim.", node, ready)
        yield _counter(
            "agentbox_pool_claims",
            "Tasks served from the warm pool.",
            node,
            tally(pool / POOL_CLAIMS),
        )
        yield _counter(
            "agentbox_launcher_starts", "Launcher starts on this data dir.", node,
            tally(self.settings.data_dir / "run" / LAUNCHER_STARTS),
        )  # fmt: skip
        yield _counter(
            "agentbox_task_readoptions", "Running tasks taken over by a new launcher.",
            node, readoptions,
        )  # fmt: skip


def _gauge(name: str, doc: str, node: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["node"])
    g.add_metric([node], value)
    return g


def _counter(name: str, doc: str, node: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["node"])
    c.add_metric([node], value)
    return c


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer:
    """``/metrics`` on a loopback address, in a daemon thread; :meth:`stop` ends it."""

    def __init__(self, settings: Settings, listen: str, *, node: str | None = None) -> None:
        host, port = parse_listen(listen)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(LauncherCollector(settings, node=node))
        app = make_wsgi_app(self.registry)
        self._server: WSGIServer = make_server(host, port, app, handler_class=_QuietHandler)
        self.address = f"{host}:{self._server.server_port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="agentbox-metrics", daemon=True
        )

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a loop that must be running
            self._server.shutdown()
        self._server.server_close()


def parse_listen(listen: str) -> tuple[str, int]:
    """``127.0.0.1:PORT`` → (host, port); anything but a loopback address is refused:
    metrics name models and task counts, for this host's operators only."""
    return parse_loopback(listen, flag="--metrics", who="the metrics endpoint")
