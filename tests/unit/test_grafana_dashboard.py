"""deploy/grafana/agentbox.json is a valid dashboard whose queries name only metrics the
launcher's collector exposes (read from a real collector over an empty data dir)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from agentbox.config import Settings
from agentbox.launcher.metrics import LauncherCollector

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "agentbox.json"
_NAME = re.compile(r"\bagentbox_[a-z_]+\b")


def _exposed(tmp_path: Path) -> set[str]:
    """Every sample name the collector's families can have (from their ``# TYPE`` lines:
    an empty store has no samples for most of them)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LauncherCollector(Settings(data_dir=tmp_path / "data"), node="n"))
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    out: set[str] = set()
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("# TYPE agentbox_"):
            _, _, name, kind = line.split()
            base = name.removesuffix("_total") if kind == "counter" else name
            out |= {base + s for s in suffixes[kind]}
    return out


def _queries(doc: object) -> list[str]:
    if isinstance(doc, dict):
        out = [doc["expr"]] if isinstance(doc.get("expr"), str) else []
        q = doc.get("query")
        if isinstance(q, dict) and isinstance(q.get("query"), str):
            out.append(q["query"])
        return out + [x for v in doc.values() for x in _queries(v)]
    if isinstance(doc, list):
        return [x for v in doc for x in _queries(v)]
    return []


def test_the_dashboard_names_only_exposed_metrics(tmp_path: Path) -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["title"] and doc["panels"]
    exposed = _exposed(tmp_path)
    queries = _queries(doc)
    assert len(queries) >= 9
    used = {name for q in queries for name in _NAME.findall(q)}
    unknown = sorted(used - exposed)
    assert not unknown, f"the dashboard queries metrics nobody exposes: {unknown}"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))


def test_the_check_catches_a_made_up_metric(tmp_path: Path) -> None:
    exposed = _exposed(tmp_path)
    assert "agentbox_no_such_metric" not in exposed
    assert {"agentbox_phase_duration_seconds_bucket", "agentbox_tokens_total"} <= exposed
    assert "agentbox_tokens" not in exposed  # a counter's samples end in _total
    assert "agentbox_tokens_total_total" not in exposed
