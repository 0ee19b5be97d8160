"""Private modules (``_x.py``, or any module below a ``_x`` package) carry no ``__all__``:
a package's facade (its ``__init__``) is the one place that gathers names, and a private
module that lists names for others invites re-export chains (a name imported from a
module that only passes it on). Read from the source with ``ast``.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "agentbox"


def _private(rel: Path) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in rel.with_suffix("").parts)


def _declares_all(text: str) -> bool:
    for node in ast.parse(text).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign | ast.AugAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def test_no_private_module_declares_all() -> None:
    found = [
        rel.as_posix()
        for path in sorted(SRC.rglob("*.py"))
        if _private(rel := path.relative_to(SRC)) and _declares_all(path.read_text())
    ]
    assert not found, "private modules with __all__ (import from the defining module):\n" + (
        "\n".join(found)
    )


def test_the_check_tells_private_modules_and_sees_all() -> None:
    """Positive control: what counts as private, and each spelling of ``__all__``."""
    assert _private(Path("gateway/_run.py")) and _private(Path("backends/_x/mod.py"))
    assert not _private(Path("backends/__init__.py")) and not _private(Path("sandbox.py"))
    assert _declares_all('__all__ = ["a"]\n')
    assert _declares_all('__all__: list[str] = ["a"]\n')
    assert _declares_all('__all__ += ["a"]\n')
    assert not _declares_all("x = 1\n")
