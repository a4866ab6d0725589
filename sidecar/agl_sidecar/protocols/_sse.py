"""Server-sent events as both front protocols frame them: `event: NAME` then one JSON `data:` line."""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One SSE event; JSON is written compactly (as the real APIs do) and never spans lines."""
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"
