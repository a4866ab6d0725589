"""What became of the parts of a request the adapter does not interpret: dropped (not sent to the
engine) or passed (sent as written), each noted once per path and reason, for the call's span
(`Translation.dropped` / `.passed`, docs/spans.md).

Paths are JSON paths with `{}` where an index goes (`input[{}].content[{}].type`); one note keeps
its indices (`input[3].content[0].type`), several with the same path and reason become one entry
with `*` for every index and their count (`input[*].internal_chat_message_metadata_passthrough:
... (5 items)`), so a long rollout's span grows with what is new in a request, not with its length.
"""

from __future__ import annotations

# Reasons, short: the span says what happened and why.
UNKNOWN = "unknown to the sidecar; the engine has no use for it"
NOT_FOR_ENGINE = "the engine has no use for it"
HOSTED_TOOL = "a hosted tool the engine cannot run"
NOT_HELD = "not issued by this sidecar, so the engine cannot be given its content"
PASSED_AS_WRITTEN = "unknown to the sidecar; passed to the engine as written"


class Fates:
    """Notes of dropped and passed request parts, in the order first seen."""

    __slots__ = ("_dropped", "_passed")

    def __init__(self) -> None:
        self._dropped: dict[tuple[str, str], list[tuple[int, ...]]] = {}
        self._passed: dict[tuple[str, str], list[tuple[int, ...]]] = {}

    def drop(self, path: str, why: str, *at: int) -> None:
        """`path` (with one `{}` per index in `at`) was not sent to the engine, because `why`."""
        self._dropped.setdefault((path, why), []).append(at)

    def passed(self, path: str, why: str, *at: int) -> None:
        """`path` was sent to the engine as the harness wrote it, unread by the adapter."""
        self._passed.setdefault((path, why), []).append(at)

    def dropped_entries(self) -> tuple[str, ...]:
        return _entries(self._dropped)

    def passed_entries(self) -> tuple[str, ...]:
        return _entries(self._passed)


def _entries(notes: dict[tuple[str, str], list[tuple[int, ...]]]) -> tuple[str, ...]:
    out: list[str] = []
    for (path, why), places in notes.items():
        if len(places) == 1:
            out.append(f"{path.format(*places[0])}: {why}")
        else:
            stars = ("*",) * len(places[0])
            out.append(f"{path.format(*stars)}: {why} ({len(places)} items)")
    return tuple(out)
