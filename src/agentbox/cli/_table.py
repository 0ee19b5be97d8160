"""Tables that fit: never cut an id, drop or wrap other columns first, no padding on a pipe.

rich lays a table out to the console's width (80 when piped) by shrinking columns,
which can cut the one thing a user copies (a task id) to ``t-3f…``. Here the
columns that must stay whole are ``no_wrap`` and never dropped; when the table
cannot fit even with every other column wrapped to its longest word, the
optional columns are dropped, last first. On a pipe each line is written with
its trailing padding stripped, so ``agentbox tasks | grep`` sees what it expects;
a grid of labels and values (a task's report) is written there one row a line,
as wide as the row needs, never wrapped mid-phrase (``unwrapped``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

#: The narrowest a folding column (paths, free text) is allowed to get.
FOLD_MIN = 16


@dataclass(frozen=True)
class Col:
    """One column: ``keep`` columns are never dropped nor cut (ids, statuses)."""

    header: str
    keep: bool = False
    overflow: Literal["fold", "crop", "ellipsis", "ignore"] = "fold"
    ratio: int | None = None

    @property
    def no_wrap(self) -> bool:
        return self.keep


def fit_table(
    console: Console,
    cols: Sequence[Col],
    rows: Sequence[Sequence[RenderableType]],
    **table_kw: Any,
) -> Table:
    """The table for ``console``'s width: optional columns dropped right to left until it fits."""
    active = list(range(len(cols)))
    droppable = [i for i in reversed(range(len(cols))) if not cols[i].keep]
    while True:
        table = Table(**table_kw)
        for i in active:
            c = cols[i]
            table.add_column(
                c.header, no_wrap=c.no_wrap, overflow="ignore" if c.keep else c.overflow,
                ratio=c.ratio,
            )  # fmt: skip
        for row in rows:
            table.add_row(*(row[i] for i in active))
        shown = [[r[i] for i in active] for r in rows]
        least = _least_width(console, [cols[i] for i in active], shown)
        if not droppable or least <= console.width:
            return table
        active.remove(droppable.pop(0))


def _least_width(
    console: Console, cols: Sequence[Col], rows: Sequence[Sequence[RenderableType]]
) -> int:
    """The narrowest the table can be: kept columns whole, the others at their longest word."""
    options = console.options.update(width=1 << 20)  # measured unclamped
    total = 1  # the left border
    for i, c in enumerate(cols):
        cells: list[RenderableType] = [Text(c.header), *(r[i] for r in rows)]
        ms = [Measurement.get(console, options, _as_text(x)) for x in cells]
        widest = max((m.maximum if c.keep else m.minimum) for m in ms)
        if not c.keep and c.overflow == "fold":
            widest = min(widest, FOLD_MIN)  # a long path folds onto more lines
        total += widest + 3  # one space either side and the border
    return total


def _as_text(x: RenderableType) -> RenderableType:
    return Text(x) if isinstance(x, str) else x


def print_table(console: Console, table: RenderableType, *, unwrapped: bool = False) -> None:
    """Print ``table``: as laid out on a terminal; piped, with no trailing padding, and
    with ``unwrapped`` at the width its widest row needs (no cell wrapped)."""
    if console.is_terminal:
        console.print(table)
        return
    width = console.width
    if unwrapped:
        wide = console.options.update(width=UNWRAPPED)
        width = max(width, Measurement.get(console, wide, table).maximum)
    lines = console.render_lines(table, console.options.update(width=width), pad=False)
    out = "\n".join("".join(seg.text for seg in line).rstrip() for line in lines)
    target = console.file if console.file is not None else sys.stdout
    target.write(out + "\n")
    target.flush()


#: The width a piped table is measured in: as wide as any row may be.
UNWRAPPED = 1 << 16
