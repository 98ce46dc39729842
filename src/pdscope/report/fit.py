"""Tables that fit the terminal without shortening a number or a flag.

rich shrinks a table that is wider than the terminal by cutting cells to "14.…" or
"--max-num-batched-toke…". A figure with its end cut off is worse than no figure, so a table of
figures drops whole columns instead (rightmost first, saying which), and a table of prose wraps
at spaces and, for a word longer than its column, folds it onto the next line.
"""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


def fit_figures(table: Table, console: Console, keep: int = 1) -> RenderableType:
    """``table`` with no cell ever shortened: while it is wider than the terminal, drop its
    rightmost column (never the first ``keep``), and say below it which were left out."""
    for column in table.columns:
        column.no_wrap = True
        column.overflow = "fold"  # only reached if even the kept columns cannot fit
    dropped: list[str] = []
    while len(table.columns) > keep and _width(table, console) > console.width:
        dropped.append(str(table.columns.pop().header))
    if not dropped:
        return table
    note = Text(
        f"(left out to fit {console.width} columns: {', '.join(reversed(dropped))}; "
        "a wider terminal or the JSON output has them)",
        style="dim",
    )
    return Group(table, note)


def fit_prose(table: Table, console: Console) -> Table:
    """``table`` whose cells wrap at spaces, each column at least as wide as its longest word
    (a flag is one word) where the terminal allows; a word wider than that folds onto the next
    line rather than lose its end."""
    for column in table.columns:
        column.overflow = "fold"
    texts = [[_plain(column.header), *map(_plain, column.cells)] for column in table.columns]
    longest_word = [max((len(w) for t in col for w in t.split()), default=1) for col in texts]
    natural = [max((len(line) for t in col for line in t.splitlines()), default=1) for col in texts]
    room = console.width - (_width(table, console) - sum(natural))  # less borders and padding
    if sum(natural) <= room or sum(longest_word) > room:
        return table
    # Every column gets its longest word; what is left goes where the text is longest.
    spare = room - sum(longest_word)
    extra = [n - w for n, w in zip(natural, longest_word, strict=True)]
    total = sum(extra) or 1
    for column, word, more in zip(table.columns, longest_word, extra, strict=True):
        column.width = word + spare * more // total
    return table


def _plain(cell: object) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def _width(table: Table, console: Console) -> int:
    # Measured on a page wider than any table: its natural width, before rich would shrink it.
    return Measurement.get(console, console.options.update_width(10_000), table).maximum
