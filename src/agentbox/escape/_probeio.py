"""The probe program's I/O: its source, how it runs in a sandbox, its JSON parsed defensively.

The JSON comes from the sandbox: only its last 4 MiB is read, and only a JSON
object line is taken from it.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Sequence
from importlib import resources
from typing import Any, Protocol

from agentbox.errors import SandboxError
from agentbox.escape._model import Outcome, ProbeSpec, Status
from agentbox.escape._registry import PROBES


def probe_program() -> str:
    """The in-sandbox probe program's source text (``agentbox/guest/probe.py``)."""
    return resources.files("agentbox.guest").joinpath("probe.py").read_text()


def probe_source() -> str:
    """The probe program as the argument of ``python3 -c``: compressed, then unpacked and
    run as ``__main__`` inside the sandbox (stdlib ``zlib`` and ``base64`` only).

    The whole program, JSON-escaped into a microVM guest's exec request, outgrew the guest
    channel's 64 KiB control message; compressed it is a quarter of that, on every backend.
    """
    blob = base64.b85encode(zlib.compress(probe_program().encode(), 9)).decode()
    return (
        "import base64,zlib;exec(compile(zlib.decompress(base64.b85decode("
        f"{blob!r})),'probe.py','exec'))"
    )


class _Execs(Protocol):
    def exec(
        self,
        argv: Sequence[str],
        *,
        env: Any = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        on_stdout: Any = None,
        on_stderr: Any = None,
    ) -> Any: ...


def _parse_json(raw: bytes, what: str) -> dict[str, Any]:
    """The last JSON object line of ``raw`` (untrusted: bounded, shape-checked)."""
    text = raw[-4 * 1024 * 1024 :].decode(errors="replace")
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict):
                return data
    raise SandboxError(f"{what}: no JSON in its output: {text[-300:]!r}")


def run_probe_program(
    box: _Execs, config: dict[str, object], args: Sequence[str] = (), timeout: float = 240.0
) -> dict[str, Any]:
    """Run the probe program in ``box`` with ``config`` on stdin; return its parsed JSON."""
    res = box.exec(
        ["python3", "-I", "-S", "-c", probe_source(), *args],
        stdin=json.dumps(config).encode(),
        timeout=timeout,
    )
    if getattr(res, "timed_out", False):
        raise SandboxError(f"the probe program timed out after {timeout:g}s")
    return _parse_json(res.stdout, f"probe program (exit {res.exit_code}, {res.stderr[-300:]!r})")


def _outcome(spec: ProbeSpec, status: Status, seen: str) -> Outcome:
    return Outcome(spec.id, spec.where, spec.tried, spec.expected, seen[:400], status)


def inside_outcomes(data: dict[str, Any], *, vm: bool = False) -> list[Outcome]:
    """Turn the probe program's JSON into outcomes; a probe it did not answer is an error.

    On a microVM (``vm``), probes of a shared kernel's surface are n/a: what they
    read is the guest's own kernel. What they saw is still reported.
    """
    results = data.get("results")
    results = results if isinstance(results, dict) else {}
    out = []
    for spec in PROBES:
        if spec.where != "inside":
            continue
        r = results.get(spec.id)
        if not isinstance(r, dict) or "ok" not in r:
            out.append(_outcome(spec, "error", "the probe program gave no answer"))
            continue
        ok, seen = r.get("ok"), str(r.get("seen", ""))
        status: Status = "n/a" if ok is None else "pass" if ok is True else "fail"
        if r.get("error"):
            status = "error"
        if vm and spec.applies == "container":
            status, seen = "n/a", f"microVM: the guest's own kernel (saw: {seen})"
        out.append(_outcome(spec, status, seen))
    return out
