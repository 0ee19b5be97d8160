"""How outcomes become verdicts: host checks on an unconfined process, controls, the report.

No sandbox needed: the host checks are pointed at this very test process (root,
in every host namespace, no seccomp), where each of them must fire.
"""

from __future__ import annotations

import json
import os

import pytest

from agentbox.escape import PROBES, Report, report_json
from agentbox.escape._controls import control_outcome
from agentbox.escape._model import Outcome
from agentbox.escape._registry import by_id
from agentbox.escape._runner import HostView, host_outcomes


def _view(**kw: object) -> HostView:
    args: dict[str, object] = {"runtime": "runc", "mapped_uid": 164000, "pids_max": 512}
    args["memory"] = 512 * 1024**2
    args.update(kw)
    return HostView(**args)  # type: ignore[arg-type]


@pytest.mark.skipif(os.geteuid() != 0, reason="the host checks fire on a root process only")
def test_host_checks_fire_on_this_unconfined_process() -> None:
    got = {o.id: o for o in host_outcomes([os.getpid()], _view())}
    for pid in (
        "host.caps_effective", "host.caps_bounding", "host.seccomp", "host.uid",
        "host.uid_map", "host.ns_net", "host.ns_pid", "host.ns_ipc", "host.ns_uts",
        "host.ns_user", "host.ns_cgroup",
    ):  # fmt: skip
        assert got[pid].status == "fail", (pid, got[pid].seen)


def test_no_readable_process_is_a_failure_never_a_pass() -> None:
    got = {o.id: o for o in host_outcomes([2**22 + 12345], _view())}
    assert got["host.caps_effective"].status == "fail"
    assert got["host.no_new_privs"].status == "fail"
    assert got["host.ns_net"].status == "fail"


def test_gvisor_pid_namespace_is_explicitly_not_applicable() -> None:
    from agentbox.backends import get_backend
    from agentbox.config import Settings

    own = not get_backend("podman", Settings()).shares_host_kernel("runsc")  # the trait asked
    view = _view(runtime="runsc", own_kernel=own)
    got = {o.id: o for o in host_outcomes([os.getpid()], view)}
    assert got["host.ns_pid"].status == "n/a" and "Sentry" in got["host.ns_pid"].seen
    assert got["host.ns_net"].status == "fail"


def _o(pid: str, status: str) -> Outcome:
    spec = by_id(pid)
    return Outcome(pid, spec.where, spec.tried, spec.expected, "seen", status)  # type: ignore[arg-type]


def test_control_verdicts() -> None:
    spec = by_id("dev.no_kvm")
    assert control_outcome(spec, _o("dev.no_kvm", "fail"), "weak").status == "pass"
    assert control_outcome(spec, _o("dev.no_kvm", "error"), "weak").status == "pass"
    assert control_outcome(spec, _o("dev.no_kvm", "pass"), "weak").status == "fail"
    assert control_outcome(spec, _o("dev.no_kvm", "n/a"), "weak").status == "n/a"
    assert control_outcome(spec, None, "weak").status == "fail"


def test_report_fails_on_a_failed_probe_or_a_quiet_control() -> None:
    good = [_o(p.id, "pass") for p in PROBES]
    r = Report("podman", "runc", "standard", outcomes=good)
    assert r.ok
    r.controls = [_o("dev.no_kvm", "fail")]  # a control that did not fire
    assert not r.ok and r.failures[0].id == "dev.no_kvm"
    assert not Report("podman", "runc", "standard").ok  # nothing ran: not ok
    data = json.loads(report_json([r]))
    assert data["ok"] is False and len(data["runs"][0]["probes"]) == len(PROBES)
