"""``agentbox smoke``: check a live sandbox the way the seed's ``smoke-test.sh`` does.

A fresh sandbox is created with the agent's layout (a workspace owned by the
sandbox identity and a gateway socket dir), its posture is read
(:meth:`Sandbox.posture`: inside and from the host), and behavioural probes run
inside it as the sandbox uid:

* no package manager, ``su`` or ``sudo`` on disk; no setuid or setgid file;
* writing to ``/usr`` fails;
* no docker, podman or containerd socket;
* DNS resolution and an HTTPS connection both fail.

The result is a :class:`~agentbox.backends.base.Posture`; it is ``ok`` only when
every check passed. It works for any backend whose image has ``python3``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from agentbox.backends import get_backend
from agentbox.backends.base import Posture, PostureCheck, Sandbox
from agentbox.boxfile import Boxfile
from agentbox.config import Settings
from agentbox.sandbox import spec_from_boxfile

__all__ = ["BEHAVIOUR_PROBE", "behaviour_checks", "render", "run_smoke"]

#: Runs inside the sandbox; prints one JSON object of facts (untrusted, only compared).
BEHAVIOUR_PROBE = r"""
import json, os, socket, stat
out = {}
dirs = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
names = ["apt", "apt-get", "dpkg", "apk", "yum", "dnf", "rpm", "su", "sudo", "doas"]
out["tools"] = sorted({n for d in dirs for n in names if os.path.lexists(os.path.join(d, n))})
setid = []
root_dev = os.lstat("/").st_dev
for top, subdirs, files in os.walk("/"):
    keep = []
    for s in subdirs:
        p = os.path.join(top, s)
        try:
            if os.lstat(p).st_dev == root_dev:
                keep.append(s)
        except OSError:
            pass
    subdirs[:] = keep
    for f in files:
        p = os.path.join(top, f)
        try:
            m = os.lstat(p).st_mode
        except OSError:
            continue
        if stat.S_ISREG(m) and m & (stat.S_ISUID | stat.S_ISGID):
            setid.append(p)
out["setid"] = setid[:50]
try:
    with open("/usr/.agentbox-smoke", "w") as f:
        f.write("x")
    out["usr_write"] = "written"
except OSError as e:
    out["usr_write"] = e.strerror or "refused"
socks = ["/var/run/docker.sock", "/run/docker.sock", "/run/podman/podman.sock",
         "/var/run/podman/podman.sock", "/run/containerd/containerd.sock",
         "/run/user/0/podman/podman.sock"]
out["sockets"] = [s for s in socks if os.path.lexists(s)]
try:
    socket.getaddrinfo("example.com", 443)
    out["dns"] = "resolved"
except OSError as e:
    out["dns"] = type(e).__name__
try:
    socket.create_connection(("1.1.1.1", 443), timeout=3).close()
    out["https"] = "connected"
except OSError as e:
    out["https"] = e.strerror or type(e).__name__
print(json.dumps(out))
"""


def behaviour_checks(box: Sandbox) -> list[PostureCheck]:
    """Run :data:`BEHAVIOUR_PROBE` in ``box`` and turn its facts into checks."""
    res = box.exec(["python3", "-I", "-S", "-c", BEHAVIOUR_PROBE], timeout=120)
    try:
        data: Any = json.loads(res.stdout) if len(res.stdout) < 1_000_000 else None
    except json.JSONDecodeError:
        data = None
    if res.exit_code != 0 or not isinstance(data, dict):
        tail = res.stderr.decode(errors="replace")[-300:]
        return [PostureCheck("behaviour probe", "ran", f"exit {res.exit_code}: {tail}", False)]

    def check(name: str, expected: str, seen: object, ok: bool) -> PostureCheck:
        return PostureCheck(name, expected, str(seen), ok)

    tools, setid, socks = data.get("tools"), data.get("setid"), data.get("sockets")
    usr, dns, https = data.get("usr_write"), data.get("dns"), data.get("https")
    return [
        check("no package manager, su, sudo", "[]", tools, tools == []),
        check("no setuid/setgid files", "[]", setid, setid == []),
        check("writing to /usr fails", "refused", usr, isinstance(usr, str) and usr != "written"),
        check("no docker/podman socket", "[]", socks, socks == []),
        check("DNS fails", "error", dns, isinstance(dns, str) and dns != "resolved"),
        check("HTTPS fails", "error", https, isinstance(https, str) and https != "connected"),
    ]


def run_smoke(
    settings: Settings, *, backend: str | None = None, runtime: str | None = None
) -> Posture:
    """Create a sandbox with the agent's layout, read its posture, probe it, destroy it."""
    fields: dict[str, Any] = {"deadline": 300}
    if backend is not None:
        fields["backend"] = backend
    if runtime is not None:
        fields["runtime"] = runtime
    boxfile = Boxfile.from_dict(fields, settings=settings)
    be = get_backend(boxfile.backend, settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="smoke-", dir=settings.data_dir))
    tmp.chmod(0o711)  # runsc's gofer must traverse it
    try:
        ws, gw = tmp / "workspace", tmp / "gw"
        ws.mkdir()
        gw.mkdir()
        if os.geteuid() == 0:
            os.chown(ws, settings.sandbox_host_uid, settings.sandbox_host_uid)
        spec = spec_from_boxfile(boxfile, settings, workspace=ws, gateway_dir=gw)
        be.check(spec)
        with be.create(spec) as box:
            posture = box.posture()
            extra = behaviour_checks(box)
        return Posture(posture.backend, posture.runtime, posture.checks + tuple(extra))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def render(posture: Posture) -> Any:
    """A rich Table of the posture's checks (imported lazily: rich is CLI-only)."""
    from rich.table import Table

    verdict = "[green]PASS[/green]" if posture.ok else "[red]FAIL[/red]"
    table = Table(title=f"{posture.backend} / {posture.runtime}: {verdict}")
    for col in ("", "where", "check", "expected", "seen"):
        table.add_column(col, overflow="fold")
    for c in posture.checks:
        mark = "[green]ok[/green]" if c.ok else "[red]FAIL[/red]"
        table.add_row(mark, c.where, c.name, c.expected, c.seen)
    return table
