"""`make_console()`: the CLI's rich Console, which wraps lines only for a terminal.

Rich takes 80 columns when its stream is not a terminal and breaks every longer line there, so a
log written to a file or a pipe had sentences cut mid-way ("timeout \\n300 s"). Off a terminal the
Console here never soft-wraps printed text and lays tables and panels out as wide as their content
(up to `WIDTH_OFF_TERMINAL`), unless the user set COLUMNS. In a terminal it is rich's own.
"""

from __future__ import annotations

import os
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

WIDTH_OFF_TERMINAL = 1000  # wide enough for any line agl prints; tables take only what they need


def make_console(*, stderr: bool = False, file: IO[str] | None = None) -> Console:
    """A Console on stdout (stderr with `stderr`, or `file`) that wraps only in a terminal."""
    from rich.console import Console

    console = Console(stderr=stderr, file=file)
    if not console.is_terminal:
        console.soft_wrap = True
        if "COLUMNS" not in os.environ:
            console.width = WIDTH_OFF_TERMINAL
    return console
