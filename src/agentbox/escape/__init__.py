"""The escape suite: probes inside real sandboxes, posture checks from the host, and
a positive control for every probe.

Public surface::

    from agentbox.escape import run_suite, PROBES, Report
    report = run_suite(get_backend("podman", settings), settings, runtime="runsc", controls=True)
    report.ok, report.failures, report.to_dict()

The in-sandbox program is :mod:`agentbox.guest.probe` (stdlib only). See
docs/reference/escape-suite.md for the probe list and per-backend results, and
docs/explanation/threat-model.md for why each probe exists.
"""

from __future__ import annotations

from agentbox.escape._model import Outcome, ProbeSpec, Report, Status
from agentbox.escape._registry import PROBES
from agentbox.escape._report import print_report, report_json
from agentbox.escape._suite import run_suite

__all__ = [
    "PROBES",
    "Outcome",
    "ProbeSpec",
    "Report",
    "Status",
    "print_report",
    "report_json",
    "run_suite",
]
