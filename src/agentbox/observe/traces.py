"""One OpenTelemetry trace per task, exported when the task ends.

Off unless the launcher's environment names an OTLP/HTTP collector with OpenTelemetry's
own variables (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or ``OTEL_EXPORTER_OTLP_ENDPOINT``
to which ``/v1/traces`` is added; headers and timeouts from the other standard
``OTEL_EXPORTER_OTLP_*`` variables), and the ``otel`` extra is installed. Nothing is
sent anywhere else, and nothing of this reaches a sandbox.

The trace: a root span ``agentbox.task`` (submission to end) with the task's id, status,
model, backend, tokens and cost; below it a span per phase (``queue``, ``setup``,
``start``, ``agent``, ``collect``: :mod:`agentbox.observe.phases`), and below ``agent``
a span per model request from the gateway's request ledger (model, tokens, status,
stop reason). The task text, the repo path and anything the agent wrote are never
attributes. Export is best effort: a collector that is down costs the task at most the
exporter's timeout, and never its result.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentbox.core.log import get_logger
from agentbox.core.paths import TaskPaths
from agentbox.observe.phases import task_phases

log = get_logger(__name__)

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_MAX_REQUEST_SPANS = 2000


def traces_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether a collector is configured (the standard variables; empty means unset)."""
    env = os.environ if env is None else env
    return any(env.get(name, "").strip() for name in _ENDPOINT_VARS)


def _ns(t: float) -> int:
    return int(t * 1e9)


def export_task(data_dir: Path, row: Any, *, report: Mapping[str, Any] | None = None) -> bool:
    """Export the trace of finished task ``row`` (a launcher store row); True if sent.

    Never raises: a trace is an observation, not part of the task."""
    if not traces_enabled():
        return False
    try:
        return _export(data_dir, row, report or {})
    except Exception as exc:
        log.warning("task trace not exported", task_id=row.id, error=f"{type(exc).__name__}: {exc}")
        return False


def _export(data_dir: Path, row: Any, report: Mapping[str, Any]) -> bool:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from agentbox.gateway import read_requests

    paths = TaskPaths(data_dir, row.id)
    phases = task_phases(paths.log_dir, row.created_at)
    end = row.finished_at or (phases.spans[-1].end if phases.spans else row.created_at)
    exporter = OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "agentbox"}))
    # one batch, sent by force_flush below: one request per task, not one per span
    provider.add_span_processor(
        BatchSpanProcessor(exporter, max_queue_size=4096, max_export_batch_size=4096)
    )
    try:
        tracer = provider.get_tracer("agentbox")
        tokens = row.tokens
        attrs: dict[str, Any] = {
            "agentbox.task.id": row.id,
            "agentbox.task.status": row.status,
            "agentbox.model": row.model,
            "agentbox.backend": row.backend or "unknown",
            "agentbox.tokens.input": tokens.input,
            "agentbox.tokens.output": tokens.output,
            "agentbox.tokens.cache_creation": tokens.cache_creation,
            "agentbox.tokens.cache_read": tokens.cache_read,
            "agentbox.readoptions": phases.readoptions,
        }
        if tokens.cost_usd is not None:
            attrs["agentbox.cost_usd"] = tokens.cost_usd
        if row.runtime:
            attrs["agentbox.runtime"] = row.runtime
        if isinstance(report.get("exit_code"), int):
            attrs["agentbox.agent.exit_code"] = report["exit_code"]
        root = tracer.start_span("agentbox.task", attributes=attrs, start_time=_ns(row.created_at))
        if row.status != "done":
            root.set_status(trace.Status(trace.StatusCode.ERROR, (row.error or row.status)[:200]))
        root_ctx = trace.set_span_in_context(root)
        for span in phases.spans:
            s = tracer.start_span(
                f"agentbox.{span.name}", context=root_ctx, start_time=_ns(span.start)
            )
            if span.name == "agent":
                _requests(tracer, trace.set_span_in_context(s), read_requests(paths.usage_file))
            s.end(end_time=_ns(span.end))
        root.end(end_time=_ns(end))
        return provider.force_flush(timeout_millis=10_000)
    finally:
        provider.shutdown()


def _requests(tracer: Any, ctx: Any, records: list[Any]) -> None:
    for r in records[:_MAX_REQUEST_SPANS]:
        start = r.started if r.started is not None else r.time
        attrs = {
            "gen_ai.system": "anthropic",
            "gen_ai.request.model": r.asked or r.model,
            "gen_ai.response.model": r.model,
            "gen_ai.usage.input_tokens": r.input,
            "gen_ai.usage.output_tokens": r.output,
            "agentbox.tokens.cache_creation": r.cache_creation,
            "agentbox.tokens.cache_read": r.cache_read,
            "http.response.status_code": r.status,
        }
        if r.stop_reason:
            attrs["gen_ai.response.finish_reasons"] = [r.stop_reason]
        if r.message_id:
            attrs["gen_ai.response.id"] = r.message_id
        span = tracer.start_span("agentbox.model_request", context=ctx, start_time=_ns(start))
        span.set_attributes(attrs)
        span.end(end_time=_ns(r.time))
