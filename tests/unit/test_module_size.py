"""A backstop, not a target: no module in src/ passes 900 lines.

The rule is cohesion (docs/explanation/architecture.md, "Module size"): a module does
one job and is the size that job is. A cap near the typical size made modules split at
the line count instead of at their seams (re-export chains, free functions taking
``backend`` first); this limit only catches a module that has plainly become two.
"""

from __future__ import annotations

from pathlib import Path

import agentbox

SRC = Path(agentbox.__file__).parent
MAX_LINES = 900

#: Exempt for good: one module by design.
EXEMPT = {
    # The in-sandbox probe program: sent whole as ``python3 -c`` into every
    # backend, so it must be one self-contained file.
    "guest/probe.py",
}


def _sizes() -> dict[str, int]:
    return {
        p.relative_to(SRC).as_posix(): len(p.read_bytes().splitlines())
        for p in sorted(SRC.rglob("*.py"))
    }


def test_no_module_past_the_backstop() -> None:
    over = {rel: n for rel, n in _sizes().items() if n > MAX_LINES and rel not in EXEMPT}
    assert not over, f"modules over {MAX_LINES} lines (each does several jobs): {over}"


def test_the_exempt_modules_exist() -> None:
    assert all(rel in _sizes() for rel in EXEMPT)
