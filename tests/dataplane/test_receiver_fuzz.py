"""Properties of the receiver's OTLP decoding under arbitrary and hostile input (hypothesis).

- Any body, protobuf or JSON (random bytes, valid requests mutated byte by byte), either decodes
  or is refused with DecodeError (400); nothing else escapes, and whatever decodes can be written
  to the store as it is (every range decided before the transaction: no `store_rejected`).
- A valid span next to one carrying any hostile value (an int of any size at any agl key, nesting
  past the bound, invalid UTF-8, bad base64, times of any size) is always stored; the bad one is a
  violation of its own.
- A valid request spelled differently (JSON ints as numbers or strings, enum names, base64 or hex
  ids, unknown fields, fields in another order) decodes to exactly the records of its protobuf.
- Over real HTTP, none of these bodies gets a 5xx.
"""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import httpx
from agl import semconv
from agl_trainer.receiver import Receiver, ReceiverConfig
from agl_trainer.receiver.contract import Violation
from agl_trainer.receiver.payload import JSON, PROTOBUF, decode_body
from agl_trainer.receiver.wire import DecodeError
from agl_trainer.store import RolloutStore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.dataplane.hostile import export_request, field, int_value, nested_array, nested_kvlist, with_attribute
from tests.dataplane.otlp import call_span, request, reward_span, rollout_span, to_otlp_json

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
AGL_INT_KEYS = [
    semconv.CALL_SEQ,
    semconv.ATTEMPT,
    semconv.POLICY_VERSION,
    semconv.PROMPT_LENGTH,
    semconv.PROMPT_REF_CALL_SEQ,
    semconv.COMPLETION_CHOICES,
]
AGL_KEYS = AGL_INT_KEYS + [
    semconv.ROLLOUT_ID,
    semconv.TASK_ID,
    semconv.ROLLOUT_MODE,
    semconv.PROMPT_TOKEN_IDS,
    semconv.COMPLETION_TOKEN_IDS,
    semconv.COMPLETION_LOGPROBS,
    semconv.REWARD_VALUE,
]


def valid_request(tag: str = "v") -> bytes:
    spans = [
        call_span(f"{tag}-a", 0, [1, 2, 3], [4, 5]),
        call_span(f"{tag}-a", 1, [1, 2, 3, 4, 5, 6], [7], ref=None),
        reward_span(f"{tag}-a", 0.5),
        rollout_span(f"{tag}-a"),
        call_span(f"{tag}-b", 0, list(range(300)), [1]),
    ]
    return request(spans).SerializeToString()


VALID = valid_request()
VALID_JSON = json.dumps(to_otlp_json(request([call_span("j", 0, [1, 2], [3]), reward_span("j", 1.0)]))).encode()


def decode_or_refuse(body: bytes, media: str) -> list | None:
    """The records, or None when refused with DecodeError; any other exception fails the test."""
    try:
        return decode_body(body, media).records
    except DecodeError:
        return None


def assert_storable(records: list) -> None:
    with RolloutStore(":memory:") as store:
        [result] = store.write_batches([records])
    assert "store_rejected" not in result.violations, records


@st.composite
def mutated(draw, original: bytes) -> bytes:
    data = bytearray(original)
    for _ in range(draw(st.integers(min_value=1, max_value=8))):
        how = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        at = draw(st.integers(min_value=0, max_value=max(0, len(data) - 1)))
        if how == "flip" and data:
            data[at] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif how == "set" and data:
            data[at] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x18, 0x2A]))
        elif how == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=12))
        elif how == "delete" and data:
            del data[at : at + draw(st.integers(min_value=1, max_value=12))]
        elif how == "truncate":
            del data[at:]
    return bytes(data)


@FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_decode_or_are_refused(body):
    for media in (PROTOBUF, JSON):
        records = decode_or_refuse(body, media)
        if records is not None:
            assert_storable(records)


@FUZZ
@given(mutated(VALID))
def test_mutated_protobuf_decodes_or_is_refused_and_stores(body):
    records = decode_or_refuse(body, PROTOBUF)
    if records is not None:
        assert_storable(records)


@FUZZ
@given(mutated(VALID_JSON))
def test_mutated_json_decodes_or_is_refused_and_stores(body):
    records = decode_or_refuse(body, JSON)
    if records is not None:
        assert_storable(records)


# --- a hostile span never costs its neighbour ---------------------------------------------------------

any_int = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64 + 10),
    st.integers(min_value=0, max_value=2**80),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**22, -1, 2**31, 2**31 - 1]),
)


@st.composite
def hostile_protobuf_value(draw) -> bytes:
    """An AnyValue as bytes that no honest exporter writes, or writes only at the edge of range."""
    kind = draw(st.sampled_from(["int", "ints", "deep_array", "deep_kvlist", "utf8", "garbage"]))
    if kind == "int":
        return int_value(draw(any_int) % 2**80)
    if kind == "ints":
        values = draw(st.lists(st.integers(min_value=0, max_value=2**80), min_size=1, max_size=5))
        return field(5, b"".join(field(1, int_value(v)) for v in values))
    if kind == "deep_array":
        return nested_array(draw(st.integers(min_value=30, max_value=2000)))
    if kind == "deep_kvlist":
        return nested_kvlist(draw(st.integers(min_value=30, max_value=2000)))
    if kind == "utf8":
        return field(1, draw(st.binary(min_size=1, max_size=8)).replace(b"a", b"\xff"))
    return draw(st.binary(max_size=24))


@FUZZ
@given(st.sampled_from(AGL_KEYS), hostile_protobuf_value(), st.booleans())
def test_a_hostile_protobuf_span_never_costs_its_neighbour(key, value, bad_first):
    good = call_span("good", 0, [1, 2], [3]).SerializeToString()
    bad = with_attribute(call_span("bad", 0, [1, 2], [3]), key, value)
    records = decode_body(export_request(*((bad, good) if bad_first else (good, bad))), PROTOBUF).records
    with RolloutStore(":memory:") as store:
        [result] = store.write_batches([records])
        assert "store_rejected" not in result.violations
        assert [call.completion_ids.tolist() for call in store.load("good").calls] == [[3]]


@st.composite
def hostile_json_span(draw) -> dict:
    item = to_otlp_json(request([call_span("bad", 0, [1, 2], [3])]))["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    where = draw(st.sampled_from(["attribute", "ints", "time", "status", "id", "bytes"]))
    if where == "attribute":
        key = draw(st.sampled_from(AGL_KEYS))
        value: Any = {"intValue": draw(st.one_of(any_int, any_int.map(str), st.text(max_size=5)))}
        item["attributes"].append({"key": key, "value": value})
    elif where == "ints":
        values = draw(st.lists(any_int, min_size=1, max_size=4))
        key = draw(st.sampled_from([semconv.PROMPT_TOKEN_IDS, semconv.COMPLETION_TOKEN_IDS]))
        item["attributes"].append({"key": key, "value": {"arrayValue": {"values": [{"intValue": v} for v in values]}}})
    elif where == "time":
        item[draw(st.sampled_from(["startTimeUnixNano", "endTimeUnixNano"]))] = draw(
            st.one_of(any_int, any_int.map(str), st.text(max_size=5))
        )
    elif where == "status":
        item["status"] = {"code": draw(st.one_of(any_int, st.text(max_size=5)))}
    elif where == "id":
        item[draw(st.sampled_from(["traceId", "spanId"]))] = draw(st.text(max_size=40))
    else:
        item["attributes"].append({"key": semconv.ROLLOUT_ID, "value": {"bytesValue": draw(st.text(max_size=12))}})
    return item


@FUZZ
@given(hostile_json_span(), st.booleans())
def test_a_hostile_json_span_never_costs_its_neighbour(bad, bad_first):
    good = to_otlp_json(request([call_span("good", 0, [1, 2], [3])]))["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    spans = [bad, good] if bad_first else [good, bad]
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}).encode()
    records = decode_body(body, JSON).records
    with RolloutStore(":memory:") as store:
        [result] = store.write_batches([records])
        assert "store_rejected" not in result.violations
        assert [call.completion_ids.tolist() for call in store.load("good").calls] == [[3]]


# --- valid requests spelled differently -------------------------------------------------------------


def respell(value: Any, rng: random.Random) -> Any:
    """The same OTLP JSON, written as another exporter might."""
    if isinstance(value, dict):
        items = [(key, respell(item, rng)) for key, item in value.items()]
        if "intValue" in value and rng.random() < 0.5:
            items = [(key, int(item) if key == "intValue" else item) for key, item in items]
        if rng.random() < 0.3:
            items.append((f"unknownField{rng.randrange(100)}", {"nested": [1, "x", None]}))
        rng.shuffle(items)
        return dict(items)
    if isinstance(value, list):
        return [respell(item, rng) for item in value]
    return value


def canonical(records: list) -> list:
    def plain(value: Any) -> Any:
        return value.tolist() if hasattr(value, "tolist") else value

    return sorted(
        (repr({name: plain(getattr(record, name)) for name in record.__struct_fields__}) for record in records)
    )


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=2**32), st.booleans(), st.booleans())
def test_valid_json_spelled_differently_decodes_like_protobuf(seed, enum_names, base64_ids):
    message = request(
        [
            call_span("s", 0, [0, 1, 2**31 - 1], [5], attempt=3, version=2**62),
            call_span("s", 1, [9], [8], ref=(0, 3), prompt_length=4),
            reward_span("s", -0.25, call_seq=1),
            rollout_span("s", status=semconv.STATUS_FAILED),
        ]
    )
    expected = canonical(decode_body(message.SerializeToString(), PROTOBUF).records)
    data = to_otlp_json(message)
    for item in data["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        if enum_names:
            item["kind"] = "SPAN_KIND_CLIENT" if item.get("kind") == "SPAN_KIND_CLIENT" else item.get("kind", 0)
        else:
            item["kind"] = {"SPAN_KIND_INTERNAL": 1, "SPAN_KIND_CLIENT": 3}.get(item.get("kind"), 0)
        if base64_ids:
            for key in ("traceId", "spanId"):
                item[key] = base64.b64encode(bytes.fromhex(item[key])).decode()
    body = json.dumps(respell(data, random.Random(seed))).encode()
    records = decode_body(body, JSON).records
    assert not [record for record in records if isinstance(record, Violation)]
    assert canonical(records) == expected


# --- over HTTP: never a 5xx -------------------------------------------------------------------------


def _json_with(attribute_key: str, value: str) -> bytes:
    payload = to_otlp_json(request([call_span("k", 0, [1], [2])]))
    payload["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"].append({"key": attribute_key, "value": "@"})
    return json.dumps(payload).replace('"@"', value).encode()


# Each of these once got a 5xx (issue 14), so the sample over HTTP always holds them.
KNOWN_BAD: list[tuple[bytes, str]] = [
    (export_request(with_attribute(call_span("k", 0, [1], [2]), semconv.ATTEMPT, int_value(10**22))), PROTOBUF),
    (export_request(with_attribute(call_span("k", 0, [1], [2]), "x", nested_array(3000))), PROTOBUF),
    (export_request(with_attribute(call_span("k", 0, [1], [2]), "x", nested_kvlist(3000))), PROTOBUF),
    (request([call_span("k", 0, [1], [2], start_ns=2**64 - 2, end_ns=2**64 - 1)]).SerializeToString(), PROTOBUF),
    (_json_with(semconv.PROMPT_TOKEN_IDS, '{"arrayValue": {"values": [{"intValue": 99999999999999999999}]}}'), JSON),
    (_json_with(semconv.CALL_SEQ, '{"intValue": "9223372036854775808"}'), JSON),
    (_json_with("x", '{"bytesValue": "%%%"}'), JSON),
    (_json_with("x", '{"arrayValue":{"values":[' * 3000 + "]}}" * 3000), JSON),
]


def test_no_fuzzed_body_gets_a_5xx_over_http(store_path):
    """Bodies from the strategies above, sent to a running receiver: 200, 400 or 413, never 5xx,
    and the receiver still stores a valid request afterwards."""
    bodies: list[tuple[bytes, str]] = []

    @settings(max_examples=80, deadline=None, database=None)
    @given(
        st.one_of(
            st.tuples(mutated(VALID), st.just(PROTOBUF)),
            st.tuples(mutated(VALID_JSON), st.just(JSON)),
            st.tuples(st.binary(max_size=512), st.sampled_from([PROTOBUF, JSON])),
            st.tuples(
                st.builds(lambda k, v: export_request(with_attribute(call_span("h", 0, [1], [2]), k, v)),
                          st.sampled_from(AGL_KEYS), hostile_protobuf_value()),
                st.just(PROTOBUF),
            ),
        )
    )
    def collect(case):
        bodies.append(case)

    collect()
    bodies.extend(KNOWN_BAD)
    with Receiver(store_path, ReceiverConfig(port=0)) as receiver, httpx.Client(timeout=30) as http:
        for body, media in bodies:
            reply = http.post(f"{receiver.url}/v1/traces", content=body, headers={"content-type": media})
            assert reply.status_code in (200, 400, 413), (reply.status_code, reply.text, body[:200])
        reply = http.post(f"{receiver.url}/v1/traces", content=valid_request("after"),
                          headers={"content-type": PROTOBUF})
        assert reply.status_code == 200
    with RolloutStore(store_path) as store:
        assert len(store.load("after-a").calls) == 2
