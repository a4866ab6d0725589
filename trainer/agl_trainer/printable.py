"""Text from harnesses and senders, made safe to print: control characters as visible escapes.

`printable(text)` is a str (ESC as \\x1b, bidi overrides as \\u202e); `plain(text)` is a rich Text
that is never read as markup. Its own small module so the CLI's listings (`agl traces ls`) use it
without importing assembly (numpy) through `assembly.inspect_view`, which re-exports both.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.text import Text

# C0 and C1 controls, DEL, line and paragraph separators, and the bidi controls that reorder text.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, keep_newlines: bool = False) -> str:
    """`text` with every control character shown as an escape (ESC as \\x1b); newlines and tabs
    kept when `keep_newlines` (multi-line errors, decoded token text)."""
    value = str(text)
    if keep_newlines:
        return _UNPRINTABLE.sub(lambda m: m.group() if m.group() in "\n\t" else _escape(m), value)
    return _UNPRINTABLE.sub(_escape, value)


def plain(text: object, style: str = "", keep_newlines: bool = False) -> Text:
    """Outside text for a rich table or panel: escaped, and never read as markup."""
    from rich.text import Text

    return Text(printable(text, keep_newlines), style=style)
