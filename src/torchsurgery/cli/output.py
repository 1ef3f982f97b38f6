"""How the command writes its results: a table on a terminal, plain text in a pipe, or JSON.

On a terminal, results are drawn as rich tables fitted to the window. Anywhere else (a
pipe, a file, a script's ``subprocess``) they are plain text: a title line, a header and
one line per row, columns separated by two spaces and padded to their widest value, and
nothing ever cut short, so ``grep``, ``awk`` and ``less`` see every full name. ``--json``
prints one JSON document instead, whatever stdout is.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from torchsurgery import _format


def human_bytes(nbytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: the command prints sizes in powers of 1024.

    Example:
        >>> human_bytes(0), human_bytes(1536), human_bytes(3 * 2**30)
        ('0 B', '1.5 KiB', '3.0 GiB')
    """
    return _format.human_bytes(nbytes, binary=True)


@dataclass
class Table:
    """Rows of text under named columns; the first column holds names and is never cut.

    Example:
        >>> import io
        >>> table = Table("demo", [("module", "left"), ("params", "right")])
        >>> table.add("encoder.layer.0.attention", "1,024")
        >>> out = io.StringIO()
        >>> table.write_plain(out)
        >>> print(out.getvalue(), end="")
        demo
        module                     params
        encoder.layer.0.attention   1,024
    """

    title: str
    columns: list[tuple[str, str]]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: str) -> None:
        """Append one row (one string per column)."""
        if len(cells) != len(self.columns):
            raise ValueError(f"Table.add: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(list(cells))

    def write_plain(self, stream: TextIO) -> None:
        """Aligned plain text, every value whole; trailing spaces trimmed."""
        widths = [max([len(name)] + [len(row[i]) for row in self.rows]) for i, (name, _) in enumerate(self.columns)]
        stream.write(f"{self.title}\n")
        for cells in [[name for name, _ in self.columns], *self.rows]:
            parts = [
                cell.rjust(width) if justify == "right" else cell.ljust(width)
                for cell, width, (_, justify) in zip(cells, widths, self.columns, strict=True)
            ]
            stream.write("  ".join(parts).rstrip() + "\n")
        for note in self.notes:
            stream.write(f"{note}\n")

    def write_rich(self) -> None:
        """A rich table fitted to the terminal; the name column keeps its full width."""
        from rich.console import Console
        from rich.table import Table as RichTable
        from rich.text import Text

        console = Console(highlight=False)
        table = RichTable(title=Text(self.title), title_justify="left")
        for index, (name, justify) in enumerate(self.columns):
            if index == 0:
                width = max([len(name)] + [len(row[0]) for row in self.rows])
                table.add_column(name, justify="left", no_wrap=True, min_width=min(width, console.width // 2))
            else:
                table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for row in self.rows:
            table.add_row(*(Text(cell) for cell in row))  # text as is: no markup
        console.print(table)
        for note in self.notes:
            console.print(note, markup=False)


def emit(table: Table, document: dict[str, Any], as_json: bool) -> None:
    """Write ``document`` as JSON, or ``table`` drawn for a terminal or as plain text."""
    if as_json:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    elif sys.stdout.isatty():
        table.write_rich()
    else:
        table.write_plain(sys.stdout)
    sys.stdout.flush()
