"""What ``tests/conftest.py`` runs alone (``serial``) names tests that exist, and every test
that calls a backend's host-wide ``cleanup_orphans`` is among them.

The serial pass of ``scripts/test.sh`` is decided test by test: a renamed test would
silently leave the serial pass and race the xdist workers, and a new call of the
host-wide podman or docker sweep on a worker would take what another worker's test is
recovering.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

#: ``cleanup_orphans`` calls that sweep only their own data dir (a microVM backend's).
PER_DATA_DIR = {"integration/test_qemu_backend.py::test_cleanup_orphans_ignores_live_owners"}


def _literal(name: str) -> object:
    tree = ast.parse((TESTS / "conftest.py").read_text())
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == name and node.value is not None:  # type: ignore[union-attr]
            return ast.literal_eval(node.value)  # type: ignore[union-attr]
    raise AssertionError(f"{name} not found in tests/conftest.py")


def _functions(rel: str) -> set[str]:
    tree = ast.parse((TESTS / rel).read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def test_every_serial_and_heaviest_entry_names_a_module_or_test_that_exists() -> None:
    serial = _literal("SERIAL")
    tests = _literal("SERIAL_TESTS")
    heaviest = _literal("HEAVIEST")
    assert isinstance(serial, set) and isinstance(tests, set) and isinstance(heaviest, tuple)
    missing = [rel for rel in [*serial, *heaviest] if not (TESTS / rel).is_file()]
    for entry in tests:
        rel, _, func = entry.partition("::")
        if not (TESTS / rel).is_file() or func not in _functions(rel):
            missing.append(entry)
    assert not missing, missing


def test_every_host_wide_orphan_sweep_runs_serially() -> None:
    serial = _literal("SERIAL")
    dirs = _literal("SERIAL_DIRS")
    tests = _literal("SERIAL_TESTS")
    assert isinstance(serial, set) and isinstance(dirs, tuple) and isinstance(tests, set)
    loose = []
    for path in sorted(TESTS.glob("*/test_*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel.startswith(("unit/", *dirs)) or rel in serial:
            continue
        source = path.read_text()
        for node in ast.parse(source).body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            text = ast.get_source_segment(source, node) or ""
            entry = f"{rel}::{node.name}"
            if re.search(r"\.cleanup_orphans\(", text) and entry not in tests | PER_DATA_DIR:
                loose.append(entry)
    assert not loose, f"host-wide cleanup_orphans outside the serial pass: {loose}"
