"""Tables that read in the terminal they are printed in (80 columns by default).

Rich shrinks a table wider than the terminal by wrapping at spaces; when even that cannot fit
(the columns' longest words add up to more than the width), it cuts every column to a few
letters ("pha…", "reg…"). `fit` swaps such a table for its vertical form: one block per row,
one line per column (`column  value`), under the same title and caption. A table that fits
once its words wrap, and a key-value table (two columns), keep their shape with every column
set to fold (a word longer than its column continues on the next line) instead of being cut.
"""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderableType
from rich.measure import Measurement
from rich.table import Table


def fits(table: Table, console: Console, options: ConsoleOptions | None = None) -> bool:
    """True when the table's narrowest layout (no word broken) fits the console's width."""
    options = options or console.options
    # Measured unbounded: rich clamps a table's measurement to the width it is given.
    unbounded = options.update_width(1 << 16)
    return Measurement.get(console, unbounded, table).minimum <= options.max_width


def vertical(table: Table) -> Table:
    """The table as one block per row: (column header, cell) lines, blocks separated."""
    out = Table(show_header=False, title=table.title, caption=table.caption, show_lines=False)
    out.add_column(style="bold")
    out.add_column(overflow="fold")
    columns = table.columns
    rows = table.row_count
    for i in range(rows):
        for j, column in enumerate(columns):
            cells = list(column.cells)
            value = cells[i] if i < len(cells) else ""
            out.add_row(column.header, value, end_section=(j == len(columns) - 1 and i < rows - 1))
    return out


def fit(renderable: RenderableType, console: Console) -> RenderableType:
    """`renderable`, or, for a table that would be cut: a key-value table (two columns) with
    its long values folded onto more lines, any other in its vertical form."""
    if not isinstance(renderable, Table) or renderable.row_count == 0:
        return renderable
    if len(renderable.columns) <= 2 or fits(renderable, console):
        # Rich's squeeze may still cut a column below its longest word: fold it instead.
        for column in renderable.columns:
            column.overflow = "fold"
        return renderable
    return vertical(renderable)


class FittingConsole(Console):
    """A `Console` whose `print` folds tables that would not fit (see module docstring)."""

    def print(self, *objects, **kwargs) -> None:  # noqa: ANN001, ANN003 - Console.print's
        super().print(*(fit(o, self) for o in objects), **kwargs)
