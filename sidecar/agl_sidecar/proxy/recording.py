"""The engine's answer recorded on the call: token IDs and logprobs typed once, then the fields the
harness did not ask for nulled in the original bytes, so the harness receives what the engine would
have sent it without the sidecar."""

from __future__ import annotations

from typing import Any

import msgspec

from agl import semconv
from agl_sidecar import inputs
from agl_sidecar.calls import wire
from agl_sidecar.proxy.request import CHAT, Flags
from agl_sidecar.calls.switches import SwitchLog
from agl_sidecar.calls.record import CallRecord

# The keys of the values stripped, as wire.member_value finds them (any spacing around the colon).
K_TOKEN_IDS = b'"token_ids":'
K_PROMPT_TOKEN_IDS = b'"prompt_token_ids":'
K_LOGPROBS = b'"logprobs":'
DATA = b"data: "
DONE = b"[DONE]"


def record_usage(call: CallRecord, usage: wire.Usage) -> None:
    """The engine's token counts; a count a span cannot carry (beyond int64) is left out."""
    call.input_tokens = inputs.int64_or_none(usage.prompt_tokens)
    call.output_tokens = inputs.int64_or_none(usage.completion_tokens)

def _record_choice(call: CallRecord, c: Any, flags: Flags, strip: list[tuple[bytes, msgspec.Raw]]) -> None:
    """Record one choice (its token IDs and logprobs as the engine's JSON, decoded off the hot path by
    the span builder); queue what the harness did not ask for."""
    choice = call.choice(c.index)
    choice.finish_reason = c.finish_reason
    choice.token_ids = c.token_ids
    choice.logprobs = c.logprobs
    if not flags.token_ids:
        strip.append((K_TOKEN_IDS, c.token_ids))
    if not flags.logprobs:
        strip.append((K_LOGPROBS, c.logprobs))


def record_unary(kind: str, data: bytes, flags: Flags, call: CallRecord, capture: bool) -> bytes:
    """Record the response's ids, tokens and logprobs on `call`; return the body for the harness.
    Raises msgspec.MsgspecError for a body that is not a completion."""
    try:
        return _record_unary(kind, data, data, flags, call, capture)
    except msgspec.MsgspecError:
        # JSON as Python writes it (`NaN`, `-Infinity` in logprobs): recorded from its strict form;
        # the harness still gets the engine's own spelling, stripped by the slow path.
        readable = wire.tolerant_json(data)
        if readable is None:
            raise
        return _record_unary(kind, readable, data, flags, call, capture)


def _record_unary(kind: str, data: bytes, original: bytes, flags: Flags, call: CallRecord, capture: bool) -> bytes:
    strip: list[tuple[bytes, msgspec.Raw]] = []
    if kind == CHAT:
        parsed = wire.decode_lifted(wire.chat_response, data, "prompt_token_ids")
        prompt_raw = parsed.prompt_token_ids
        if not flags.token_ids:
            strip.append((K_PROMPT_TOKEN_IDS, prompt_raw))
        for c in parsed.choices:
            _record_choice(call, c, flags, strip)
        if capture:
            call.output_messages = msgspec.json.encode(
                [msgspec.json.decode(c.message) for c in parsed.choices]
            ).decode()
    else:
        parsed = wire.completion_response.decode(data)
        prompt_raw = parsed.choices[0].prompt_token_ids if parsed.choices else wire.NULL
        for c in parsed.choices:
            _record_choice(call, c, flags, strip)
            if not flags.token_ids:  # completions carry the prompt's IDs per choice
                strip.append((K_PROMPT_TOKEN_IDS, c.prompt_token_ids))
    call.prompt_ids = None if prompt_raw == wire.NULL else prompt_raw
    call.response_id = parsed.id
    call.response_model = parsed.model
    if parsed.usage is not None:
        record_usage(call, parsed.usage)
    return wire.strip(original, strip, flags.token_ids, flags.logprobs) if strip else original


class StreamRecorder:
    """Assembles token IDs and logprobs from a stream's chunks and strips each event."""

    __slots__ = ("kind", "flags", "call", "_decode", "_seen_version")

    def __init__(self, kind: str, flags: Flags, call: CallRecord) -> None:
        self.kind = kind
        self.flags = flags
        self.call = call
        self._decode = wire.chat_chunk.decode if kind == CHAT else wire.completion_chunk.decode
        self._seen_version = call.policy_version if call.policy_version is not None else -1

    def event(self, event: bytes) -> bytes:
        switches = self.call.switches
        if switches is not None and switches.version > self._seen_version:
            self._mark_switches(switches)
        return self._event(event)

    def _mark_switches(self, switches: SwitchLog) -> None:
        """A drain-free switch happened since the last event: the tokens received so far are the
        older versions' (the sidecar resumes before the engine, so none of the new weights' came)."""
        call = self.call
        first = call.choices.get(0)
        received = len(first.token_ids) if first is not None and isinstance(first.token_ids, list) else 0
        marks = call.switch_marks if call.switch_marks is not None else {}
        for switch in switches.since(self._seen_version):
            marks.setdefault(switch.serial, received)
        call.switch_marks = marks
        self._seen_version = switches.version

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(DATA):
            return self._event_lines(event)
        payload = event[6:]
        if payload == DONE:
            return event
        if self.kind == CHAT:
            fast = self._chat_fast(payload)
            if fast is not None:
                return fast
        try:
            chunk = self._decode(payload)
        except msgspec.MsgspecError:
            return self._event_lines(event) if b"\n" in event else self._unreadable(event, payload)
        return self._chunk(chunk, payload, payload, event)

    def _unreadable(self, event: bytes, payload: bytes) -> bytes:
        """A `data:` payload the typed decoder refused. JSON as Python writes it (`NaN`, `Infinity`,
        `-1e400` in logprobs) is recorded from its strict form, the harness getting the engine's
        spelling. Anything else may have carried tokens the span would then silently lack: the
        call's tokens are marked absent instead (it is not trained on), and the event passed on."""
        readable = wire.tolerant_json(payload)
        if readable is not None:
            try:
                chunk = self._decode(readable)
            except msgspec.MsgspecError:
                pass
            else:
                return self._chunk(chunk, readable, payload, event)
        self.call.tokens_absent = True
        return event

    def _chunk(self, chunk: Any, payload: bytes, original: bytes, event: bytes) -> bytes:
        """Record a decoded chunk (`payload` its bytes) and strip `original`, the event's data."""
        call = self.call
        if chunk.error is not None:
            message = chunk.error.message
            text = message if isinstance(message, str) else ("" if message is None else wire.encode(message).decode())
            call.fail(semconv.END_UPSTREAM_ERROR, "upstream_stream_error", text[:500])
            return event
        if call.response_id is None:
            call.response_id = chunk.id
            call.response_model = chunk.model
        if chunk.usage is not None:
            record_usage(call, chunk.usage)
        strip: list[tuple[bytes, msgspec.Raw]] = []
        flags = self.flags
        if self.kind == CHAT and call.prompt_ids is None and chunk.prompt_token_ids != wire.NULL:
            call.prompt_ids = chunk.prompt_token_ids
        if self.kind == CHAT and not flags.token_ids:
            strip.append((K_PROMPT_TOKEN_IDS, chunk.prompt_token_ids))
        for c in chunk.choices:
            choice = call.choice(c.index)
            if c.finish_reason is not None:
                choice.finish_reason = c.finish_reason
            try:
                ids = wire.token_ids(c.token_ids)
                logprobs = (wire.chat_logprobs if self.kind == CHAT else wire.legacy_logprobs)(c.logprobs)
            except msgspec.MsgspecError:  # not an int array / not logprobs: the span says absent
                call.tokens_absent = True
                ids = logprobs = None
            if ids:
                choice.token_ids += ids
            if self.kind != CHAT:
                if call.prompt_ids is None and c.index == 0 and c.prompt_token_ids != wire.NULL:
                    call.prompt_ids = c.prompt_token_ids
                if not flags.token_ids:
                    strip.append((K_PROMPT_TOKEN_IDS, c.prompt_token_ids))
            if logprobs:
                choice.logprobs += logprobs
            if not flags.token_ids:
                strip.append((K_TOKEN_IDS, c.token_ids))
            if not flags.logprobs:
                strip.append((K_LOGPROBS, c.logprobs))
        if strip:
            return DATA + wire.strip(original, strip, flags.token_ids, flags.logprobs)
        return event


    def _event_lines(self, event: bytes) -> bytes:
        """An event not spelled `data: <one JSON line>` (vLLM's): `data:` without the space, other
        fields (`event:`, `id:`, comments), JSON over several `data:` lines. Its data is handled as
        one `data: ` line; the other lines are kept before it."""
        data: list[bytes] = []
        other: list[bytes] = []
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif line:
                other.append(line)
        if not data:
            return event
        payload = b"\n".join(data)
        if b"\n" in payload:  # JSON written over several lines: one line, as vLLM writes it
            try:
                payload = wire.encode(wire.decode_any(payload))
            except (msgspec.MsgspecError, RecursionError):
                return self._unreadable(event, payload)  # NaN in it, or not JSON: never unrecorded
        return b"\n".join([*other, self._event(DATA + payload)])

    def _chat_fast(self, payload: bytes) -> bytes | None:
        """The common chat chunk (at most one choice) in one typed decode, the values to strip found
        by their keys in any spacing and confirmed against the decoded values. None: use the general
        path. It runs for every token of every stream: vLLM's spelling (each value right after the first
        `"key":`) costs one search a value (wire.first_value_at), anything else goes through value_at."""
        try:
            chunk = wire.decode_lifted(wire.typed_chat_chunk, payload, "prompt_token_ids")
        except msgspec.MsgspecError:
            return None
        choices = chunk.choices
        if chunk.error is not None or len(choices) > 1:
            return None
        call = self.call
        flags = self.flags
        c = choices[0] if choices else None
        # Locate every value to strip before recording anything: on a miss (an escaped key, a value
        # another spelling moved) the general path handles the chunk from scratch.
        cuts: list[tuple[int, int]] = []
        prompt_ids = chunk.prompt_token_ids
        has_prompt = prompt_ids != wire.NULL
        if has_prompt and not flags.token_ids:
            at = wire.first_value_at(payload, K_PROMPT_TOKEN_IDS, prompt_ids)
            if at < 0:
                return None
            cuts.append((at, at + len(prompt_ids)))
        logprobs = None
        if c is not None:
            raw_logprobs = c.logprobs
            if raw_logprobs != wire.NULL:
                if not flags.logprobs:
                    at = wire.first_value_at(payload, K_LOGPROBS, raw_logprobs)
                    if at < 0:
                        return None
                    cuts.append((at, at + len(raw_logprobs)))
                try:
                    logprobs = wire.chat_logprob_values(raw_logprobs)
                except msgspec.MsgspecError:
                    return None  # NaN spelled as Python writes it: the general path reads it
            ids = c.token_ids
            if ids is not None and not flags.token_ids:
                encoded = wire.encode(ids)  # an int array without whitespace, as vLLM writes it
                at = wire.first_value_at(payload, K_TOKEN_IDS, encoded)
                spaced = at < 0  # `[1, 2]`, as other servers write it
                span = _spaced_int_array(payload, K_TOKEN_IDS, encoded) if spaced else (at, at + len(encoded))
                if span is None:
                    return None
                cuts.append(span)
        if len(cuts) > 1 and not wire.disjoint(cuts):
            return None
        if has_prompt and call.prompt_ids is None:
            call.prompt_ids = prompt_ids
        if c is not None:
            choice = call.choice(c.index)
            if c.finish_reason is not None:
                choice.finish_reason = c.finish_reason
            if c.token_ids:
                choice.token_ids += c.token_ids
            if logprobs:
                choice.logprobs += logprobs
        if call.response_id is None:
            call.response_id = chunk.id
            call.response_model = chunk.model
        if chunk.usage is not None:
            record_usage(call, chunk.usage)
        return wire.splice_nulls(payload, cuts, DATA) if cuts else DATA + payload


def _spaced_int_array(payload: bytes, key: bytes, encoded: bytes) -> tuple[int, int] | None:
    """The span of the first member `key` whose value is the int array msgspec encodes as `encoded`,
    written with whitespace (`[1, 2]`), or None: the first `]` ends an int array, and only
    whitespace may differ from `encoded`."""
    for spaced in (False, True):
        begin = wire.member_value(payload, key, 0, spaced)
        while begin >= 0:
            end = payload.find(b"]", begin) + 1
            if end > begin and payload.startswith(b"[", begin):
                if payload[begin:end].translate(None, wire.WS) == encoded:
                    return begin, end
            begin = wire.member_value(payload, key, begin, spaced)
    return None
