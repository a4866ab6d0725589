"""Build agl spans as real opentelemetry-proto messages, the way the sidecar and SDK export them."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from agl import semconv
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def any_value(value: Any) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, dict):
        from opentelemetry.proto.common.v1.common_pb2 import KeyValueList

        return AnyValue(
            kvlist_value=KeyValueList(values=[KeyValue(key=k, value=any_value(v)) for k, v in value.items()])
        )
    return AnyValue(array_value=ArrayValue(values=[any_value(item) for item in value]))


def with_attributes(span: Span, **attributes: Any) -> Span:
    """`span` with attributes set, replacing any of the same name (keys spelled with '__' for '.':
    agl__call__origin)."""
    for key, value in attributes.items():
        name = key.replace("__", ".")
        kept = [kv for kv in span.attributes if kv.key != name]
        del span.attributes[:]
        span.attributes.extend(kept)
        span.attributes.append(KeyValue(key=name, value=any_value(value)))
    return span


def span(
    name: str,
    attributes: dict[str, Any],
    *,
    trace_id: bytes | None = None,
    span_id: bytes | None = None,
    start_ns: int = 1_700_000_000_000_000_000,
    end_ns: int | None = None,
    kind: int = 1,
    status_code: int = 0,
) -> Span:
    result = Span(
        trace_id=trace_id or os.urandom(16),
        span_id=span_id or os.urandom(8),
        name=name,
        kind=kind,
        start_time_unix_nano=start_ns,
        end_time_unix_nano=end_ns if end_ns is not None else start_ns + 1000,
    )
    result.status.code = status_code
    result.attributes.extend(
        KeyValue(key=k, value=any_value(v)) for k, v in attributes.items() if v is not None
    )
    return result


def call_span(
    rollout_id: str,
    seq: int,
    prompt: Sequence[int],
    completion: Sequence[int],
    logprobs: Sequence[float] | None = None,
    *,
    attempt: int = 0,
    task_id: str | None = "task",
    ref: tuple[int, int] | None = None,
    prompt_length: int | None = None,
    version: int | None = 0,
    mode: str | None = "train",
    tokens_source: str = semconv.TOKENS_FROM_ENGINE,
    model: str = "tiny",
    choices: int | None = None,
    **kwargs: Any,
) -> Span:
    """A sidecar call span. With `ref=(call_seq, length)`, `prompt` is the suffix after the reference."""
    if logprobs is None:
        logprobs = [-0.5 - 0.01 * i for i in range(len(completion))]
    attributes: dict[str, Any] = {
        semconv.GEN_AI_OPERATION_NAME: semconv.OPERATION_CHAT,
        semconv.GEN_AI_PROVIDER_NAME: semconv.PROVIDER_VLLM,
        semconv.GEN_AI_REQUEST_MODEL: model,
        semconv.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
        semconv.GEN_AI_USAGE_INPUT_TOKENS: prompt_length if prompt_length is not None else len(prompt),
        semconv.GEN_AI_USAGE_OUTPUT_TOKENS: len(completion),
        semconv.ROLLOUT_ID: rollout_id,
        semconv.TASK_ID: task_id,
        semconv.ATTEMPT: attempt,
        semconv.ROLLOUT_MODE: mode,
        semconv.CALL_SEQ: seq,
        semconv.CALL_END_REASON: semconv.END_COMPLETED,
        semconv.PROMPT_TOKEN_IDS: list(prompt),
        semconv.PROMPT_LENGTH: prompt_length if prompt_length is not None else (None if ref else len(prompt)),
        semconv.COMPLETION_TOKEN_IDS: list(completion),
        semconv.COMPLETION_LOGPROBS: list(logprobs),
        semconv.POLICY_VERSION: version,
        semconv.TOKENS_SOURCE: tokens_source,
        semconv.COMPLETION_CHOICES: choices,
    }
    if ref is not None:
        attributes[semconv.PROMPT_REF_CALL_SEQ], attributes[semconv.PROMPT_REF_LENGTH] = ref
    return span(semconv.call_span_name(semconv.OPERATION_CHAT, model), attributes, kind=3, **kwargs)


def rollout_span(
    rollout_id: str,
    *,
    status: str = semconv.STATUS_SUCCEEDED,
    attempt: int = 0,
    task_id: str | None = "task",
    mode: str = "train",
    **kwargs: Any,
) -> Span:
    return span(
        semconv.SPAN_ROLLOUT,
        {
            semconv.ROLLOUT_ID: rollout_id,
            semconv.TASK_ID: task_id,
            semconv.ATTEMPT: attempt,
            semconv.ROLLOUT_MODE: mode,
            semconv.ROLLOUT_STATUS: status,
        },
        status_code=2 if status == semconv.STATUS_FAILED else 0,
        **kwargs,
    )


def reward_span(
    rollout_id: str,
    value: float,
    *,
    name: str = semconv.DEFAULT_REWARD_NAME,
    call_seq: int | None = None,
    attempt: int | None = 0,
    **kwargs: Any,
) -> Span:
    return span(
        semconv.SPAN_REWARD,
        {
            semconv.ROLLOUT_ID: rollout_id,
            semconv.ATTEMPT: attempt,
            semconv.REWARD_NAME: name,
            semconv.REWARD_VALUE: value,
            semconv.CALL_SEQ: call_seq,
        },
        **kwargs,
    )


def request(spans: Iterable[Span], service: str = "agl-sidecar") -> ExportTraceServiceRequest:
    message = ExportTraceServiceRequest()
    resource_spans = message.resource_spans.add()
    resource_spans.resource.attributes.append(KeyValue(key="service.name", value=any_value(service)))
    scope = resource_spans.scope_spans.add()
    scope.scope.name = semconv.INSTRUMENTATION_SCOPE
    scope.spans.extend(spans)
    return message


def to_otlp_json(message: ExportTraceServiceRequest) -> dict[str, Any]:
    """OTLP JSON: proto3 JSON with hex trace and span IDs (OTLP's one deviation from proto3)."""
    data = json_format.MessageToDict(message)
    for resource_spans in data.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for item in scope_spans.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in item:
                        import base64

                        item[key] = base64.b64decode(item[key]).hex()
    return data
