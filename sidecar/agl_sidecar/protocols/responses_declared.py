"""The structure a Responses request declares in its body (docs/spans.md "Declared structure").

Codex (0.169.0) puts its thread identity in `client_metadata` of every request, over HTTP and
WebSocket alike (the same values as its `thread-id`, `x-codex-parent-thread-id` and
`x-codex-turn-metadata` headers):

- `thread_id`: the agent thread that made the call (the main thread's is the session id; a
  sub-agent spawned with `multi_agent_v1.spawn_agent` has its own), and
  `x-codex-parent-thread-id`: the thread that spawned it (absent on the main thread);
- `x-codex-turn-metadata`, a JSON string: `request_kind` ("turn", "compaction", "prewarm") and
  `window_number`, the count of compactions of the thread's context so far.

A call whose `request_kind` is "compaction" (Codex's summarization request when it compacts
locally, with a custom provider; its `compaction_trigger` request with OpenAI's) is declared a
compaction, and so is the first call after its thread's `window_number` grew. So is the first call
on a compacted context whatever the client (a `compaction` item no model output follows yet:
responses_input.py). An id that is not usable (too long, control characters) declares nothing and
the span says so; it is never a 400: the metadata is the harness's, not a field the API requires.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec
from agl import semconv

from agl_sidecar import inputs
from agl_sidecar.protocols.base import Declared
from agl_sidecar.protocols.responses_fates import Fates

THREAD = "thread_id"
PARENT_THREAD = "x-codex-parent-thread-id"
TURN_METADATA = "x-codex-turn-metadata"


class _TurnMetadata(msgspec.Struct):
    request_kind: str | None = None
    window_number: int | None = None


_turn_metadata = msgspec.json.Decoder(_TurnMetadata).decode


class Windows:
    """The latest context window seen per thread (bounded, least recently seen out)."""

    def __init__(self, max_threads: int = 65536) -> None:
        self.max_threads = max_threads
        self._seen: OrderedDict[str, int] = OrderedDict()

    def grew(self, thread: str, window: int) -> bool:
        """Whether `window` is past the one last seen for `thread` (remembering it)."""
        last = self._seen.get(thread)
        if last is not None:
            self._seen.move_to_end(thread)
        if last is None or window > last:
            self._seen[thread] = window
            if len(self._seen) > self.max_threads:
                self._seen.popitem(last=False)
        return last is not None and window > last


def declared(
    metadata: dict[str, Any] | None, after_compaction: bool, windows: Windows, fates: Fates
) -> Declared | None:
    """What the request declares: its agent and parent agent (Codex's thread ids) and compaction."""
    agent = _agent_id(metadata, THREAD, fates) if metadata else None
    parent = _agent_id(metadata, PARENT_THREAD, fates) if metadata else None
    compaction = after_compaction
    raw = metadata.get(TURN_METADATA) if metadata else None
    if isinstance(raw, str):
        try:
            turn = _turn_metadata(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            fates.drop(f"client_metadata.{TURN_METADATA}", "not JSON of the shape Codex writes: not read")
        else:
            compaction = compaction or turn.request_kind == "compaction"
            if agent is not None and turn.window_number is not None:
                compaction = windows.grew(agent, turn.window_number) or compaction
    if agent is None and parent is None and not compaction:
        return None
    return Declared(agent_id=agent, parent_agent_id=parent, compaction=compaction)


def _agent_id(metadata: dict[str, Any], key: str, fates: Fates) -> str | None:
    value = metadata.get(key)
    if value is None:
        return None
    try:
        if not isinstance(value, str):
            raise inputs.BadInput("not a string", key)
        return inputs.short_text(value, f"client_metadata.{key}", semconv.AGENT_ID_MAX_CHARS)
    except inputs.BadInput as exc:
        fates.drop(f"client_metadata.{key}", f"not usable as an agent id ({exc.message}): no agent declared")
        return None
