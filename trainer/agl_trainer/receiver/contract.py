"""`RawSpan` -> the typed records the store keeps, checking the span contract (docs/spans.md).

A span that breaks the contract becomes a `Violation` with a stable reason string; it is counted
and kept (as a reason row), never raised. Spans that are not agl's (a harness's own spans sharing
the pipeline) are `foreign` and ignored.

Everything a record carries into the store is range-checked here, before any transaction, so no
value can fail a commit (SQLite INTEGER is int64; token arrays are int32): agl ints must be in
[0, 2^63), token IDs in [0, 2^31), the status code in [0, 2^31); an attribute the decoder could not
read (wire.BadValue) is a violation named after the attribute. Times are OTLP fixed64: one above
2^63 - 1 (legal on the wire, centuries away) is clamped to 2^63 - 1 rather than refused, so a
sender's broken clock costs no training data; a time that is not a fixed64 at all (negative, over
2^64 - 1, not a number in JSON) is a violation (`bad_time`).The sidecar's account of a call (agl.call.held_ms, .upstream, .api) is for display: bounded, with
no control characters, and like any other attribute a bad value refuses its span, named after it.
The fields a translating front did not interpret (agl.request.fields.*) are lists whose length the
harness's request decides: a bad or excess entry is left out alone (`field_list`), never the span.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from agl import semconv

from agl_trainer.receiver.wire import UINT64_MAX, BadValue, RawSpan
from agl_trainer.store.records import COMPACTED, CONTEXT_EDITED, CallSpan, Record, RewardSpan, RolloutSpan, Violation

TOKEN_ID_MAX = 2**31 - 1  # token arrays are stored as int32
INT64_MAX = semconv.INT64_MAX  # also SQLite INTEGER's
STATUS_CODE_MAX = 2**31 - 1  # an OTLP enum is an int32
# The sidecar's attribution is for display: bounded so a sender cannot park megabytes in every row.
# agl.call.api takes any string (another sidecar may speak a protocol agl's API_* does not name).
UPSTREAM_MAX_CHARS = 2048  # a replica's URL
API_MAX_CHARS = 128
# agl.request.fields.dropped / .passed ("<JSON path>: <why>" each) are for display too, and a
# harness's request decides how long they are: kept up to these bounds, the rest left out and
# counted in a last entry (field_list): a bad entry costs itself, never its call's span.
FIELD_LIST_MAX_ENTRIES = 128
FIELD_ENTRY_MAX_CHARS = 512


class ContractError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _is_call(span: RawSpan) -> bool:
    attributes = span.attributes
    return semconv.GEN_AI_OPERATION_NAME in attributes and (
        semconv.ROLLOUT_ID in attributes
        or semconv.CALL_SEQ in attributes
        or semconv.PROMPT_TOKEN_IDS in attributes
        or semconv.TOKENS_SOURCE in attributes
    )


def classify(span: RawSpan) -> Record | None:
    """The record for an agl span, a Violation when it breaks the contract, None when foreign."""
    if span.problem is not None:
        return _undecodable(span)
    if span.name == semconv.SPAN_ROLLOUT:
        build: Any = _rollout
        prefix = "rollout"
    elif span.name == semconv.SPAN_REWARD:
        build, prefix = _reward, "reward"
    elif span.name == semconv.SPAN_EVALUATION_RESULT:
        if semconv.ROLLOUT_ID not in span.attributes:
            return None  # an evaluation of something agl did not run (no rollout to give it to)
        build, prefix = _evaluation, "reward"
    elif _is_call(span):
        build, prefix = _call, "call"
    else:
        return None
    rollout_id = span.attributes.get(semconv.ROLLOUT_ID)
    try:
        if len(span.trace_id) != 16 or len(span.span_id) != 8:
            raise ContractError("bad_ids")
        if not 0 <= span.status_code <= STATUS_CODE_MAX:
            raise ContractError("status_code_out_of_range")
        if not span.name.isascii() and not _storable(span.name):
            raise ContractError("name_not_utf8")
        return build(span)
    except ContractError as error:
        return Violation(
            span.trace_id,
            span.span_id,
            span.name if _storable(span.name) else "",
            f"{prefix}.{error.reason}",
            _kept_id(rollout_id),
        )


def _kept_id(rollout_id: object) -> str | None:
    """A violation's rollout id as its row keeps it: none when it is not one a rollout may have."""
    if isinstance(rollout_id, str) and len(rollout_id) <= semconv.ROLLOUT_ID_MAX_CHARS and _storable(rollout_id):
        return rollout_id
    return None


def _undecodable(span: RawSpan) -> Violation:
    """A span whose own bytes were broken (wire.RawSpan.problem): whatever it was, it is refused."""
    rollout_id = span.attributes.get(semconv.ROLLOUT_ID)
    return Violation(
        span.trace_id,
        span.span_id,
        "",
        "span.undecodable",
        _kept_id(rollout_id),
    )


def _storable(text: str) -> bool:
    """Whether SQLite can take the string (a JSON string may hold a lone surrogate; UTF-8 cannot)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _text(value: str, name: str) -> str:
    if not _storable(value):
        raise ContractError(f"{name}_not_utf8")
    return value


def _time(value: int) -> int:
    """An OTLP fixed64 time as SQLite's int64: clamped above 2^63 - 1, refused when not a fixed64."""
    if not 0 <= value <= UINT64_MAX:
        raise ContractError("bad_time")
    return min(value, INT64_MAX)


def _attribute_name(key: str) -> str:
    return key.replace("agl.", "").replace(".", "_")


def _str(attributes: dict[str, Any], key: str, required: bool = False) -> str | None:
    value = attributes.get(key)
    if value is None or (type(value) is str and not value):  # `== ""` on a numpy array raises
        if required:
            raise ContractError(f"missing_{_attribute_name(key)}")
        return None
    if type(value) is BadValue:
        raise ContractError(f"{_attribute_name(key)}_{value.reason}")
    if not isinstance(value, str):
        raise ContractError(f"{_attribute_name(key)}_not_string")
    if not value.isascii() and not _storable(value):
        raise ContractError(f"{_attribute_name(key)}_not_utf8")
    return value


def _id(attributes: dict[str, Any], key: str, required: bool = False) -> str | None:
    """agl.rollout.id / agl.task.id: text of at most ROLLOUT_ID_MAX_CHARS characters (docs/spans.md):
    an id is in every row of its rollout, so a megabyte one would be stored a thousand times."""
    value = _str(attributes, key, required)
    if value is not None and len(value) > semconv.ROLLOUT_ID_MAX_CHARS:
        raise ContractError(f"{_attribute_name(key)}_too_long")
    return value


def _int(attributes: dict[str, Any], key: str, required: bool = False) -> int | None:
    value = attributes.get(key)
    name = _attribute_name(key)
    if type(value) is BadValue:
        raise ContractError(f"{name}_{value.reason}")
    if value is None:
        if required:
            raise ContractError(f"missing_{name}")
        return None
    if isinstance(value, str):  # tolerated: some exporters stringify ints
        try:
            value = int(value)
        except ValueError:
            raise ContractError(f"{name}_not_int") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContractError(f"{name}_not_int")
    if value < 0:
        raise ContractError(f"{name}_negative")
    if value > INT64_MAX:
        raise ContractError(f"{name}_out_of_range")
    return value


def _label(attributes: dict[str, Any], key: str, limit: int) -> str | None:
    """A short display string (the sidecar's attribution): at most `limit` characters, no control
    characters (C0, DEL, C1): a replica or protocol name has none, and one that does is broken."""
    value = _str(attributes, key)
    if value is None:
        return None
    if len(value) > limit:
        raise ContractError(f"{_attribute_name(key)}_too_long")
    if not _printable_label(value):
        raise ContractError(f"{_attribute_name(key)}_control_character")
    return value


def _printable_label(value: str) -> bool:
    return value.isprintable() or not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in value)


def field_list(attributes: dict[str, Any], key: str) -> tuple[str, ...]:
    """agl.request.fields.dropped or .passed: a string array kept entry by entry. An entry that is
    not a string, is longer than FIELD_ENTRY_MAX_CHARS, holds a control character or cannot be
    stored, and every entry past FIELD_LIST_MAX_ENTRIES, is left out, and a last entry says how many
    were; a value that is not an array is one such entry. The call's span is stored either way."""
    value = attributes.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):  # a string, a number array, an undecodable value
        return (f"...: the sender's value was not a string array ({_kind(value)}), left out by the receiver",)
    kept: list[str] = []
    for entry in value:
        if len(kept) == FIELD_LIST_MAX_ENTRIES:
            break
        if (
            isinstance(entry, str)
            and len(entry) <= FIELD_ENTRY_MAX_CHARS
            and _printable_label(entry)
            and (entry.isascii() or _storable(entry))
        ):
            kept.append(entry)
    left_out = len(value) - len(kept)
    if left_out:
        kept.append(
            f"...: {left_out} more entr{'y' if left_out == 1 else 'ies'} left out by the receiver (it keeps"
            f" {FIELD_LIST_MAX_ENTRIES} strings of at most {FIELD_ENTRY_MAX_CHARS} printable characters)"
        )
    return tuple(kept)


def _kind(value: Any) -> str:
    return value.reason if type(value) is BadValue else type(value).__name__


def _end_reason(attributes: dict[str, Any]) -> str | None:
    """agl.call.end_reason; a completed call whose span a killed sidecar recovered without proof
    that its last bytes went out (agl.call.delivery = unknown) ends in `delivery_unknown`."""
    reason = _str(attributes, semconv.CALL_END_REASON)
    delivery = _str(attributes, semconv.CALL_DELIVERY)
    if delivery == semconv.DELIVERY_UNKNOWN and reason in (None, semconv.END_COMPLETED):
        return semconv.END_DELIVERY_UNKNOWN
    return reason


def _held_ms(attributes: dict[str, Any]) -> float | None:
    """agl.call.held_ms: a finite double >= 0 (an int is taken too)."""
    value = attributes.get(semconv.CALL_HELD_MS)
    name = _attribute_name(semconv.CALL_HELD_MS)
    if value is None:
        return None
    if type(value) is BadValue:
        raise ContractError(f"{name}_{value.reason}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ContractError(f"{name}_not_number")
    held = float(value)  # an int64 always converts
    if not math.isfinite(held):
        raise ContractError(f"{name}_not_finite")
    if held < 0:
        raise ContractError(f"{name}_negative")
    return held


def _mode(attributes: dict[str, Any]) -> str | None:
    mode = _str(attributes, semconv.ROLLOUT_MODE)
    if mode is not None and mode not in semconv.MODES:
        raise ContractError("bad_mode")
    return mode


def _token_array(attributes: dict[str, Any], key: str, reason: str) -> np.ndarray | None:
    value = attributes.get(key)
    if value is None:
        return None
    if type(value) is BadValue:
        raise ContractError(f"{reason}_{value.reason}")
    if isinstance(value, list) and not value:
        return np.empty(0, dtype=np.int32)
    if not isinstance(value, np.ndarray) or value.dtype.kind != "i":
        raise ContractError(f"{reason}_not_int_array")
    if value.dtype == np.int32:  # decode_int_arrays gives int32 only when every value is in [0, 2^31)
        return value
    if value.size and (value.min() < 0 or value.max() > TOKEN_ID_MAX):
        raise ContractError(f"{reason}_out_of_range")
    return value.astype(np.int32)


def _policy_versions(
    attributes: dict[str, Any], completion: np.ndarray | None, entry_version: int | None
) -> np.ndarray | None:
    """agl.completion.policy_versions: [start, version, ...] pairs, starts strictly increasing from
    0 and inside the completion, versions int64 >= 0, non-decreasing from the call's entry version
    (agl.policy.version: weights only move forward while a call is in flight)."""
    value = attributes.get(semconv.COMPLETION_POLICY_VERSIONS)
    if value is None:
        return None
    if type(value) is BadValue:
        raise ContractError(f"policy_versions_{value.reason}")
    if not isinstance(value, np.ndarray) or value.dtype.kind != "i" or value.size == 0 or value.size % 2:
        raise ContractError("policy_versions_not_int_pairs")
    runs = value.astype(np.int64)
    starts, versions = runs[0::2], runs[1::2]
    if starts[0] != 0 or (starts.size > 1 and bool(np.any(np.diff(starts) <= 0))):
        raise ContractError("policy_versions_starts_not_increasing_from_0")
    if completion is None or int(starts[-1]) >= completion.size:
        raise ContractError("policy_versions_start_outside_completion")
    if int(versions.min()) < 0:
        raise ContractError("policy_versions_negative")
    if versions.size > 1 and bool(np.any(np.diff(versions) < 0)):
        raise ContractError("policy_versions_decreasing")
    if entry_version is not None and int(versions[0]) != entry_version:
        raise ContractError("policy_versions_not_from_entry_version")
    return runs


def _call(span: RawSpan) -> CallSpan:
    attributes = span.attributes
    rollout_id = _id(attributes, semconv.ROLLOUT_ID, required=True)
    call_seq = _int(attributes, semconv.CALL_SEQ, required=True)
    prompt = _token_array(attributes, semconv.PROMPT_TOKEN_IDS, "prompt_token_ids")
    completion = _token_array(attributes, semconv.COMPLETION_TOKEN_IDS, "completion_token_ids")
    logprobs = attributes.get(semconv.COMPLETION_LOGPROBS)
    if type(logprobs) is BadValue:
        raise ContractError(f"logprobs_{logprobs.reason}")
    if logprobs is not None:
        if isinstance(logprobs, list) and not logprobs:
            logprobs = np.empty(0, dtype=np.float64)
        if not isinstance(logprobs, np.ndarray):
            raise ContractError("logprobs_not_double_array")
        if completion is None or logprobs.size != completion.size:
            raise ContractError("logprobs_length_mismatch")
        logprobs = logprobs.astype(np.float32)
        if np.isnan(logprobs).any():
            # An engine's NaN (Python's json writes it; a null logprob is recorded as one) would make
            # the token's importance weight NaN and poison the loss: the call is kept, its logprobs
            # are not (assembly then counts it logprobs_missing). -inf is a usable value (weight capped).
            logprobs = None
    ref_seq = _int(attributes, semconv.PROMPT_REF_CALL_SEQ)
    ref_length = _int(attributes, semconv.PROMPT_REF_LENGTH)
    if (ref_seq is None) != (ref_length is None):
        raise ContractError("prompt_ref_incomplete")
    if ref_seq is not None and ref_seq >= call_seq:
        raise ContractError("prompt_ref_not_earlier")
    reasons = attributes.get(semconv.GEN_AI_RESPONSE_FINISH_REASONS)
    first = reasons[0] if isinstance(reasons, list) and reasons else None
    finish = first if isinstance(first, str) and _storable(first) else None
    origin = _str(attributes, semconv.CALL_ORIGIN)
    if origin is not None and origin not in semconv.ORIGINS:
        raise ContractError("bad_origin")
    parent = span.parent_span_id
    if parent and len(parent) != 8:
        raise ContractError("bad_ids")
    policy_version = _int(attributes, semconv.POLICY_VERSION)
    return CallSpan(
        trace_id=span.trace_id,
        span_id=span.span_id,
        rollout_id=rollout_id,  # type: ignore[arg-type]
        attempt=_int(attributes, semconv.ATTEMPT) or 0,
        task_id=_id(attributes, semconv.TASK_ID),
        mode=_mode(attributes),
        call_seq=call_seq,  # type: ignore[arg-type]
        name=span.name,
        start_ns=span.start_ns if 0 <= span.start_ns <= INT64_MAX else _time(span.start_ns),
        end_ns=span.end_ns if 0 <= span.end_ns <= INT64_MAX else _time(span.end_ns),
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=logprobs,
        prompt_ref_seq=ref_seq,
        prompt_ref_length=ref_length,
        prompt_length=_int(attributes, semconv.PROMPT_LENGTH),
        policy_version=policy_version,
        policy_versions=_policy_versions(attributes, completion, policy_version),
        finish_reason=finish,
        end_reason=_end_reason(attributes),
        tokens_source=_str(attributes, semconv.TOKENS_SOURCE),
        choices=_int(attributes, semconv.COMPLETION_CHOICES) or 1,
        status_code=span.status_code,
        origin=origin,
        parent_span_id=parent or None,
        held_ms=_held_ms(attributes),
        upstream=_label(attributes, semconv.CALL_UPSTREAM, UPSTREAM_MAX_CHARS),
        api=_label(attributes, semconv.CALL_API, API_MAX_CHARS),
        agent_id=_label(attributes, semconv.CALL_AGENT_ID, semconv.AGENT_ID_MAX_CHARS),
        parent_agent_id=_label(attributes, semconv.CALL_PARENT_AGENT_ID, semconv.AGENT_ID_MAX_CHARS),
        compaction=_declared_context(attributes),
        fields_dropped=field_list(attributes, semconv.REQUEST_FIELDS_DROPPED),
        fields_passed=field_list(attributes, semconv.REQUEST_FIELDS_PASSED),
    )


def _declared_context(attributes: dict[str, Any]) -> int | None:
    """CallRow.compaction: 1 for a declared compaction, 2 for a prompt the sidecar edited (its
    agl.call.context_edits, a list of strings), else None."""
    if attributes.get(semconv.CALL_COMPACTION) is True:
        return COMPACTED
    edits = attributes.get(semconv.CALL_CONTEXT_EDITS)
    if isinstance(edits, list) and edits and all(isinstance(e, str) for e in edits):
        return CONTEXT_EDITED
    return None


def _rollout(span: RawSpan) -> RolloutSpan:
    attributes = span.attributes
    status = _str(attributes, semconv.ROLLOUT_STATUS)
    if status is not None and status not in (semconv.STATUS_SUCCEEDED, semconv.STATUS_FAILED):
        raise ContractError("bad_status")
    if status is None and span.status_code == 2:
        status = semconv.STATUS_FAILED
    return RolloutSpan(
        trace_id=span.trace_id,
        span_id=span.span_id,
        rollout_id=_id(attributes, semconv.ROLLOUT_ID, required=True),  # type: ignore[arg-type]
        attempt=_int(attributes, semconv.ATTEMPT) or 0,
        task_id=_id(attributes, semconv.TASK_ID),
        mode=_mode(attributes),
        status=status,
        start_ns=_time(span.start_ns),
        end_ns=_time(span.end_ns),
        error=_text(span.status_message, "status_message") or None,
    )


def _reward(span: RawSpan) -> RewardSpan:
    name = _str(span.attributes, semconv.REWARD_NAME) or semconv.DEFAULT_REWARD_NAME
    return _reward_record(span, span.attributes.get(semconv.REWARD_VALUE), name)


def _evaluation(span: RawSpan) -> RewardSpan:
    """A gen_ai.evaluation.result span as a reward named by gen_ai.evaluation.name: its score, else
    its label as semconv.EVALUATION_LABELS maps it (another label without a score is refused)."""
    attributes = span.attributes
    name = _str(attributes, semconv.EVALUATION_NAME, required=True)
    value = attributes.get(semconv.EVALUATION_SCORE_VALUE)
    if value is None:
        label = _str(attributes, semconv.EVALUATION_SCORE_LABEL)
        if label is None:
            raise ContractError("missing_reward_value")
        value = semconv.EVALUATION_LABELS.get(label.strip().lower())
        if value is None:
            raise ContractError("evaluation_label_unknown")
    return _reward_record(span, value, name)  # type: ignore[arg-type]


def _reward_record(span: RawSpan, value: Any, name: str) -> RewardSpan:
    attributes = span.attributes
    if value is None:
        raise ContractError("missing_reward_value")
    if type(value) is BadValue:
        raise ContractError(f"reward_value_{value.reason}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ContractError("reward_value_not_number")
    if not math.isfinite(float(value)):  # an int64 always converts
        raise ContractError("reward_value_not_finite")
    return RewardSpan(
        trace_id=span.trace_id,
        span_id=span.span_id,
        rollout_id=_id(attributes, semconv.ROLLOUT_ID, required=True),  # type: ignore[arg-type]
        attempt=_int(attributes, semconv.ATTEMPT),
        task_id=_id(attributes, semconv.TASK_ID),
        name=name,
        value=float(value),
        call_seq=_int(attributes, semconv.CALL_SEQ),
        end_ns=_time(span.end_ns),
    )
