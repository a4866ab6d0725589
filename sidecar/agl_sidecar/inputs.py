"""Checks for values that enter the sidecar from outside (URL paths, headers, JSON bodies), made where
they enter: a value a span would carry must be one the span's encoding and the receiver's store can
hold, or the request is refused with a 4xx naming the field. One bad call must never cost a span
(its own or another's) further down the line.

The contract (docs/spans.md): span ints are int64; identity counters (`agl.attempt`, `agl.call.seq`,
`agl.policy.version`) are non-negative int64; ids are text without control characters.
"""

from __future__ import annotations

import unicodedata
from typing import Annotated

import msgspec

from agl.semconv import INT64_MAX, INT64_MIN

# Types for msgspec request structs: out of range is a ValidationError naming the field.
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]  # attempts, sequence numbers, versions
Positive = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]


class BadInput(Exception):
    """A value from outside the sidecar cannot be accepted; `param` names where it came from."""

    status = 400

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class NotYours(BadInput):
    """A per-rollout API key used for another rollout: a 403 naming both."""

    status = 403


class BodyRefused(Exception):
    """A request body the sidecar will not read to the end; `status` is the HTTP answer."""

    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TooLarge(BodyRefused):
    """A request body over the configured limit (--max-body-bytes), decompressed if it was sent compressed."""

    status = 413

    def __init__(self, limit: int, encoding: str | None = None) -> None:
        decompressed = f", decompressed (Content-Encoding: {encoding})," if encoding else ""
        super().__init__(f"request body{decompressed} is over the sidecar's limit of {limit} bytes (--max-body-bytes)")
        self.limit = limit


class BodyTimeout(BodyRefused):
    """A request body that did not arrive whole within body_timeout_s (a stalled or slow-loris client)."""

    status = 408

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"request body did not arrive within {timeout_s:g} s (body_timeout_s, AGL_SIDECAR_BODY_TIMEOUT_S)"
        )


def count(text: str | None, param: str) -> int | None:
    """A non-negative int64 given as decimal text (a path segment, a header, a baggage entry)."""
    if text is None or text == "":
        return None
    stripped = text.strip()
    # isdecimal: int() would also take '+1', '1_0' and surrounding whitespace; a header is digits.
    if not (stripped.isascii() and stripped.isdecimal()) or len(stripped) > 19:
        raise BadInput(f"{param} must be an integer from 0 to {INT64_MAX}, got {_shown(text)}", param)
    value = int(stripped)
    if value > INT64_MAX:
        raise BadInput(f"{param} must be an integer from 0 to {INT64_MAX}, got {_shown(text)}", param)
    return value


def text(value: str | None, param: str) -> str | None:
    """An id as it may enter a span: text with no control characters (a terminal would act on them)
    and no undecodable bytes (a header's raw 0xFF arrives as a lone surrogate, which UTF-8 cannot
    encode: the span would be lost)."""
    if value is None:
        return None
    if value.isascii():
        if value.isprintable():
            return value
    elif all(unicodedata.category(ch) not in ("Cc", "Cs") for ch in value):
        return value
    raise BadInput(f"{param} must be printable UTF-8 text, got {_shown(value)}", param)


def short_text(value: str, param: str, max_chars: int) -> str:
    """text() no longer than `max_chars` characters (a declared name, not a payload)."""
    if len(value) > max_chars:
        raise BadInput(f"{param} must be at most {max_chars} characters, got {len(value)}", param)
    return text(value, param)  # type: ignore[return-value]


def shown_text(value: str) -> str:
    """`value` escaped and short, for an error message."""
    return _shown(value)


def shown_message(message: str, limit: int = 512) -> str:
    """An error message that may quote a caller's value (msgspec's "Invalid enum value 'x...'"),
    cut to about `limit` characters, keeping its end (msgspec ends with the field's path)."""
    if len(message) <= limit:
        return message
    return message[: limit // 2] + "..." + message[-(limit // 2) :]


def _shown(value: str) -> str:
    """`value` safe to put in an error message: escaped, and short."""
    shown = value.encode("ascii", "backslashreplace").decode("ascii")
    return repr(shown[:64] + ("..." if len(shown) > 64 else ""))


def int64_or_none(value: object) -> int | None:
    """An engine- or provider-reported count as a span may carry it: an int in int64 range, or
    None (the attribute is left out rather than the span made unencodable)."""
    if isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX:
        return value
    return None
