"""The OpenAI / vLLM wire formats, typed once at the edge with msgspec.

Structs decode only what the sidecar reads; everything else is skipped by the decoder and passed on
as the original bytes. Fields the sidecar may strip from a response are `Raw`: the exact bytes of the
value, which locate it in the body for byte-level removal and decode typed only when recorded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import msgspec
from msgspec import Raw, Struct

from agl_sidecar.inputs import Count, Int64, Positive

T = TypeVar("T")

NULL = Raw(b"null")


# --- requests ----------------------------------------------------------------------------------
class StreamOptions(Struct):
    include_usage: bool | None = None


# Ints the span copies are range-checked here, where they enter (a ValidationError naming the field,
# answered 400): an engine refuses such values anyway, and a span must never carry an int it cannot.
class ChatRequest(Struct):
    messages: list[Raw]
    model: str | None = None
    stream: bool | None = False
    n: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: Count | None = None
    return_token_ids: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    stream_options: StreamOptions | None = None


class CompletionRequest(Struct):
    prompt: Raw
    model: str | None = None
    stream: bool | None = False
    n: Positive | None = None
    logprobs: Count | None = None
    return_token_ids: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: Int64 | None = None
    stream_options: StreamOptions | None = None


Request = ChatRequest | CompletionRequest


# --- responses ---------------------------------------------------------------------------------
class Usage(Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class ChatChoice(Struct):
    index: int = 0
    finish_reason: str | None = None
    message: Raw = NULL
    logprobs: Raw = NULL
    token_ids: Raw = NULL


class ChatResponse(Struct):
    id: str | None = None
    model: str | None = None
    choices: list[ChatChoice] = []
    usage: Usage | None = None
    prompt_token_ids: Raw = NULL


class ChatChunkChoice(Struct):
    index: int = 0
    finish_reason: str | None = None
    logprobs: Raw = NULL
    token_ids: Raw = NULL


class UpstreamError(Struct):
    message: Any = None  # any JSON: an engine's error chunk is recorded whatever its message's type


class ChatChunk(Struct):
    id: str | None = None
    model: str | None = None
    choices: list[ChatChunkChoice] = []
    usage: Usage | None = None
    prompt_token_ids: Raw = NULL
    error: UpstreamError | None = None


class TypedChunkChoice(Struct):
    index: int = 0
    finish_reason: str | None = None
    logprobs: Raw = NULL  # its exact bytes confirm where the fast path cuts; decoded to record
    token_ids: list[int] | None = None


class TypedChatChunk(Struct):
    """A chat chunk decoded in one pass, for the stream fast path (values located by markers)."""

    id: str | None = None
    model: str | None = None
    choices: list[TypedChunkChoice] = []
    usage: Usage | None = None
    prompt_token_ids: Raw = NULL  # decoded off the hot path
    error: UpstreamError | None = None


class CompletionChoice(Struct):
    index: int = 0
    finish_reason: str | None = None
    logprobs: Raw = NULL
    token_ids: Raw = NULL
    prompt_token_ids: Raw = NULL


class CompletionResponse(Struct):
    id: str | None = None
    model: str | None = None
    choices: list[CompletionChoice] = []
    usage: Usage | None = None
    error: UpstreamError | None = None


# Typed views of the Raw fields, decoded only to record them.
class TokenLogprob(Struct):
    logprob: float | None  # null: an engine that writes a non-finite logprob as JSON null


class ChatLogprobs(Struct):
    content: list[TokenLogprob] | None = None


class LegacyLogprobs(Struct):
    token_logprobs: list[float | None] = []


_ints = msgspec.json.Decoder(list[int] | None)
_numbers = msgspec.json.Decoder(list[int | float] | None)
# Lax: a logprob may arrive as the string "NaN" / "-Infinity" (tolerant_json's spelling of them).
_chat_logprobs = msgspec.json.Decoder(ChatLogprobs | None, strict=False)
_legacy_logprobs = msgspec.json.Decoder(LegacyLogprobs | None, strict=False)


def token_ids(raw: Raw | bytes) -> list[int] | None:
    """The int array `raw`. IDs spelled as integral floats (`1.0`, `1e3`: JSON does not tell them
    apart, and some servers write every number as a double) are the same IDs: read by a slow path
    taken only when the strict decode fails. Raises msgspec.ValidationError for anything else."""
    try:
        return _ints.decode(raw)
    except msgspec.ValidationError:
        values = _numbers.decode(raw)
        if values is None:
            return None
        out: list[int] = []
        for value in values:
            if type(value) is float:
                if not value.is_integer():
                    raise msgspec.ValidationError(f"token ID {value!r} is not an integer") from None
                value = int(value)
            out.append(value)
        return out


def _normalized(value: Any) -> Any:
    if type(value) is float:
        if math.isfinite(value):
            return int(value) if value.is_integer() else value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if type(value) is list:
        return [_normalized(v) for v in value]
    if type(value) is dict:
        return {k: _normalized(v) for k, v in value.items()}
    return value


def tolerant_json(body: bytes) -> bytes | None:
    """`body` as the typed decoders read it, when they refused its spelling: integral numbers
    written as floats (`"index": 0.0`, `"prompt_tokens": 3.0`, IDs `5.0`) become ints, and what only
    Python's `json` reads (`NaN`, `Infinity`, `-Infinity`, a number beyond double range like
    `-1e400`, which an engine written in Python may put in logprobs) becomes the strings "NaN" /
    "Infinity" / "-Infinity", which the logprob decoders (lax) read back as the same floats. None
    when it is not JSON at all. The slow path of a body the typed decoders refused: never the hot path."""
    try:
        return msgspec.json.encode(_normalized(json.loads(body)))
    except (ValueError, RecursionError, TypeError):  # not JSON (UnicodeDecodeError is a ValueError)
        return None


def int_array_pieces(raw: Raw, max_bytes: int) -> Iterator[tuple[bytes, bool]]:
    """The JSON int array `raw` as consecutive JSON arrays of about `max_bytes` of text each, cut at
    commas, with whether each was cut for size (a 100k-token prompt need not be decoded in one go).
    Equal leading elements give equal leading pieces. A value that is not an int array still fails
    to decode as one, piece by piece (a cut inside a string leaves invalid JSON)."""
    data = bytes(raw)
    end = len(data) - 1
    if end < max_bytes or data[0] != 0x5B or data[end] != 0x5D:  # short, or not '[...]' verbatim
        yield data, False
        return
    start = 1
    while start < end:
        cut = data.find(b",", start + max_bytes, end)
        if cut < 0:
            yield b"[" + data[start:end] + b"]", False
            return
        yield b"[" + data[start:cut] + b"]", True
        start = cut + 1


_LIFTED = Raw(b"0")
# Below this a body is decoded as it is: lifting costs two searches and a copy, and only a prompt's
# IDs (the first chunk of a stream, a whole response) make a body this large.
LIFT_MIN_BYTES = 4096


def lift_int_array(body: bytes, key: bytes) -> tuple[bytes, Raw | None]:
    """`body` with the int array after its only `key` (`b'"prompt_token_ids":'`) replaced by `0`,
    and that array's bytes; `(body, None)` when the key is absent, repeated or not followed by `[`
    (whitespace after the colon allowed: `"prompt_token_ids": [1, 2]`).

    A response's prompt IDs are most of its bytes (200 KB for a 30k-char prompt), and a decoder
    validates every byte of a Raw field to find where it ends; `]` ends an int array, so two byte
    searches find it at memchr speed. The builder validates the array when it decodes it, as it
    would have without the lift."""
    start = member_value(body, key)
    if start < 0 or not body.startswith(b"[", start):
        return body, None
    end = body.find(b"]", start) + 1
    if end <= 0 or body.find(key, end) >= 0:  # the key again after it: which one is the response's?
        return body, None
    return body[:start] + b"0" + body[end:], Raw(body[start:end])


def decode_lifted(decoder: msgspec.json.Decoder[Any], body: bytes, field: str) -> Any:
    """`decoder.decode(body)`, the int array of the top-level Raw `field` lifted out first
    (`lift_int_array`) and put back into the decoded value: the same value, decoded without
    scanning the array. A key of that name nested deeper is left where it was; a value the lift cut
    wrongly (a `]` inside a string in the array) is decoded whole instead."""
    if len(body) >= LIFT_MIN_BYTES:
        view, lifted = lift_int_array(body, b'"' + field.encode() + b'":')
        if lifted is not None:
            try:
                value = decoder.decode(view)
            except msgspec.MsgspecError:
                pass
            else:
                if getattr(value, field) == _LIFTED:  # the lifted key was the top-level one
                    setattr(value, field, lifted)
                    return value
    return decoder.decode(body)


def decode_tolerant(decode: Callable[[Raw | bytes], T], raw: Raw | bytes) -> T:
    """`decode(raw)`; when it refuses a spelling only Python's `json` reads (`NaN`, `-1e400`, `1.0`
    for an int), `decode` of its tolerant_json form. Raises what `decode` raised when that is None."""
    try:
        return decode(raw)
    except msgspec.MsgspecError:
        fixed = tolerant_json(bytes(raw))
        if fixed is None:
            raise
        return decode(fixed)


def chat_logprobs(raw: Raw) -> list[float] | None:
    return _chat_logprob_list(decode_tolerant(_chat_logprobs.decode, raw))


def chat_logprob_values(raw: Raw) -> list[float] | None:
    """`chat_logprobs(raw)` for the spellings msgspec reads; raises msgspec.MsgspecError for Python's
    bare NaN (the stream fast path's caller then takes its general path, which reads it)."""
    return _chat_logprob_list(_chat_logprobs.decode(raw))


def _chat_logprob_list(parsed: ChatLogprobs | None) -> list[float] | None:
    if parsed is None or parsed.content is None:
        return None
    return [entry.logprob if entry.logprob is not None else float("nan") for entry in parsed.content]


def legacy_logprobs(raw: Raw) -> list[float] | None:
    parsed = decode_tolerant(_legacy_logprobs.decode, raw)
    if parsed is None:
        return None
    return [value if value is not None else float("nan") for value in parsed.token_logprobs]


chat_request = msgspec.json.Decoder(ChatRequest)
completion_request = msgspec.json.Decoder(CompletionRequest)
chat_response = msgspec.json.Decoder(ChatResponse)
chat_chunk = msgspec.json.Decoder(ChatChunk)
typed_chat_chunk = msgspec.json.Decoder(TypedChatChunk)
completion_response = msgspec.json.Decoder(CompletionResponse)
completion_chunk = completion_response

encode = msgspec.json.encode
decode_any = msgspec.json.decode


def strip(body: bytes, fields: list[tuple[bytes, Raw]], token_ids: bool, logprobs: bool) -> bytes:
    """`body` (a response or chunk) without the values in `fields`: the byte splice when it locates
    every one of them (any whitespace, key order or string escapes: the engine's bytes kept), else
    the decoded body re-encoded without them (`strip_decoded`: a key name spelled with escapes)."""
    out = null_out(body, fields)
    return out if out is not None else strip_decoded(body, token_ids, logprobs)


def strip_decoded(body: bytes, token_ids: bool, logprobs: bool) -> bytes:
    """The slow path: decode, null the injected fields the harness did not ask for, re-encode. A
    body only Python's `json` reads (`NaN` in logprobs) is re-encoded by it, in the same spelling."""
    python_json = False
    try:
        data = msgspec.json.decode(body)
    except msgspec.MsgspecError:
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            raise msgspec.DecodeError("the engine's body is not JSON") from None
        python_json = True
    if not isinstance(data, dict):
        return body
    drop = [] if token_ids else ["prompt_token_ids", "token_ids"]
    if not logprobs:
        drop.append("logprobs")
    if "prompt_token_ids" in drop and data.get("prompt_token_ids") is not None:
        data["prompt_token_ids"] = None
    choices = data.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            for key in drop:
                if choice.get(key) is not None:
                    choice[key] = None
    if python_json:
        return json.dumps(data, separators=(",", ":")).encode()  # ASCII: a lone surrogate stays escaped
    return msgspec.json.encode(data)


# JSON's whitespace, and the bytes that may come right before a member's key: an unescaped quote.
WS = b" \t\n\r"
_WS_BYTES = (b" ", b"\t", b"\n", b"\r")
_BEFORE_KEY = b"{," + WS


def skip_ws(body: bytes, at: int) -> int:
    """The first index at or after `at` that is not JSON whitespace (len(body) if none)."""
    end = len(body)
    while at < end and body[at] in WS:
        at += 1
    return at


def member_value(body: bytes, key: bytes, start: int = 0, spaced: bool = False) -> int:
    """Where the value of the first member `key` (`b'"token_ids":'`: the name in quotes, plain ASCII
    starting with a letter, and a colon) at or after `start` begins in the JSON `body`, at any depth;
    -1 when there is none. Whitespace after the colon is skipped (`"token_ids": [1, 2]`); `spaced`
    also finds whitespace before it (`"token_ids" : `), at the cost of a second kind of search.

    In valid JSON a match is a member's key exactly when its opening quote follows `{`, `,` or
    whitespace (a quote inside a string is escaped, after a backslash) and the closing quote is
    followed by optional whitespace and `:` (a string value is followed by `,`, `}` or `]`)."""
    if spaced:
        key = key[:-1]
    size = len(key)
    at = body.find(key, start)
    while at >= 0:
        if at > 0 and body[at - 1] in _BEFORE_KEY:
            begin = at + size
            if spaced:
                begin = skip_ws(body, begin)
                if not body.startswith(b":", begin):
                    at = body.find(key, at + size)
                    continue
                begin += 1
            return skip_ws(body, begin) if body[begin : begin + 1] in _WS_BYTES else begin
        at = body.find(key, at + size)
    return -1


def value_at(body: bytes, key: bytes, value: Raw | bytes, taken: set[int] | None = None) -> int:
    """Where the value of the first member `key` (`member_value`) spelled exactly `value` (the
    decoder's Raw of it: the same bytes) begins, a start in `taken` skipped; -1 when there is none."""
    # `"key":` first, inlined (the hot path: one search finds vLLM's spelling and `"key": value`).
    size = len(key)
    at = body.find(key)
    while at >= 0:
        begin = at + size
        if at > 0 and body[at - 1] in _BEFORE_KEY:
            if not body.startswith(value, begin):
                begin = skip_ws(body, begin)
            if body.startswith(value, begin) and (taken is None or begin not in taken):
                return begin
        at = body.find(key, at + size)
    begin = member_value(body, key, 0, spaced=True)  # `"key" : value`
    while begin >= 0:
        if body.startswith(value, begin) and (taken is None or begin not in taken):
            return begin
        begin = member_value(body, key, begin, spaced=True)
    return -1


def first_value_at(body: bytes, key: bytes, value: Raw | bytes) -> int:
    """`value_at(body, key, value)`, one search when the first `key` in `body` is a member's key
    with `value` right after its colon (vLLM's compact spelling: the stream's hot path)."""
    at = body.find(key)
    if at > 0 and body[at - 1] in _BEFORE_KEY and body.startswith(value, at + len(key)):
        return at + len(key)
    return value_at(body, key, value)


def disjoint(cuts: list[tuple[int, int]]) -> bool:
    """Sort the (begin, end) spans; False when one lies inside another (a member named as the one
    sought, nested in another value sought): then they are not the members decoded."""
    cuts.sort()
    previous_end = 0
    for begin, end in cuts:
        if begin < previous_end:
            return False
        previous_end = end
    return True


def splice_nulls(body: bytes, cuts: list[tuple[int, int]], prefix: bytes = b"") -> bytes:
    """`prefix` + `body` with each (begin, end) span, sorted and not overlapping, replaced by `null`."""
    out = [prefix]
    position = 0
    for begin, end in cuts:
        out.append(body[position:begin])
        out.append(b"null")
        position = end
    out.append(body[position:])
    return b"".join(out)


def null_out(body: bytes, fields: list[tuple[bytes, Raw]]) -> bytes | None:
    """`body` with the value of each `(key, raw value)` member replaced by `null`, in place: every
    other byte as the engine wrote it, its spacing included. None when a value is not found spelled
    so (an escaped key name: the caller then takes the slow path).

    Each value is located by its key (`value_at`) and confirmed by comparing the whole value in
    place, then the body is spliced once: no copy of a 200 KB token array is made to search for it."""
    cuts: list[tuple[int, int]] = []
    starts: set[int] = set()
    for key, raw in fields:
        if raw == NULL:
            continue
        begin = value_at(body, key, raw, starts)
        if begin < 0:
            return None
        starts.add(begin)  # identical values (equal choices) each get their own cut
        cuts.append((begin, begin + len(raw)))
    if not cuts:
        return body
    return splice_nulls(body, cuts) if disjoint(cuts) else None


def error_body(message: str, error_type: str, param: str | None, code: int) -> bytes:
    """An OpenAI-style error body."""
    return msgspec.json.encode({"error": {"message": message, "type": error_type, "param": param, "code": code}})


def error_param(exc: msgspec.ValidationError) -> str | None:
    """The field a msgspec validation error names (`... - at `$.max_tokens``) as `max_tokens`."""
    text = str(exc)
    marker = "at `$."
    at = text.rfind(marker)
    if at < 0:
        return None
    return text[at + len(marker) :].rstrip("`")
