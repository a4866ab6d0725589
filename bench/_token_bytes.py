"""Issue #43's candidate token representation, bench-only (bench/token_representation.py drives it).

Today the sidecar sends token IDs as OTLP int arrays (sidecar/agl_sidecar/spans/otlp.py: 6 bytes a
token, its slice and prompt caches and a C extension to make them fast) and gzips a request mostly made
of prompts sent before by copying each repeated prompt's kept deflate stream (deflate.py). The
candidate measured here against it:

- `agl.prompt.token_ids` and `agl.completion[.N].token_ids` as OTLP `bytesValue` holding the IDs as
  little-endian int32 (as the store keeps them), `agl.completion[.N].logprobs` as little-endian
  float32; the engine's JSON decoded by msgspec and packed by numpy, no caches, no C.
- A prompt repeated inside one export request (the k attempts of a task starting together) sent once,
  in a request-scoped table: the scope attribute `agl.prompt.table` (an array of bytesValue entries),
  each span naming its entry with `agl.prompt.table_entry` (an int) instead of carrying
  `agl.prompt.token_ids`. Why the scope: it is the smallest container that holds spans and travels
  with them through a collector (the batch processor keeps a ScopeSpans' scope with every span it
  moves, and merges scopes only when their attributes are equal, so an entry cannot be separated from
  the spans that name it); the resource stays the sidecar's identity, equal across requests, which
  backends that key on it expect. A span keeps its `agl.prompt.ref.*` reference to the rollout's
  previous call, as today: only what it would have sent as `agl.prompt.token_ids` goes to the table.
- The whole request through plain gzip (`zlib.compress`, level 1 like the exporter's), or not at all.

The receiver side (`decode_request`) reads the same request back into the `RawSpan`s the contract
checks (numpy.frombuffer over the bytes), and refuses a bad value with a `DecodeError` (the receiver's
400) naming the span and the attribute: a length that is not a multiple of 4, a negative token ID, an
entry of a table that is not there. Int arrays from any other producer pass through unchanged.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
from agl import semconv
from agl_sidecar.calls import wire
from agl_sidecar.calls.record import CallRecord
from agl_sidecar.spans import otlp
from agl_sidecar.spans.lru import BytesLRU
from agl_sidecar.spans.recorder import (
    MIN_REFERENCE_TOKENS,
    SpanRecorder,
    call_attributes,
    new_span_id,
    new_trace_id,
    static_attributes,
)
from agl_trainer.receiver.otlp_protobuf import _any_value, _fields, _resolve, _span
from agl_trainer.receiver.raw_span import DecodeError, RawSpan

TABLE_KEY = "agl.prompt.table"  # scope attribute: bytesValue[] of int32 LE prompts
TABLE_ENTRY_KEY = "agl.prompt.table_entry"  # span attribute: int, an index into the table
# A prompt this size or more goes to the table when it repeats in a request (a smaller one costs
# less sent twice than its table entry and reference).
TABLE_MIN_BYTES = 1024
INT32_MAX = 2**31 - 1


class TokenSpan:
    """An encoded span (every attribute but its prompt) and its prompt's int32 bytes, placed by the
    request: inline as `agl.prompt.token_ids`, or as an entry of the request's table."""

    __slots__ = ("head", "prompt")

    def __init__(self, head: bytes, prompt: bytes | None) -> None:
        self.head = head
        self.prompt = prompt


def int32_bytes(value: list[int] | msgspec.Raw) -> bytes | None:
    """The engine's IDs (a list, or its JSON array) as little-endian int32; None for a JSON null.
    Raises otlp.OutOfRange for an ID outside [0, 2**31), msgspec errors for anything but ints."""
    ids = value if isinstance(value, list) else wire.token_ids(value)
    if ids is None:
        return None
    try:
        array = np.array(ids, dtype=np.int64)
    except OverflowError:
        raise otlp.OutOfRange("a token ID is outside int64") from None
    if array.size and (array.min() < 0 or array.max() > INT32_MAX):
        raise otlp.OutOfRange("a token ID is outside int32")
    return array.astype("<i4").tobytes()


def _bytes_value(data: bytes) -> bytes:
    return b"\x3a" + otlp.varint(len(data)) + data  # AnyValue.bytes_value = 7


def _attribute(field_number: int, key: str, any_value: bytes) -> bytes:
    pair = otlp._key_part(key) + otlp.varint(len(any_value)) + any_value
    return otlp._TAGS[field_number] + otlp.varint(len(pair)) + pair


def bytes_attribute(key: str, data: bytes) -> bytes:
    """A span attribute (field 9) holding `data` as a bytesValue."""
    return _attribute(9, key, _bytes_value(data))


class BytesRecorder(SpanRecorder):
    """The sidecar's span recorder with the candidate's token attributes: `_build_call` as the
    product's (recorder.py), but with int32 bytes for the arrays and the prompt left to the request.
    Drift switches (agl.completion.policy_versions) are left out: no bench call has one."""

    def __init__(self, *args: Any, reuse_prefix: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_bytes: dict[str, tuple[int, bytes]] = {}
        # reuse_prefix: per rollout, the last prompt's JSON text (without its "]") and its int32 bytes,
        # so a next turn's prompt decodes only the JSON after it (an agent resends its conversation);
        # and whole prompts by their JSON text, so the k attempts of a task decode their prompt once.
        self.reuse_prefix = reuse_prefix
        self._last_json: dict[str, tuple[bytes, bytes]] = {}
        self._whole: BytesLRU[bytes, bytes] = BytesLRU(32 * 1024 * 1024, lambda key, value: len(key) + len(value))

    def _prompt_bytes(self, call: CallRecord) -> bytes | None:
        value, rollout_id = call.prompt_ids, call.identity.rollout_id
        if not self.reuse_prefix or not isinstance(value, msgspec.Raw) or not rollout_id:
            return int32_bytes(value)  # type: ignore[arg-type]
        data = bytes(value)
        kept = self._last_json.get(rollout_id)
        prompt: bytes | None
        if kept is not None and data.startswith(kept[0]) and data[len(kept[0]) : len(kept[0]) + 1] == b",":
            rest = int32_bytes(msgspec.Raw(b"[" + data[len(kept[0]) + 1 :]))
            prompt = None if rest is None else kept[1] + rest
        elif kept is not None and data.startswith(kept[0]) and data[len(kept[0]) :].strip() == b"]":
            prompt = kept[1]
        else:
            prompt = self._whole.get(data)
            if prompt is None:
                prompt = int32_bytes(value)  # type: ignore[arg-type]
                if prompt is not None:
                    self._whole.put(data, prompt)
        if prompt is not None and data.endswith(b"]"):
            self._last_json[rollout_id] = (data[:-1].rstrip(), prompt)
        return prompt

    def _build_call(self, call: CallRecord) -> Iterator[None]:
        identity = call.identity
        prompt: bytes | None = None
        completions: list[tuple[int, Any, bytes]] = []
        if any(index != i for i, index in enumerate(sorted(call.choices))):
            call.tokens_absent = True
        if call.prompt_ids is not None and not call.tokens_absent:
            logprobs_of = wire.chat_logprobs if call.operation == semconv.OPERATION_CHAT else wire.legacy_logprobs
            try:
                prompt = self._prompt_bytes(call)
                for index in sorted(call.choices):
                    choice = call.choices[index]
                    ids = int32_bytes(choice.token_ids)
                    if ids is None:
                        call.tokens_absent = True
                        break
                    if not isinstance(choice.logprobs, list):
                        choice.logprobs = logprobs_of(choice.logprobs) or []
                    completions.append((index, choice, ids))
            except (msgspec.MsgspecError, otlp.OutOfRange):
                call.tokens_absent = True
        has_tokens = prompt is not None and not call.tokens_absent
        static_key = (
            call.operation, call.provider, call.model, call.stream, call.api, call.end_reason, call.upstream,
            call.response_model, has_tokens, identity.mode,
        )
        static = self._static.get(static_key)
        if static is None:
            static = self._static[static_key] = otlp.attributes(9, static_attributes(call, has_tokens))
        attrs = call_attributes(call, call.policy_version)  # the same attributes as today's spans
        indices = sorted(call.choices)
        if indices:
            attrs.append((semconv.GEN_AI_RESPONSE_FINISH_REASONS, [call.choices[i].finish_reason or "" for i in indices]))
            attrs.append((semconv.COMPLETION_CHOICES, len(indices)))
        input_tokens = call.input_tokens
        if input_tokens is None and prompt is not None:
            input_tokens = len(prompt) // 4
        output_tokens = call.output_tokens
        if output_tokens is None and has_tokens:
            output_tokens = sum(len(ids) // 4 for _, _, ids in completions)
        attrs.append((semconv.GEN_AI_USAGE_INPUT_TOKENS, input_tokens))
        attrs.append((semconv.GEN_AI_USAGE_OUTPUT_TOKENS, output_tokens))
        encoded = [static]
        sent_prompt: bytes | None = None
        if has_tokens:
            assert prompt is not None
            sent_prompt = self._bytes_attributes(call, prompt, completions, attrs, encoded)
        parent = call.trace_parent
        head = otlp.span(
            trace_id=parent.trace_id if parent else new_trace_id(),
            span_id=new_span_id(),
            parent_span_id=parent.span_id if parent else None,
            name=semconv.call_span_name(call.operation, call.model),
            kind=otlp.SPAN_KIND_CLIENT,
            start_ns=call.start_ns,
            end_ns=call.end_ns,
            attrs=attrs,
            encoded_attrs=b"".join(encoded),
            status_code=otlp.STATUS_ERROR if call.error_type else otlp.STATUS_UNSET,
            status_message=call.error_message,
        )
        self.calls_recorded += 1
        self.exporter.submit(TokenSpan(head, sent_prompt))
        yield from ()

    def _bytes_attributes(
        self, call: CallRecord, prompt: bytes, completions: list[tuple[int, Any, bytes]],
        attrs: list[tuple[str, Any]], encoded: list[bytes],
    ) -> bytes:
        """The token attributes into `attrs` / `encoded`; returns what goes as agl.prompt.token_ids."""
        attrs.append((semconv.PROMPT_LENGTH, len(prompt) // 4))
        rollout_id = call.identity.rollout_id
        previous = self._last_bytes.get(rollout_id) if rollout_id else None
        sent = prompt
        if previous is not None and len(previous[1]) >= 4 * MIN_REFERENCE_TOKENS and prompt.startswith(previous[1]):
            ref_seq, ref = previous
            attrs += [(semconv.PROMPT_REF_CALL_SEQ, ref_seq), (semconv.PROMPT_REF_LENGTH, len(ref) // 4)]
            sent = prompt[len(ref) :]
        first: bytes | None = None
        for index, choice, ids in completions:
            if index == 0:
                first = ids
            encoded.append(bytes_attribute(semconv.completion_token_ids_key(index), ids))
            logprobs = choice.logprobs
            if logprobs and len(logprobs) * 4 == len(ids):
                packed = np.array(logprobs, dtype="<f4").tobytes()
                encoded.append(bytes_attribute(semconv.completion_logprobs_key(index), packed))
            if index > 0:
                attrs.append((semconv.completion_finish_reason_key(index), choice.finish_reason or ""))
        if rollout_id and call.seq is not None and first is not None:
            self._last_bytes[rollout_id] = (call.seq, prompt + first)
        return sent


def frame_request(spans: Sequence[TokenSpan], resource: bytes, scope_name: str, scope_version: str) -> bytes:
    """One ExportTraceServiceRequest: a prompt of TABLE_MIN_BYTES or more that two spans of it carry is
    sent once, in the scope's `agl.prompt.table`. `resource` is an encoded Resource message."""
    repeats = Counter(s.prompt for s in spans if s.prompt is not None and len(s.prompt) >= TABLE_MIN_BYTES)
    table = {prompt: i for i, prompt in enumerate(p for p, n in repeats.items() if n > 1)}
    scope = otlp._field_bytes(1, scope_name.encode()) + otlp._field_bytes(2, scope_version.encode())
    if table:
        entries = b"".join(otlp._field_bytes(1, _bytes_value(prompt)) for prompt in table)
        scope += _attribute(3, TABLE_KEY, otlp._field_bytes(5, entries))  # InstrumentationScope.attributes
    pieces = [otlp._field_bytes(1, scope)]
    for item in spans:
        if item.prompt is None:
            body = item.head
        elif item.prompt in table:
            body = item.head + otlp.attributes(9, [(TABLE_ENTRY_KEY, table[item.prompt])])
        else:
            body = item.head + bytes_attribute(semconv.PROMPT_TOKEN_IDS, item.prompt)
        pieces.append(otlp._TAGS[2] + otlp.varint(len(body)))
        pieces.append(body)
    scope_spans = b"".join(pieces)
    resource_spans = otlp._field_bytes(1, resource) + otlp._field_bytes(2, scope_spans)
    return otlp._field_bytes(1, resource_spans)


def gzip(request: bytes, level: int = 1) -> bytes:
    """Plain gzip, nothing kept between requests."""
    return zlib.compress(request, level, 16 + zlib.MAX_WBITS)


# --- the receiver's side --------------------------------------------------------------------------
_TOKEN_KEYS = (semconv.PROMPT_TOKEN_IDS, semconv.COMPLETION_TOKEN_IDS)


def _ids(data: bytes, where: str) -> np.ndarray:
    if len(data) % 4:
        raise DecodeError(f"{where}: {len(data)} bytes is not a whole number of int32 token IDs (4 bytes each)")
    ids = np.frombuffer(data, dtype="<i4")
    if ids.size and ids.min() < 0:
        raise DecodeError(f"{where}: token ID {int(ids.min())} is negative")
    return ids.astype(np.int32, copy=False)


def _table(buf: bytes, start: int, end: int) -> list[np.ndarray] | None:
    """The `agl.prompt.table` of an InstrumentationScope message, else None."""
    for field, wire_type, item in _fields(buf, start, end):
        if field != 3 or wire_type != 2:
            continue
        key, value = "", None
        for kv_field, kv_wire, kv_item in _fields(buf, *item):
            if kv_field == 1 and kv_wire == 2:
                key = bytes(buf[kv_item[0] : kv_item[1]]).decode("utf-8", "replace")
            elif kv_field == 2 and kv_wire == 2:
                value = _any_value(buf, *kv_item)
        if key != TABLE_KEY:
            continue
        if not isinstance(value, list) or not all(type(entry) is bytes for entry in value):
            raise DecodeError(f"{TABLE_KEY}: must be an array of bytes values")
        return [_ids(entry, f"{TABLE_KEY} entry {i}") for i, entry in enumerate(value)]
    return None


def _token_values(span: RawSpan, number: int, table: list[np.ndarray] | None) -> None:
    """The span's bytes values as numpy arrays, its table entry resolved; DecodeError when bad."""
    attributes = span.attributes
    for key, value in list(attributes.items()):
        if type(value) is not bytes:
            continue
        where = f"span {number}: {key}"
        if key in _TOKEN_KEYS or (key.startswith("agl.completion.") and key.endswith(".token_ids")):
            attributes[key] = _ids(value, where)
        elif key.startswith("agl.completion.") and key.endswith(".logprobs"):
            if len(value) % 4:
                raise DecodeError(f"{where}: {len(value)} bytes is not a whole number of float32 logprobs")
            attributes[key] = np.frombuffer(value, dtype="<f4")
    entry = attributes.pop(TABLE_ENTRY_KEY, None)
    if entry is None:
        return
    if semconv.PROMPT_TOKEN_IDS in attributes:
        raise DecodeError(f"span {number}: both {TABLE_ENTRY_KEY} and {semconv.PROMPT_TOKEN_IDS}")
    if type(entry) is not int:
        raise DecodeError(f"span {number}: {TABLE_ENTRY_KEY} must be an int")
    size = len(table) if table is not None else 0
    if not 0 <= entry < size:
        raise DecodeError(f"span {number}: {TABLE_ENTRY_KEY} {entry} names no entry of the request's {TABLE_KEY} ({size} entries)")
    assert table is not None
    attributes[semconv.PROMPT_TOKEN_IDS] = table[entry]


def decode_request(buf: bytes) -> list[RawSpan]:
    """An ExportTraceServiceRequest in either representation -> RawSpans as the contract takes them."""
    spans: list[tuple[RawSpan, list[np.ndarray] | None]] = []
    pending: list = []
    for field, wire_type, resource_spans in _fields(buf, 0, len(buf)):
        if field != 1 or wire_type != 2:
            continue
        for inner, inner_wire, scope_spans in _fields(buf, *resource_spans):
            if inner != 2 or inner_wire != 2:
                continue
            table, mine = None, []
            for item_field, item_wire, item in _fields(buf, *scope_spans):
                if item_field == 1 and item_wire == 2:
                    table = _table(buf, *item)
                elif item_field == 2 and item_wire == 2:
                    mine.append(_span(buf, *item, pending))
            spans += [(span, table) for span in mine]
    _resolve(buf, pending)
    for number, (span, table) in enumerate(spans):
        _token_values(span, number, table)
    return [span for span, _ in spans]
