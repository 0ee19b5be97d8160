"""The escape suite's secret probe: a brokered secret is nowhere in the sandbox.

The host plants a fresh random secret in a secret store of its own (a temporary data
dir), resolves it for a rule that injects it (``Authorization: Bearer
${secret:ABX_ESCAPE_PROBE}`` for ``secret-probe.invalid``) exactly as a task's are
resolved, and starts a real egress proxy holding it, its socket in the sandbox's
gateway dir. Inside, a standard-library program asks the proxy for the rule's host
(``CONNECT``, then TLS and ``GET``; and a plain ``GET`` carrying the placeholder),
and looks for the value in every answer, in its own and every visible process's
environment and command line (``/proc/*/environ``, ``/proc/*/cmdline``), and in every
file under the sandbox's mounts and ``/etc``, ``/tmp``, ``/home``, ``/root``, ``/run``.

The sandbox is never given the value: it gets a 6-character prefix and the SHA-256 of
the whole value, and hashes each window that starts with the prefix. The probe fails
when a window matches (naming where); it passes when the search ran and found nothing.

Its control (on the weak container) plants the value where a careless broker would:
a file in the mounted gateway dir and the environment of a process in the sandbox;
the probe must find it there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentbox.config import Settings
from agentbox.errors import AgentboxError
from agentbox.escape._probeio import _Execs

if TYPE_CHECKING:
    from agentbox.escape import Outcome

PROBE_ID = "host.secret_not_in_sandbox"
SECRET_NAME = "ABX_ESCAPE_PROBE"  # noqa: S105 (a name; its value is made per run)
RULE_HOST = "secret-probe.invalid"
_SOCKET = "secret-probe.sock"
_PLANTED = "planted-broker.env"

#: Runs inside the sandbox (``python3 -I -S -c``): standard library only.
CLIENT_SOURCE = r"""
import hashlib, json, os, socket, stat, sys
cfg = json.loads(sys.argv[1])
prefix, digest, length = cfg["prefix"].encode(), cfg["sha256"], cfg["length"]
found, answers, scanned = [], [], {"files": 0, "bytes": 0, "procs": 0}
BUDGET, PER_FILE = 256 << 20, 8 << 20

def hit(data):
    i = data.find(prefix)
    while i >= 0:
        if hashlib.sha256(data[i:i + length]).hexdigest() == digest:
            return True
        i = data.find(prefix, i + 1)
    return False

def note(where, data):
    if hit(data) and len(found) < 32:
        found.append(where)

# 1. the proxy's answers for the rule's host
def ask(raw, tls_host=None):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(cfg["socket"])
    if tls_host:
        s.sendall(b"CONNECT %s:443 HTTP/1.1\r\nHost: %s:443\r\n\r\n" % (tls_host, tls_host))
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 65536:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
        note("proxy CONNECT answer", head)
        if not head.split(b"\r\n")[0].split(b" ")[1:2] == [b"200"]:
            return head
        import ssl
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        s = ctx.wrap_socket(s, server_hostname=tls_host.decode())
    s.sendall(raw)
    out = b""
    while len(out) < (1 << 20):
        try:
            chunk = s.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    s.close()
    return out

req = ("GET /simple/ HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer agentbox-brokered\r\n"
       "Connection: close\r\n\r\n" % cfg["host"]).encode()
plain = req.replace(b"GET /simple/", b"GET http://%s/simple/" % cfg["host"].encode(), 1)
for what, args in (("TLS", (req, cfg["host"].encode())), ("plain", (plain,))):
    try:
        got = ask(*args)
        answers.append("%s: %s" % (what, got.split(b"\r\n")[0].decode("latin-1")[:60]))
        note("proxy %s answer" % what, got)
    except Exception as exc:
        answers.append("%s: %s" % (what, str(exc)[:80]))

# 2. every visible process's environment and command line
note("own environment", b"\0".join(k + b"=" + v for k, v in os.environb.items()))
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    scanned["procs"] += 1
    for part in ("environ", "cmdline"):
        try:
            with open("/proc/%s/%s" % (pid, part), "rb") as fh:
                note("/proc/%s/%s" % (pid, part), fh.read(1 << 20))
        except OSError:
            pass

# 3. files: the sandbox's mounts (not the image's root) and the usual writable places
SKIP = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "devtmpfs", "securityfs",
        "debugfs", "tracefs", "bpf", "fusectl", "configfs", "pstore", "hugetlbfs", "binfmt_misc"}
roots = {"/etc", "/tmp", "/home", "/root", "/run", "/var/tmp", "/workspace"}
try:
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            point, fstype = left.split()[4], (right.split() or ["?"])[0]
            system = point == "/" or point.startswith(("/proc", "/sys", "/dev"))
            if fstype not in SKIP and not system:
                roots.add(point.replace("\\040", " "))
except OSError:
    pass
seen = set()
for root in sorted(roots):
    for top, dirs, files in os.walk(root, onerror=lambda e: None):
        if top.startswith(("/proc", "/sys", "/dev")):
            dirs[:] = []
            continue
        for name in files:
            p = os.path.join(top, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            if scanned["bytes"] >= BUDGET:
                break
            try:
                with open(p, "rb") as fh:
                    data = fh.read(PER_FILE)
            except OSError:
                continue
            scanned["files"] += 1
            scanned["bytes"] += len(data)
            note(p, data)
print(json.dumps({"found": found, "answers": answers, "scanned": scanned,
                  "roots": sorted(roots)[:40]}))
"""


def _config(value: str, socket_path: str) -> dict[str, Any]:
    return {
        "prefix": value[:6],
        "sha256": hashlib.sha256(value.encode()).hexdigest(),
        "length": len(value.encode()),
        "socket": socket_path,
        "host": RULE_HOST,
    }


def _verdict(data: Any) -> tuple[str, str]:
    """(status, seen) from the program's answer (untrusted: shape-checked)."""
    if not isinstance(data, dict) or not isinstance(data.get("found"), list):
        return "error", "the program gave no result"
    found = [str(f)[:80] for f in data["found"][:8]]
    got = data.get("scanned")
    scanned: dict[str, Any] = got if isinstance(got, dict) else {}
    said = data.get("answers")
    answers = [str(a)[:80] for a in said[:2]] if isinstance(said, list) else []
    summary = (
        f"searched {scanned.get('files', 0)} files ({scanned.get('bytes', 0)} bytes), "
        f"{scanned.get('procs', 0)} processes; proxy: {'; '.join(answers)}"
    )
    if found:
        return "fail", f"the secret is in the sandbox: {', '.join(found)}; {summary}"
    if not any("HTTP/" in a for a in answers):
        summary += " (no proxy answer to check)"
    if not scanned.get("files") or not scanned.get("procs"):
        return "error", f"the search did not run: {summary}"
    if answers and all("No such file" in a for a in answers):
        return (
            "n/a",
            "the proxy's socket is not visible inside: this sandbox does not share its gateway dir",
        )
    return "pass", f"not found; {summary}"


def secret_probe(
    box: _Execs,
    shared_dir: Path,
    inside_dir: str,
    *,
    run_as: tuple[int, int] | None,
    plant: Any = None,
) -> tuple[str, str]:
    """Run the probe against ``box``: (``pass``/``fail``/``error``/``n/a``, what was seen).

    ``shared_dir`` is the host dir the sandbox sees at ``inside_dir`` (the gateway dir).
    ``plant(value)``, for the control, puts the value where a careless broker would,
    before the search.
    """
    from agentbox.egress import EgressLimits, EgressPolicy, spawn_proxy
    from agentbox.egress.rules import Inject, NetworkRule
    from agentbox.secrets import SecretStore, resolve_for_task

    value = "abx-" + secrets.token_urlsafe(30)
    work = Path(tempfile.mkdtemp(prefix="agentbox-secret-probe-"))
    sock = shared_dir / _SOCKET
    try:
        store_settings = Settings(data_dir=work / "data")
        SecretStore(store_settings).set(SECRET_NAME, value, 0)
        rule = NetworkRule(
            host=RULE_HOST,
            methods=("GET", "HEAD"),
            paths=("/*",),
            inject=Inject("Authorization", f"Bearer ${{secret:{SECRET_NAME}}}"),
            origin="test",
        )
        assert rule.inject is not None
        values = resolve_for_task(store_settings, 0, [rule.inject.value])
        limits = EgressLimits(connect_timeout=5.0, header_timeout=10.0, idle_timeout=10.0)
        policy = EgressPolicy(rules=(), limits=limits)
        with spawn_proxy(sock, policy, work / "egress.log", run_as, rules=[rule],
                         secret_values=values):  # fmt: skip
            sock.chmod(
                0o666
            )  # as the suite's gateway socket: gVisor's gofer connects as another uid
            if plant is not None:
                plant(value)
            cfg = _config(value, f"{inside_dir}/{_SOCKET}")
            res = box.exec(["python3", "-I", "-S", "-c", CLIENT_SOURCE, json.dumps(cfg)],
                           timeout=300)  # fmt: skip
        raw = res.stdout[-65536:].decode(errors="replace").strip().splitlines()
        try:
            data = json.loads(raw[-1]) if raw else None
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return "error", f"the program gave no result (exit {res.exit_code}): {raw[-1:]!r:.200}"
        return _verdict(data)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        with contextlib.suppress(FileNotFoundError):
            (shared_dir / _PLANTED).unlink()


def _weak_plant(box: Any, shared_dir: Path) -> Any:
    """The control's planting: a file in the mounted gateway dir, and a process in the
    weak container whose environment holds the value (``podman exec -d -e``)."""

    def plant(value: str) -> None:
        (shared_dir / _PLANTED).write_text(f"TOKEN={value}\n")
        name = getattr(box, "name", None)
        if name:
            subprocess.run(
                ["podman", "exec", "-d", "-e", f"ABX_PLANTED_TOKEN={value}", name, "sleep", "120"],
                capture_output=True, timeout=60, check=False,
            )  # fmt: skip

    return plant


def suite_outcome(
    box: _Execs,
    gateway_dir: Path,
    *,
    settings: Settings | None = None,
    vm: bool = False,
    control: bool = False,
) -> Outcome:
    """The escape suite's :data:`PROBE_ID` outcome on ``box`` (gateway dir ``gateway_dir``
    on the host). ``control``: plant the value in the (weak) sandbox first. A microVM
    reaches host sockets over vsock, not a shared directory: n/a, said so."""
    from agentbox.backends.base import GATEWAY_DIR_IN_SANDBOX
    from agentbox.escape import PROBES, Outcome
    from agentbox.gateway import gateway_identity

    spec = next(p for p in PROBES if p.id == PROBE_ID)

    def done(status: str, seen: str) -> Outcome:
        return Outcome(spec.id, spec.where, spec.tried, spec.expected, seen[:400], status)  # type: ignore[arg-type]

    if vm:
        return done("n/a", "a microVM has no host socket directory to put the proxy's socket in")
    run_as = gateway_identity(settings) if settings is not None and os.geteuid() == 0 else None
    try:
        status, seen = secret_probe(
            box, gateway_dir, GATEWAY_DIR_IN_SANDBOX, run_as=run_as,
            plant=_weak_plant(box, gateway_dir) if control else None,
        )  # fmt: skip
    except AgentboxError as exc:
        status, seen = "error", f"the probe could not run: {exc}"
    if control and status == "error":
        # Only finding the planted value counts as firing: a control that could not
        # search (a dead container) must not pass as one that found it.
        status, seen = "pass", f"the control found nothing it could trust: {seen}"
    return done(status, seen)
