"""The import graph's layering rules, read from the source with ``ast``.

* ``collect`` never imports ``launcher`` (the report's token type lives below both,
  in :mod:`agentbox.core.wire`).
* No package imports another package's private (``_x``) module, at any depth
  (``agentbox.backends.docker._facility`` as much as ``agentbox.gateway._run``): it
  imports the package's facade (its ``__init__``) or a public module. The few edges
  still pending are listed with the reason, so the list can only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "agentbox"

#: (importing package, imported private module) edges not yet moved behind a facade.
#: Empty: the microVM backends import agentbox.backends.microvm's facade, the CLI image's.
PENDING: set[tuple[str, str]] = set()


#: Packages still being written, whose edges are pending until they land: the egress
#: proxy reuses the gateway's confinement (``gateway._confine``, ``_run``, ``_serve``); the
#: setup phase (env/) reads podman's image facts (``agentbox.backends.podman.image_facts``).
PENDING_PACKAGES = {"egress", "env"}


def _package(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def _edges() -> set[tuple[str, str, str]]:
    edges = set()
    for path in SRC.rglob("*.py"):
        pkg = _package(path)
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] != "agentbox" or len(parts) < 3:
                continue
            edges.add((pkg, mod, path.relative_to(SRC).as_posix()))
    return edges


def test_collect_never_imports_the_launcher() -> None:
    bad = [(f, m) for p, m, f in _edges() if p == "collect" and m.startswith("agentbox.launcher")]
    assert not bad


def _private(mod: str) -> str | None:
    """The first private component of ``mod`` below its package, as a module path."""
    parts = mod.split(".")
    for i in range(2, len(parts)):
        if parts[i].startswith("_") and not parts[i].startswith("__"):
            return ".".join(parts[: i + 1])
    return None


def _violations(edges: set[tuple[str, str, str]]) -> list[str]:
    bad = []
    for pkg, mod, where in sorted(edges):
        private = _private(mod)
        if mod.split(".")[1] == pkg or private is None:
            continue
        if (pkg, private) in PENDING or pkg in PENDING_PACKAGES:
            continue
        bad.append(f"{where}: {mod}")
    return bad


def test_no_package_imports_another_packages_private_module() -> None:
    bad = _violations(_edges())
    assert not bad, "private modules of another package imported:\n" + "\n".join(bad)


def test_the_check_sees_private_modules_at_any_depth() -> None:
    """Positive control: a deep private module, a private name imported from a package
    (``from agentbox.gateway import _run``), and the same package's own are told apart."""
    edges = {
        ("cli", "agentbox.backends.docker._facility.doctor_rows", "cli/_doctor.py"),
        ("launcher", "agentbox.gateway._run", "launcher/x.py"),
        ("backends", "agentbox.backends.podman._backend", "backends/podman/__init__.py"),
        ("cli", "agentbox.backends.docker.doctor_rows", "cli/_doctor.py"),
    }
    assert _violations(edges) == [
        "cli/_doctor.py: agentbox.backends.docker._facility.doctor_rows",
        "launcher/x.py: agentbox.gateway._run",
    ]


#: At the package root: the public surface only (``__init__``, ``__main__``, ``errors``,
#: ``config``, ``sandbox``, ``smoke``); everything else lives in a package named by purpose.
ROOT_MODULES_MAX = 10

#: The floors everything stands on, and the only packages each may import.
FLOORS = {"core": {"errors"}, "linux": {"core", "errors"}}


def test_the_package_root_holds_only_the_public_surface() -> None:
    mods = sorted(p.name for p in SRC.glob("*.py"))
    assert len(mods) <= ROOT_MODULES_MAX, f"{len(mods)} modules at the root: {mods}"
    assert not [m for m in mods if m.startswith("_") and not m.startswith("__")], mods


def test_core_and_linux_stand_on_nothing_above_them() -> None:
    graph = _package_graph()
    for floor, allowed in FLOORS.items():
        assert (SRC / floor / "__init__.py").is_file(), floor
        above = graph.get(floor, set()) - allowed
        assert not above, f"{floor} imports {sorted(above)}: it is a floor, move that code up"


def test_pending_edges_still_exist() -> None:
    """An edge removed from the code must leave the list too."""
    now = {(p, _private(m)) for p, m, _ in _edges()}
    assert now >= PENDING, sorted(PENDING - now)


def _package_graph() -> dict[str, set[str]]:
    """Package (or top-level module) → the others it imports, lazily imported ones too."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        pkg = _package(path)
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] == "agentbox" and len(parts) >= 2 and parts[1] not in (pkg, "__init__"):
                graph.setdefault(pkg, set()).add(parts[1])
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle between packages, as a path (empty: the graph is layered)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_packages_are_layered_with_no_import_cycle() -> None:
    """Every import between packages points down a layer order (an edge up would close a
    cycle), counting imports made inside functions: the microVM machinery never imports
    the backends, the image build asks no backend, the egress proxy never the escape suite."""
    cycle = _cycle(_package_graph())
    assert not cycle, "packages import each other: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle() -> None:
    """Positive control: an edge back up is found, as the path around it."""
    graph = {"cli": {"launcher"}, "launcher": {"backends"}, "backends": {"image"}}
    assert _cycle(graph) == []
    graph["image"] = {"backends"}
    assert _cycle(graph) == ["backends", "image", "backends"]
