"""An upstream's server-sent events, split into whole events as the bytes arrive: a read may end
inside an event (the first one carries the prompt's IDs, 200 KB for a 30k-char prompt) or inside a
CRLF, and a stream may open with a UTF-8 BOM. The proxy passes each read's complete events on in
one write."""

from __future__ import annotations

# One SSE event's bytes, at most. The largest real one is a stream's first chunk with the prompt's
# IDs (about 1 MB for 128k tokens); an upstream that never ends an event would otherwise grow the
# buffer until the sidecar, and every call in flight through it, is killed for memory.
MAX_EVENT_BYTES = 64 * 1024 * 1024
UTF8_BOM = b"\xef\xbb\xbf"


class EventTooLarge(Exception):
    pass


class EventSplitter:
    """Feed it the reads in order; it gives back the events each read completed."""

    __slots__ = ("_partial", "_partial_bytes", "_carriage_return", "_first")

    def __init__(self) -> None:
        # The start of an event not yet complete, as received: an event that spans reads is
        # searched and joined once, not once per read.
        self._partial: list[bytes] = []
        self._partial_bytes = 0
        self._carriage_return = False  # a read ended in CR: its LF may start the next read
        self._first = True

    def feed(self, data: bytes) -> list[bytes]:
        """The events `data` completes, in order (some may be empty); EventTooLarge once the event
        being received passes MAX_EVENT_BYTES."""
        if self._first:  # an event stream may open with a UTF-8 BOM, which SSE parsers drop
            self._first = False
            if data.startswith(UTF8_BOM):
                data = data[len(UTF8_BOM) :]
                if not data:
                    return []
        if self._carriage_return or b"\r" in data:  # SSE also ends lines with CRLF or CR
            data, self._carriage_return = _lf_lines(data, self._carriage_return)
            if not data:
                return []
        partial = self._partial
        if partial:
            if b"\n\n" not in data and not (partial[-1][-1:] == b"\n" and data[:1] == b"\n"):
                partial.append(data)
                self._partial_bytes += len(data)
                if self._partial_bytes > MAX_EVENT_BYTES:
                    raise EventTooLarge
                return []
            partial.append(data)
            data = b"".join(partial)
            partial.clear()
        events = data.split(b"\n\n")
        rest = events.pop()
        if rest:
            partial.append(rest)
            self._partial_bytes = len(rest)
            if self._partial_bytes > MAX_EVENT_BYTES:
                raise EventTooLarge
        return events

    def rest(self) -> bytes:
        """What came after the last complete event, once the stream has ended."""
        return b"".join(self._partial).strip()


def _lf_lines(data: bytes, carriage_return: bool) -> tuple[bytes, bool]:
    """`data` with CRLF and CR line ends as LF, and whether it ended in a CR (held back: with the
    LF that may begin the next read it is one line end, not two)."""
    if carriage_return:
        data = b"\r" + data
    held = data.endswith(b"\r")
    if held:
        data = data[:-1]
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n"), held
