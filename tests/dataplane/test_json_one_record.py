"""OTLP JSON (`/v1/traces`, `/v1/logs`): a string the JSON parser refuses (a lone surrogate escape, as a
JavaScript harness writes a message cut inside an emoji) or values nested past the parser's depth cost
only the record that holds them, as in protobuf: the good records beside it are stored, and the
answer's partialSuccess says what was refused. Before, either refused the whole request with 400."""

from __future__ import annotations

import json

import httpx
import pytest
from agl import semconv

from tests.dataplane.hostile import nested_json_array, nested_json_kvlist
from tests.dataplane.test_evaluation_events import logs_request, record, rewards, score
from tests.dataplane.test_hostile_input import JSON, json_body, json_call, post, rejected

LONE = "\\ud83d"  # the first half of an emoji's surrogate pair, alone (JSON text, not a Python escape)


def _with(text: str, marker: str, value: str) -> bytes:
    return text.replace(f'"{marker}"', value).encode()


@pytest.mark.parametrize(
    ("attribute", "value"),
    [
        ("gen_ai.input.messages", f'{{"stringValue": "[{{\\"content\\": \\"cut here {LONE}\\"}}]"}}'),
        ("harness.note", f'{{"stringValue": "{LONE}\\udc00 {LONE}"}}'),  # a good pair, then a lone half
        ("harness.deep", nested_json_kvlist(400)),  # past the parser's ~350 levels
        ("harness.deeper", nested_json_array(5000)),
    ],
)
def test_a_value_agl_does_not_read_costs_nothing(receiver, store, attribute, value):
    bad = json_call("odd", **{attribute: "@"})
    text = json_body(json_call("good-1"), bad, json_call("good-2")).decode()
    reply = post(receiver, _with(text, "@", value), JSON)
    assert reply.status_code == 200, reply.text
    assert rejected(reply)[0] == 0
    for rollout in ("good-1", "odd", "good-2"):
        assert len(store.load(rollout).calls) == 1


@pytest.mark.parametrize(
    ("overrides", "value", "reason"),
    [
        ({semconv.ROLLOUT_ID: "@"}, f'{{"stringValue": "r{LONE}"}}', "call.rollout_id_malformed"),
        ({semconv.ROLLOUT_ID: "@"}, nested_json_kvlist(400), "call.rollout_id_nesting_too_deep"),
        ({semconv.PROMPT_TOKEN_IDS: "@"}, nested_json_array(3000), "call.prompt_token_ids_nesting_too_deep"),
        ({semconv.ROLLOUT_ID: "@"}, nested_json_array(3000), "call.rollout_id_nesting_too_deep"),  # was a 400
        ({semconv.ROLLOUT_ID: "@"}, nested_json_kvlist(3000), "call.rollout_id_nesting_too_deep"),
        ({"name": "@"}, f'"chat {LONE}"', "call.name_not_utf8"),
        ({"spanId": "@"}, f'"{LONE}"', "call.bad_ids"),
    ],
)
def test_a_value_agl_reads_costs_its_span_only(receiver, store, overrides, value, reason):
    text = json_body(json_call("good-1"), json_call("bad", **overrides), json_call("good-2")).decode()
    reply = post(receiver, _with(text, "@", value), JSON)
    assert reply.status_code == 200, reply.text
    count, message = rejected(reply)
    assert count == 1 and reason in message, message
    assert receiver.stats().violations == {reason: 1}
    assert len(store.load("good-1").calls) == 1 and len(store.load("good-2").calls) == 1
    assert store.rollout("bad") is None


def test_a_span_the_parser_cannot_read_at_all_costs_only_itself(receiver, store):
    # Deeper than any decoder's recursion inside a field agl reads whole (the span's status): the span
    # is undecodable; the spans around it are stored.
    text = json_body(json_call("good-1"), json_call("bad", status="@"), json_call("good-2")).decode()
    reply = post(receiver, _with(text, "@", '{"code": 0, "message": ' + nested_json_array(5000) + "}"), JSON)
    assert reply.status_code == 200, reply.text
    assert rejected(reply)[0] == 1 and receiver.stats().violations == {"span.undecodable": 1}
    assert len(store.load("good-1").calls) == 1 and len(store.load("good-2").calls) == 1


@pytest.mark.parametrize(
    "body",
    [
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [' + b"[" * 100_000,  # never closed
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "x"}}]}]}',  # a bracket that does not match
        b'{"resourceSpans": "\\ud83d"}',  # the frame itself
    ],
)
def test_a_request_whose_frame_is_broken_is_still_a_400(receiver, body):
    reply = post(receiver, body, JSON)
    assert reply.status_code == 400 and "invalid OTLP JSON" in reply.json()["message"]


def test_an_evaluation_record_with_a_lone_surrogate_costs_only_itself(tmp_path):
    from google.protobuf import json_format

    from agl_trainer.receiver import Receiver, ReceiverConfig

    with Receiver(tmp_path / "rollouts.db", ReceiverConfig(port=0)) as receiver:
        message = logs_request(record(score("logs-1", 0.5)), record(score("logs-2", 0.25)),
                               record(score("logs-3", 1.0)))  # fmt: skip
        body = json_format.MessageToDict(message)
        records = body["resourceLogs"][0]["scopeLogs"][0]["logRecords"]
        records[0]["attributes"].append({"key": "gen_ai.evaluation.explanation", "value": {"stringValue": "@1"}})
        records[1]["attributes"] = [kv for kv in records[1]["attributes"] if kv["key"] != semconv.ROLLOUT_ID]
        records[1]["attributes"].append({"key": semconv.ROLLOUT_ID, "value": {"stringValue": "@2"}})
        records[2]["attributes"].append({"key": "deep", "value": "@3"})
        text = json.dumps(body).replace('"@1"', f'"good {LONE} cut"').replace('"@2"', f'"logs-{LONE}"')
        text = text.replace('"@3"', nested_json_kvlist(400))
        reply = httpx.post(f"{receiver.url}/v1/logs", content=text.encode(),
                           headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
        assert reply.status_code == 200, reply.text
        partial = reply.json()["partialSuccess"]
        assert partial["rejectedLogRecords"] == "1" and "reward.rollout_id_malformed" in partial["errorMessage"]
        assert rewards(receiver, "logs-1") == {"reward": 0.5} and rewards(receiver, "logs-3") == {"reward": 1.0}
