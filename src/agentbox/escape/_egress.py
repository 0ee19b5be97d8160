"""The escape suite's egress probe: from inside a sandbox, ask the proxy for inner targets.

Part of the suite (it builds the suite's :class:`Outcome`), over the egress package's
facade: the proxy it tests never imports the suite that tests it.

The host starts a real proxy (:func:`spawn_proxy`, dropped like a task's) whose
allow-list names ``localhost`` and a cloud metadata name;
its socket appears in the sandbox's mounted gateway directory for the length of
the probe. Inside, a small standard-library client asks it for each target:
``CONNECT`` and plain ``GET`` to those names (which resolve to loopback, or to
a metadata address on a cloud host, or to nothing) and to loopback, metadata and
private IP literals.
The probe passes when every target that resolves was refused for its address
(``403``, ``ip-literal`` or ``address:<class>``); it fires when the proxy
connected, or tried to, to any of them. Its control is the same proxy with
``address_checks`` off, which must fire (``localhost`` then reaches host loopback).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox.config import Settings
from agentbox.egress import AllowRule, EgressLimits, EgressPolicy, spawn_proxy
from agentbox.errors import AgentboxError
from agentbox.escape._probeio import _Execs

if TYPE_CHECKING:
    from agentbox.escape import Outcome

PROBE_ID = "host.egress_proxy_inner"
_SOCKET = "egress-probe.sock"
_METADATA_NAME = "metadata.google.internal"

#: Runs inside the sandbox (``python3 -I -S -c``): standard library only.
CLIENT_SOURCE = r"""
import json, socket, sys
cfg = json.loads(sys.argv[1])
out = []
for method, target in cfg["targets"]:
    rec = {"method": method, "target": target, "status": None, "rule": None}
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(cfg["socket"])
        if method == "CONNECT":
            req = "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)
        else:
            req = "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % target
        s.sendall(req.encode())
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 65536:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
        s.close()
        lines = head.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
        parts = lines[0].split()
        rec["status"] = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "x-agentbox-egress":
                rec["rule"] = v.strip()[:64]
    except OSError as exc:
        rec["error"] = str(exc)[:200]
    out.append(rec)
print(json.dumps({"results": out}))
"""


def probe_policy(*, checked: bool = True) -> EgressPolicy:
    """The probe's proxy: ``localhost`` and a metadata name allowed."""
    rules = tuple(AllowRule(pattern=n, source="test") for n in ("localhost", _METADATA_NAME))
    limits = EgressLimits(connect_timeout=5.0, header_timeout=10.0, idle_timeout=10.0)
    return EgressPolicy(rules=rules, limits=limits, address_checks=checked)


def probe_targets() -> list[tuple[str, str]]:
    """(method, target) pairs the client inside asks for."""
    targets = [("CONNECT", f"{n}:443") for n in ("localhost", _METADATA_NAME)]
    targets += [
        ("GET", "http://localhost/"),
        ("GET", f"http://{_METADATA_NAME}/computeMetadata/v1/"),
    ]
    literals = ["127.0.0.1", "[::1]", "169.254.169.254", "[fd00:ec2::254]", "10.0.0.1",
                "192.168.0.1", "100.100.100.200", "2130706433"]  # fmt: skip
    targets += [("CONNECT", f"{a}:443") for a in literals]
    targets += [("GET", "http://169.254.169.254/latest/meta-data/")]
    return targets


def _verdict(results: list[dict[str, Any]]) -> tuple[str, str]:
    """(status, seen) from the client's results (untrusted: shape-checked)."""
    dicts = [r for r in results if isinstance(r, dict)]
    if (
        dicts
        and len(dicts) == len(results)
        and all("No such file" in str(r.get("error", "")) for r in dicts)
    ):
        return (
            "n/a",
            "the proxy's socket is not visible inside: this sandbox does not share its gateway dir",
        )
    held, skipped, fired, odd = [], [], [], []
    for rec in results[:64]:
        if not isinstance(rec, dict):
            odd.append("malformed result")
            continue
        target = str(rec.get("target"))[:80]
        rule, status = str(rec.get("rule")), rec.get("status")
        if status == 403 and (rule == "ip-literal" or rule.startswith("address:")):
            held.append(f"{target}={rule}")
        elif status == 502 and rule == "resolve":
            skipped.append(target)
        elif status == 200 or rule in ("connect", "upstream"):
            fired.append(f"{target} reached (status {status}, {rule})")
        else:
            odd.append(f"{target}: status {status} {rule} {str(rec.get('error', ''))[:60]}")
    if fired:
        return "fail", "; ".join(fired)
    if odd or not held:
        return "error", "; ".join(odd) or "no target was refused"
    note = f"; unresolvable: {', '.join(skipped)}" if skipped else ""
    return "pass", f"all refused: {', '.join(held)}{note}"


def egress_probe(
    box: _Execs,
    shared_dir: Path,
    inside_dir: str,
    *,
    socket_owner: int | None,
    run_as: tuple[int, int] | None,
    checked: bool = True,
    open_socket: bool = False,
) -> tuple[str, str]:
    """Run the probe against ``box``: (``pass``/``fail``/``error``, what was seen).

    ``shared_dir`` is a host directory the sandbox sees at ``inside_dir`` (the gateway
    dir); the probe's socket lives there only while it runs, owned by
    ``socket_owner`` (the sandbox's host uid), or mode 0666 with ``open_socket`` (as the
    suite's fixture makes its gateway socket: gVisor's gofer connects as another uid).
    ``checked=False`` is the control.
    """
    sock = shared_dir / _SOCKET
    logdir = Path(tempfile.mkdtemp(prefix="agentbox-egress-probe-"))
    try:
        with spawn_proxy(sock, probe_policy(checked=checked), logdir / "egress.log", run_as):
            if socket_owner is not None:
                os.chown(sock, socket_owner, socket_owner)
            if open_socket:
                sock.chmod(0o666)
            cfg = {"socket": f"{inside_dir}/{_SOCKET}", "targets": probe_targets()}
            res = box.exec(
                ["python3", "-I", "-S", "-c", CLIENT_SOURCE, json.dumps(cfg)], timeout=180
            )
        raw = res.stdout[-65536:].decode(errors="replace").strip().splitlines()
        try:
            data = json.loads(raw[-1]) if raw else None
        except ValueError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("results"), list):
            return "error", f"the client gave no results (exit {res.exit_code}): {raw[-1:]!r:.200}"
        return _verdict(data["results"])
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()


def suite_outcome(
    box: _Execs,
    gateway_dir: Path,
    *,
    settings: Settings | None = None,
    vm: bool = False,
    control: bool = False,
) -> Outcome:
    """The escape suite's :data:`PROBE_ID` outcome on ``box``, whose gateway dir is
    ``gateway_dir`` on the host. The proxy drops to the gateway's identity when
    ``settings`` are given and this runs as root. ``control``: the unchecked proxy (on
    the weak container). A microVM reaches host sockets over vsock, not a shared
    directory: n/a, said so."""
    from agentbox.backends.base import GATEWAY_DIR_IN_SANDBOX
    from agentbox.escape import PROBES, Outcome
    from agentbox.gateway import gateway_identity

    spec = next(p for p in PROBES if p.id == PROBE_ID)

    def done(status: str, seen: str) -> Outcome:
        return Outcome(spec.id, spec.where, spec.tried, spec.expected, seen[:400], status)  # type: ignore[arg-type]

    if vm:
        return done("n/a", "a microVM has no host socket directory to put the proxy's socket in")
    try:
        status, seen = egress_probe(
            box,
            gateway_dir,
            GATEWAY_DIR_IN_SANDBOX,
            socket_owner=None,
            run_as=gateway_identity(settings) if settings is not None else None,
            checked=not control,
            open_socket=True,
        )
    except AgentboxError as exc:
        status, seen = "error", f"the probe could not run: {exc}"
    return done(status, seen)
