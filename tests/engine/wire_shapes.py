"""Compare response bodies by shape: the same keys in the same order, the same JSON types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def shape(value: Any, parent: str = "") -> Any:
    if isinstance(value, dict):
        if parent == "top_logprobs" and "token" not in value:
            # legacy completions logprobs: keys are token texts, so only the value type matters
            return {"<token text>": shape(next(iter(value.values()))) if value else None}
        return {key: shape(item, key) for key, item in value.items()}
    if isinstance(value, list):  # lists of objects by their first item; empty or scalar lists as "list"
        return [shape(value[0], parent)] if value and isinstance(value[0], (dict, list)) else "list"
    if value is None:
        return None
    return type(value).__name__


def shape_text(value: Any) -> str:
    return json.dumps(shape(value), indent=1)


def sse_events(raw: str) -> list[Any]:
    """The SSE body as a list of decoded `data:` payloads ("[DONE]" kept as a string)."""
    assert raw.endswith("\n\n"), "an SSE body ends with a blank line"
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), f"every event is one `data:` line, got {block[:40]!r}"
        assert "\n" not in block, "one line per event"
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream_shapes(events: list[Any]) -> list[str]:
    """Each chunk's shape, consecutive repeats collapsed (chunk counts depend on the tokens drawn)."""
    shapes: list[str] = []
    for event in events:
        text = event if isinstance(event, str) else shape_text(event)
        if not shapes or shapes[-1] != text:
            shapes.append(text)
    return shapes


def load(fixtures: Path, case: str) -> tuple[dict[str, Any] | None, str]:
    request = fixtures / f"{case}.request.json"
    body = json.loads(request.read_text()) if request.exists() else None
    for ext in ("json", "sse"):
        path = fixtures / f"{case}.{ext}"
        if path.exists():
            return body, path.read_text()
    raise FileNotFoundError(case)
