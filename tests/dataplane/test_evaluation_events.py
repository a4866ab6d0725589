"""Rewards as the GenAI conventions' *event*: a `gen_ai.evaluation.result` OTLP log record with
agl.rollout.id, sent to the receiver's /v1/logs (HTTP protobuf or JSON, gRPC LogsService) by the real
OpenTelemetry SDK and through a real collector (rotel-agent), lands as a reward of its rollout."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from agl import semconv
from agl_trainer.receiver import Receiver, ReceiverConfig
from agl_trainer.receiver.otlp_logs import decode_logs_json, decode_logs_protobuf
from agl_trainer.receiver.payload import JSON, PROTOBUF, decode_logs_body
from agl_trainer.receiver.wire import DecodeError
from agl_trainer.store import RolloutStore
from agl_trainer.store.records import RolloutKey
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord

from tests.dataplane.otlp import any_value, call_span, request, rollout_span
from tests.dataplane.processes import receive_behind_rotel
from tests.dataplane.test_receiver_fuzz import assert_storable, mutated

T0 = 1_700_000_000_000_000_000
TRACE = bytes(range(16))


def record(
    attributes: dict[str, Any], *, event: str | None = semconv.SPAN_EVALUATION_RESULT, **fields: Any
) -> LogRecord:
    message = LogRecord(
        time_unix_nano=fields.pop("time", T0), trace_id=fields.pop("trace_id", TRACE),
        span_id=fields.pop("span_id", b"\x01" * 8), event_name=event or "", **fields,
    )  # fmt: skip
    message.attributes.extend(KeyValue(key=k, value=any_value(v)) for k, v in attributes.items())
    return message


def logs_request(*records: LogRecord) -> ExportLogsServiceRequest:
    message = ExportLogsServiceRequest()
    scope = message.resource_logs.add().scope_logs.add()
    scope.log_records.extend(records)
    return message


def score(rollout: str, value: float, name: str = "reward", **extra: Any) -> dict[str, Any]:
    return {
        semconv.ROLLOUT_ID: rollout,
        semconv.EVALUATION_NAME: name,
        semconv.EVALUATION_SCORE_VALUE: value,
        **extra,
    }


@pytest.fixture
def receiver(tmp_path: Path):
    with Receiver(tmp_path / "rollouts.db", ReceiverConfig(port=0, grpc_port=0)) as running:
        yield running


def post(
    url: str, body: bytes, content_type: str = "application/x-protobuf", **headers: str
) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/logs", content=body, headers={"content-type": content_type, **headers}, timeout=30
    )


def rewards(receiver: Receiver, rollout: str) -> dict[str, float]:
    """The rollout's final reward of each name it has (rewards may come before its other spans)."""
    with RolloutStore(receiver._store.path, grace_s=0.0) as store:
        rows = store.rewards(RolloutKey(rollout, 0))
        return {row.name: store.final_rewards([rollout], row.name)[RolloutKey(rollout, 0)] for row in rows}


def test_the_otel_sdk_s_evaluation_event_is_a_reward_once(receiver: Receiver) -> None:
    """The real SDK (Logger.emit with event_name, inside a span) exporting OTLP/HTTP protobuf; a log
    record that is not an evaluation is acknowledged and ignored; the same batch again is a duplicate."""
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
    from opentelemetry.sdk.trace import TracerProvider

    class Remembering(OTLPLogExporter):
        batches: ClassVar[list[Any]] = []

        def export(self, batch: Any) -> Any:
            self.batches.append(list(batch))
            return super().export(batch)

    exporter = Remembering(endpoint=f"{receiver.url}/v1/logs")
    provider = LoggerProvider()
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    logger = provider.get_logger("grader")
    tracer = TracerProvider().get_tracer("grader")
    with tracer.start_as_current_span("grade") as grading:
        logger.emit(
            event_name=semconv.SPAN_EVALUATION_RESULT, attributes=score("sdk-1", 0.75, attempt_note="x")
        )
        logger.emit(body="an ordinary log line", attributes={semconv.ROLLOUT_ID: "sdk-1"})
        logger.emit(
            event_name=semconv.SPAN_EVALUATION_RESULT,
            attributes={semconv.ROLLOUT_ID: "sdk-1", semconv.EVALUATION_NAME: "tests",
                        semconv.EVALUATION_SCORE_LABEL: "Passed"},
        )  # fmt: skip
    assert len(exporter.batches) == 3
    assert rewards(receiver, "sdk-1") == {"reward": 0.75, "tests": 1.0}
    stats = receiver.stats()
    assert stats.log_records == 3 and stats.stored == 2 and stats.spans == 2
    with RolloutStore(receiver._store.path, grace_s=0.0) as store:
        assert len(store.span_ids()) == 2
    # sent again (a retry, a collector's resend): the same reward, stored once
    exporter.export(exporter.batches[0])
    assert receiver.stats().duplicates == 1 and receiver.stats().stored == 2
    provider.shutdown()
    assert grading.get_span_context().trace_id.to_bytes(16, "big") != TRACE  # the SDK's own trace


def test_json_spellings_and_the_old_event_name_attribute(receiver: Receiver) -> None:
    """OTLP JSON as exporters write it and as protobuf's JSON parsers also take it (an int64 as a
    number, null fields, the `event.name` attribute instead of eventName); one record of the wrong shape
    is refused alone; the protobuf and JSON forms of one request decode to the same records."""
    message = logs_request(
        record(score("json-1", 0.5), time=T0 + 5),
        record(
            {**score("json-1", 0.25, name="style"), semconv.EVENT_NAME: semconv.SPAN_EVALUATION_RESULT},
            event=None,
        ),
    )
    body = json_format.MessageToDict(message)
    for item in body["resourceLogs"][0]["scopeLogs"][0]["logRecords"]:
        item["traceId"], item["spanId"] = TRACE.hex(), "01" * 8  # OTLP JSON ids are hex
    assert decode_logs_json(json.dumps(body).encode()) == decode_logs_protobuf(message.SerializeToString())
    records = body["resourceLogs"][0]["scopeLogs"][0]["logRecords"]
    records[0]["timeUnixNano"] = T0 + 5  # a number, not the decimal string
    records[0]["observedTimeUnixNano"] = None
    records.append({"eventName": semconv.SPAN_EVALUATION_RESULT, "attributes": {"not": "a list"}})
    records.append({"body": {"stringValue": "someone else's log"}, "attributes": "also wrong"})
    reply = post(receiver.url, json.dumps(body).encode(), "application/json")
    assert reply.status_code == 200, reply.text
    partial = reply.json()["partialSuccess"]
    assert partial["rejectedLogRecords"] == "1" and "span.undecodable" in partial["errorMessage"]
    assert rewards(receiver, "json-1") == {"reward": 0.5, "style": 0.25}
    assert receiver.stats().log_records == 4


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (record(score("bad", float("nan"))), "reward.reward_value_not_finite"),
        (record({semconv.ROLLOUT_ID: "bad", semconv.EVALUATION_SCORE_VALUE: 1.0}),
         "reward.missing_gen_ai_evaluation_name"),
        (record(score("bad", 1.0), trace_id=b"\x01\x02\x03"), "reward.bad_ids"),
        (record({semconv.ROLLOUT_ID: "bad", semconv.EVALUATION_NAME: "r",
                 semconv.EVALUATION_SCORE_LABEL: "meh"}), "reward.evaluation_label_unknown"),
    ],
    ids=["nan", "no-name", "short-trace-id", "unknown-label"],
)  # fmt: skip
def test_bad_evaluation_events_are_named_and_cost_no_other(
    receiver: Receiver, bad: LogRecord, reason: str
) -> None:
    body = logs_request(bad, record(score("good", 1.0))).SerializeToString()
    reply = post(receiver.url, gzip.compress(body), **{"content-encoding": "gzip"})
    assert reply.status_code == 200
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse

    answer = ExportLogsServiceResponse.FromString(reply.content)
    assert answer.partial_success.rejected_log_records == 1 and reason in answer.partial_success.error_message
    assert receiver.stats().violations == {reason: 1}
    assert rewards(receiver, "good") == {"reward": 1.0}


def test_broken_requests_get_a_4xx_that_says_why(receiver: Receiver) -> None:
    whole = logs_request(record(score("r", 1.0))).SerializeToString()
    truncated = post(receiver.url, whole[:-3])
    assert truncated.status_code == 400 and "malformed OTLP payload" in truncated.json()["message"]
    assert post(receiver.url, b"{not json", "application/json").status_code == 400
    assert post(receiver.url, whole, "text/plain").status_code == 415
    assert receiver.stats().stored == 0


def test_logs_need_the_receivers_token_too(tmp_path: Path) -> None:
    """A reward is trained on: with a token configured, /v1/logs refuses a sender without it, as
    /v1/traces does, and stores nothing."""
    body = logs_request(record(score("forged", 1.0))).SerializeToString()
    with Receiver(tmp_path / "rollouts.db", ReceiverConfig(port=0, token="s3cret")) as secured:
        refused = post(secured.url, body)
        assert refused.status_code == 401 and "bearer token" in refused.json()["message"]
        assert post(secured.url, body, authorization="Bearer wrong").status_code == 401
        assert post(secured.url, body, authorization="Bearer s3cret").status_code == 200
        assert secured.stats().stored == 1 and secured.stats().bad_requests == {"401_unauthorized": 2}


def test_grpc_logs_service(receiver: Receiver) -> None:
    """The OTel SDK's gRPC log exporter against the receiver's LogsService."""
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor

    provider = LoggerProvider()
    provider.add_log_record_processor(
        SimpleLogRecordProcessor(OTLPLogExporter(endpoint=receiver.grpc_address, insecure=True))
    )
    provider.get_logger("grader").emit(
        event_name=semconv.SPAN_EVALUATION_RESULT, attributes=score("grpc-1", 0.4)
    )
    provider.shutdown()
    assert rewards(receiver, "grpc-1") == {"reward": 0.4}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_evaluation_event_through_rotel_lands_on_its_rollout(tmp_path: Path, protocol: str) -> None:
    """The SDK's event to a real collector (rotel-agent), exported on to `agl receive` over gRPC or
    HTTP; with the rollout's call and rollout spans (through the same collector), the rollout is ready
    with the evaluation's score as its reward."""
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor

    with receive_behind_rotel(tmp_path, protocol) as receiving:
        spans = request([call_span("evented", 0, [1, 2, 3], [4, 5]), rollout_span("evented")])
        receiving.post_traces(spans.SerializeToString())
        provider = LoggerProvider()
        exporter = OTLPLogExporter(endpoint=f"http://127.0.0.1:{receiving.collector_port}/v1/logs")
        provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
        provider.get_logger("grader").emit(
            event_name=semconv.SPAN_EVALUATION_RESULT,
            attributes=score("evented", 0.6, **{semconv.EVALUATION_EXPLANATION: "3 of 5 tests"}),
        )
        provider.shutdown()
        receiving.wait_stored(3)
        with RolloutStore(receiving.store, grace_s=0.0) as store:
            assert store.load("evented").final_reward("reward") == 0.6
            assert [r.rollout_id for r in store.ready_rollouts()] == ["evented"]
    assert receiving.returncode == 0 and "3 spans stored" in receiving.output


def _logs_or_refuse(body: bytes, media: str) -> list | None:
    try:
        return decode_logs_body(body, media).records
    except DecodeError:
        return None


VALID_LOGS = logs_request(
    record(score("f-1", 0.5)),
    record({**score("f-1", 1.0, name="x"), semconv.TASK_ID: "t", semconv.ATTEMPT: 2}, span_id=b""),
    record({"k": [1, 2, 3]}, event="something.else"),
).SerializeToString()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=1024), mutated(VALID_LOGS)))
def test_any_logs_body_decodes_or_is_refused_and_stores(body: bytes) -> None:
    """Arbitrary bytes and a valid request mutated byte by byte, as protobuf and as JSON: decoded (and
    storable as it is) or refused with DecodeError (a 400); nothing else escapes."""
    for media in (PROTOBUF, JSON):
        records = _logs_or_refuse(body, media)
        if records is not None:
            assert_storable(records)
