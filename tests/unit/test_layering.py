"""The import graph's layering rules, read from the source with ``ast``.

* ``collect`` never imports ``launcher`` (the report's token type lives below both,
  in :mod:`agentbox.core.wire`).
* No package imports another package's private (``_x``) module, at any depth
  (``agentbox.backends.docker._facility`` as much as ``agentbox.gateway._run``): it
  imports the package's facade (its ``__init__``) or a public module. The few edges
  still pending are listed with the reason, so the list can only shrink.
* ``backends/`` is by family: ``oci/`` (what podman and docker share), ``podman/``,
  ``docker/``, ``microvm/`` (the machinery) with ``microvm/qemu/`` and
  ``microvm/firecracker/``; a family imports only the root's shared modules, its own
  family's shared part, and nothing of a sibling; outside ``backends/`` only the root
  and the backends' facades are imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "agentbox"

#: (importing package, imported private module) edges not yet moved behind a facade.
#: Empty.
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


#: backends/ families: what each may import besides itself and the backends root.
FAMILIES: dict[str, set[str]] = {
    "oci": set(),
    "podman": {"oci"},
    "docker": {"oci"},
    "microvm": set(),
    "microvm/qemu": {"microvm"},
    # its sandbox is the qemu backend's live VM (QemuSandbox), another VMM below it
    "microvm/firecracker": {"microvm", "microvm/qemu"},
    # the workspace disk: a loop mount (oci._cli runs its tools) or a microVM data disk
    "root": {"oci", "microvm"},
}

#: Edges made for type annotations only (``if TYPE_CHECKING``): the shared part names the
#: sandbox class it serves.
TYPE_ONLY = {("oci", "podman"), ("microvm", "microvm/qemu")}


def _family_of_path(path: Path) -> str:
    rel = path.relative_to(SRC / "backends").parts
    if len(rel) == 1:
        return "root"
    if rel[0] == "microvm" and len(rel) > 2:
        return f"microvm/{rel[1]}"
    return rel[0]


def _family_of_module(mod: str) -> tuple[str, bool] | None:
    """The family ``mod`` belongs to, and whether ``mod`` is that family's facade."""
    parts = mod.split(".")
    if parts[:2] != ["agentbox", "backends"] or len(parts) < 3:
        return None
    if parts[2] in ("oci", "podman", "docker"):
        return parts[2], len(parts) == 3 or not parts[3].startswith("_")
    if parts[2] == "microvm":
        if len(parts) > 3 and parts[3] in ("qemu", "firecracker"):
            return f"microvm/{parts[3]}", len(parts) == 4 or not parts[4].startswith("_")
        return "microvm", len(parts) == 3 or not parts[3].startswith("_")
    return "root", True


def _family_edges() -> tuple[set[tuple[str, str]], set[tuple[str, str, str]]]:
    """(family, family) edges inside backends/; (package, family, module) from outside."""
    inside: set[tuple[str, str]] = set()
    outside: set[tuple[str, str, str]] = set()
    for path in SRC.rglob("*.py"):
        within = (SRC / "backends") in path.parents
        for mod in _imports(path):
            found = _family_of_module(mod)
            if found is None:
                continue
            fam, facade = found
            if within:
                src = _family_of_path(path)
                if fam != src:
                    inside.add((src, fam))
            elif not facade:
                outside.add((_package(path), fam, mod))
    return inside, outside


def test_backend_families_import_only_what_they_build_on() -> None:
    inside, _ = _family_edges()
    assert set(FAMILIES) >= {a for a, _ in inside} | {b for _, b in inside}
    bad = sorted(
        f"{a} imports {b}" for a, b in inside - TYPE_ONLY if b != "root" and b not in FAMILIES[a]
    )
    assert not bad, "backend families reaching sideways:\n" + "\n".join(bad)


def test_outside_backends_only_the_root_and_the_facades_are_imported() -> None:
    _, outside = _family_edges()
    bad = sorted(f"{p}: {m}" for p, fam, m in outside if p not in PENDING_PACKAGES)
    assert not bad, "backend internals imported from outside backends/:\n" + "\n".join(bad)
    # The families named are the tree's folders (a new folder needs a rule above).
    folders = {p.parent for p in (SRC / "backends").rglob("__init__.py")}
    named = {_family_of_path(f / "__init__.py") for f in folders if f != SRC / "backends"}
    assert named == set(FAMILIES) - {"root"}


def test_the_family_check_fires() -> None:
    """Positive control: a sideways edge and a private one from outside are seen."""
    assert _family_of_module("agentbox.backends.podman._pool") == ("podman", False)
    assert _family_of_module("agentbox.backends.microvm.qemu") == ("microvm/qemu", True)
    assert _family_of_module("agentbox.backends.microvm._disks") == ("microvm", False)
    assert _family_of_module("agentbox.backends.oci") == ("oci", True)
    assert _family_of_module("agentbox.backends._uidslots") == ("root", True)
    assert "docker" not in FAMILIES["podman"] and "oci" not in FAMILIES["microvm/qemu"]
