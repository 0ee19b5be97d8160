"""No backend-name switch outside ``agentbox.backends`` (issue 14).

A caller asks a backend's traits (``kind``, ``runtimes``, ``shares_host_kernel``,
``detaches``, …) and calls its verbs; it never compares a backend's or an OCI
runtime's name, so a new backend touches ``backends/`` and one registry line. Read
from the source with ``ast``: a comparison (``==``, ``!=``, ``in``, ``match``), a
``startswith``/``endswith`` or a dict keyed on such a name is a switch. Naming one as
a value (a default, an argv, a registry lookup) is not.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from agentbox.backends import BACKENDS
from agentbox.config import Runtime

SRC = Path(__file__).resolve().parents[2] / "src" / "agentbox"

#: Every backend and OCI runtime name there is.
NAMES = frozenset(BACKENDS) | frozenset(get_args(Runtime))

#: Switches outside backends/ that stay, each with why (this may only shrink).
ALLOWED = {
    # The host's facility table for the doctor and the test markers: which package
    # installs a runtime's binary, and crun's known refusal of a hybrid cgroup host.
    # It answers "is this tool usable here", it chooses no behaviour of a sandbox.
    "core/host.py",
}


def _is_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def _names_in(node: ast.AST) -> bool:
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_is_name(e) for e in node.elts)
    return _is_name(node)


def switches(source: str) -> list[tuple[int, str]]:
    """(line, what) for each backend-name switch in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_in(s) for s in sides):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.match_case):
            if any(_is_name(n) for n in ast.walk(node.pattern) if isinstance(n, ast.Constant)):
                found.append((node.pattern.lineno, ast.unparse(node.pattern)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("startswith", "endswith") and any(
                _names_in(a) for a in node.args
            ):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Dict) and any(k is not None and _is_name(k) for k in node.keys):
            found.append((node.lineno, ast.unparse(node)[:80]))
    return found


def test_no_backend_name_is_switched_on_outside_backends() -> None:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("backends/") or rel in ALLOWED:
            continue
        bad += [f"{rel}:{line}: {what}" for line, what in switches(path.read_text())]
    assert not bad, "backend names switched on outside backends/ (ask a trait):\n" + "\n".join(bad)


def test_allowed_files_still_switch() -> None:
    """A file that stopped switching leaves the list too."""
    assert all(switches((SRC / rel).read_text()) for rel in ALLOWED)


def test_the_check_fires_on_each_kind_of_switch() -> None:
    """Positive control: each form is caught; a name used as a value is not."""
    src = """
if box.backend == "qemu": pass
if runtime != "runsc": pass
if name in ("runc", "crun"): pass
if name.startswith("firecracker"): pass
pkg = {"runsc": "gvisor"}.get(runtime)
match backend:
    case "docker": pass
"""
    assert sorted(line for line, _ in switches(src)) == [2, 3, 4, 5, 6, 8]
    assert switches('get_backend("podman", s)\nrt = "runc"\nargv = ["podman", "ps"]\n') == []
