"""The in-sandbox probe program and the registry, without a sandbox (no privileges needed).

Run on the host, the probe program must *fire* where the host is not confined
(e.g. /dev/kvm exists here, the host has capabilities as root): that proves
those probes can fail at all, before any control runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib import resources
from typing import Any

from agentbox.escape import PROBES
from agentbox.escape._controls import stall_control
from agentbox.escape._hostcheck import namespace_differs, read_threads
from agentbox.escape._probeio import probe_program
from agentbox.escape._runner import inside_outcomes, probe_source
from agentbox.guest import probe

PROBE_PY = str(resources.files("agentbox.guest").joinpath("probe.py"))


def run_probe(*args: str, config: dict[str, object] | None = None) -> Any:
    res = subprocess.run(
        [sys.executable, "-I", "-S", PROBE_PY, *args],
        input=json.dumps(config or {}).encode(),
        capture_output=True,
        timeout=120,
        check=True,
    )
    return json.loads(res.stdout)


def test_registry_has_at_least_40_probes_each_with_a_known_control() -> None:
    ids = [p.id for p in PROBES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 40
    assert {p.control for p in PROBES} <= {"weak", "tty", "fd", "stall", "kernel", "shared"}
    assert all(p.tried and p.expected for p in PROBES)


def test_inside_probe_ids_match_the_program() -> None:
    listed = set(run_probe("--list"))
    inside = {p.id for p in PROBES if p.where == "inside"}
    assert listed == inside


#: Probes that only read: safe to run on the host itself.
READ_ONLY = (
    "caps.effective,caps.bounding,privs.no_new_privs,privs.seccomp,identity.uid,"
    "identity.uid_map,dev.no_kvm,net.only_lo,kernel.kallsyms_addresses,token.env,"
    "image.no_su_sudo,fs.declared_mounts_only,limits.pids_visible"
)


def test_program_fires_on_the_unconfined_host() -> None:
    data = run_probe("--only", READ_ONLY, config={"runtime": "runc", "allowed_mounts": ["/"]})
    outcomes = {o.id: o for o in inside_outcomes(data) if o.status != "error" or o.seen}
    assert set(data["results"]) == set(READ_ONLY.split(","))
    assert not [o for o in outcomes.values() if o.id in data["results"] and o.status == "error"]
    if os.path.exists("/dev/kvm"):
        assert outcomes["dev.no_kvm"].status == "fail"
    if os.geteuid() == 0:
        # Root on the host: full capabilities, no seccomp, writable kernel knobs.
        assert outcomes["caps.effective"].status == "fail"
        assert outcomes["privs.seccomp"].status == "fail"
        assert outcomes["identity.uid"].status == "fail"
        assert outcomes["identity.uid_map"].status == "fail"


def test_only_runs_the_named_probes() -> None:
    data = run_probe("--only", "dev.no_kvm,net.only_lo")
    assert set(data["results"]) == {"dev.no_kvm", "net.only_lo"}  # type: ignore[arg-type]


def test_a_hanging_probe_is_killed_and_reported_not_passed() -> None:
    t0 = time.monotonic()
    res = probe.run_one("hang", lambda: time.sleep(30), 0.5)
    assert time.monotonic() - t0 < 5
    assert res["ok"] is False and "timed out" in res["seen"]


def test_a_crashing_probe_is_an_error_not_a_pass() -> None:
    def boom() -> dict[str, object]:
        raise RuntimeError("kaput")

    res = probe.run_one("boom", boom, 5)
    assert res["ok"] is False and res.get("error") and "kaput" in res["seen"]


def test_missing_answers_and_garbage_are_errors() -> None:
    outs = inside_outcomes({"results": {"caps.effective": "nonsense"}})
    assert {o.status for o in outs} == {"error"}
    assert len(outs) == sum(1 for p in PROBES if p.where == "inside")


def test_forkbomb_mode_reports_what_it_forked() -> None:
    data = run_probe("--forkbomb", "5", "--hold", "0.2")
    fb = data["forkbomb"]
    assert isinstance(fb, dict) and fb["forked"] == 5


def test_probe_source_is_stdlib_only() -> None:
    src = probe_program()
    allowed = {
        "ctypes", "errno", "fcntl", "json", "os", "re", "select", "signal", "socket",
        "stat", "sys", "time", "__future__", "collections", "typing", "contextlib",
    }  # fmt: skip
    imported = {
        line.split()[1].split(".")[0]
        for line in src.splitlines()
        if line.startswith(("import ", "from "))
    }
    assert imported <= allowed


def test_host_threads_are_read_and_our_namespaces_match() -> None:
    threads = read_threads([os.getpid()])
    assert threads and all(t.pid == os.getpid() for t in threads)
    assert namespace_differs(os.getpid(), "net")[0] is False


def test_latency_meter_notices_a_stall() -> None:
    assert stall_control().status == "pass"


def test_probe_source_fits_one_argv_string() -> None:
    # It travels as `python3 -c SOURCE`: Linux caps one argument at 128 KiB (MAX_ARG_STRLEN).
    assert len(probe_source().encode()) < 100 * 1024


def test_probe_source_fits_a_guest_exec_request_with_room() -> None:
    """A microVM runs it through its guest agent: the exec request, JSON, is one control
    message (wire.MAX_CTRL). The whole program no longer fit (61 KiB, escaped past 64)."""
    from agentbox.guest.wire import MAX_CTRL, encode_ctrl

    frame = encode_ctrl({"op": "exec", "argv": ["python3", "-I", "-S", "-c", probe_source()]})
    assert len(frame) < MAX_CTRL // 2
    assert len(probe_program()) > 40 * 1024  # the program itself is the big one


def test_the_packed_source_runs_the_program_as_main() -> None:
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe_source(), "--only", "fs.usr_readonly"],
        input=b"{}", capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.stdout.lstrip().startswith(b"{"), out.stderr[-500:]


def test_kernel_surface_probes_fire_on_the_unconfined_host() -> None:
    from agentbox.backends.oci._userns_limits import SANDBOX_CAPS

    ids = "net.socket_families,kernel.compat_syscalls,limits.userns_caps"
    data = run_probe("--only", ids, config={"runtime": "runc", "userns_caps": SANDBOX_CAPS})
    res = data["results"]
    # The host's user namespace is the top one: its counters are far above a sandbox's caps.
    assert res["limits.userns_caps"]["ok"] is False, res["limits.userns_caps"]
    if os.geteuid() == 0:
        # Root may open AF_PACKET at least (and AF_VSOCK where the module is loaded).
        assert res["net.socket_families"]["ok"] is False, res["net.socket_families"]
    if _ia32_emulation():
        # The host has no seccomp filter: the i386 entry answers.
        assert res["kernel.compat_syscalls"]["ok"] is False, res["kernel.compat_syscalls"]


def _ia32_emulation() -> bool:
    import gzip

    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            return "CONFIG_IA32_EMULATION=y" in f.read()
    except OSError:
        return False


def test_exhaust_mode_stops_at_the_hosts_bound() -> None:
    # A bound of 5 units: safe to run on the host (it spends 5 of root's counters briefly).
    for kind in ("inotify", "sigpending", "aio"):
        data = run_probe("--exhaust", kind, "--hold", "0", config={"exhaust_max": 5})
        got = data["exhaust"]
        assert got["kind"] == kind and got["took"] == 5 and got["errno"] == "", got
