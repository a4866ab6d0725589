"""Property tests over everything that enters the sidecar from a harness or an admin client (paths,
headers, bodies: arbitrary JSON, deep nesting, odd unicode, huge ints, wrong types), sent over
loopback to the real aiohttp app in front of the fake vLLM, with spans going to a real OTLP
receiver. For every input: never a 5xx, never a traceback or error in the log, and every call the
harness got a 200 for has its span delivered (and no span fails to build or export).

Examples are derived deterministically (CI reruns the same inputs); AGL_FUZZ_EXAMPLES raises the count.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote_from_bytes

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl import semconv
from agl_sidecar.config import build
from agl_sidecar.server import BackgroundSidecar
from agl_testing.fake_vllm import FakeVLLM
from tests.support.otlp_sink import OTLPSink
from tests.support.waiting import wait_until

EXAMPLES = int(os.environ.get("AGL_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
MODEL_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]
INT64 = 2**63


class Tally:
    """What the harness was answered, to hold the spans against."""

    def __init__(self) -> None:
        self.model_ok = 0
        self.rewards_ok = 0
        self.ends_ok = 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: Any) -> Iterator[tuple[BackgroundSidecar, OTLPSink, Tally]]:
    with FakeVLLM() as fake, OTLPSink() as sink:
        config = build({
            "upstream": [fake.base_url],
            "listen": "127.0.0.1:0",
            "otlp_endpoint": sink.endpoint,
            "spool_dir": str(tmp_path_factory.mktemp("spool")),
            "export_interval_s": 0.05,
            "max_body_bytes": 256 * 1024,
        })
        with BackgroundSidecar(config) as sidecar:
            for path in ("/v1/messages", "/v1/responses"):  # import the adapters once, before timing matters
                httpx.post(sidecar.url + path, content=b"{}", timeout=120)
            tally = Tally()
            yield sidecar, sink, tally
            _assert_every_answered_call_has_its_span(sidecar, sink, tally)


def _assert_every_answered_call_has_its_span(sidecar: BackgroundSidecar, sink: OTLPSink, tally: Tally) -> None:
    def calls_ok(spans: list[Any]) -> int:
        return sum(1 for s in spans if s.name.startswith(("chat", "text_completion")) and semconv.ERROR_TYPE not in s.attributes)

    def rewards(spans: list[Any]) -> int:
        return sum(1 for s in spans if s.name == semconv.SPAN_REWARD)

    expected = tally.model_ok + tally.rewards_ok + tally.ends_ok
    wait_until(
        lambda: calls_ok(list(sink.spans)) >= tally.model_ok and rewards(list(sink.spans)) >= tally.rewards_ok,
        f"the spans of {tally.model_ok} answered model calls and {tally.rewards_ok} rewards",
        timeout=30,
    )
    spans = list(sink.spans)
    assert calls_ok(spans) == tally.model_ok, (calls_ok(spans), tally.model_ok)
    assert rewards(spans) == tally.rewards_ok
    assert len([s for s in spans if s.name == semconv.SPAN_ROLLOUT]) == tally.ends_ok
    assert len(spans) >= expected
    counters = httpx.get(sidecar.url + "/agl/v1/state").json()["counters"]
    assert counters["span_build_failures"] == 0
    assert not [k for k, v in counters.items() if ("fail" in k or "dropped" in k) and isinstance(v, int) and v]


@pytest.fixture
def quiet_log(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    with caplog.at_level(logging.WARNING):
        yield
    noisy = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not noisy, [r.getMessage() for r in noisy]


# --- strategies ------------------------------------------------------------------------------------
json_leaf = (
    st.none()
    | st.booleans()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.sampled_from([INT64 - 1, INT64, -INT64, -INT64 - 1, 2**64 - 1, 2**64, 10**30])
    | st.text(max_size=12)
)
json_value = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8
)
# In range but huge, n or top_logprobs would have the engine generate that much: values a real engine
# refuses are left to it; out of int64 is the sidecar's to refuse.
small_or_huge = st.integers(-3, 4) | st.integers(min_value=INT64, max_value=2**80) | json_value
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=40)})
chat_body = st.fixed_dictionaries(
    # Messages the sidecar passes on are the engine's to judge (the fake engine, unlike vLLM, does
    # not validate them): valid ones, or values that are no message list at all.
    {"model": st.just("tiny"), "messages": st.lists(message, min_size=1, max_size=3) | json_leaf},
    optional={
        "max_tokens": st.integers(-5, 64) | st.integers(min_value=INT64 - 2, max_value=2**80) | json_value,
        "n": small_or_huge,
        "top_logprobs": small_or_huge,
        "logprobs": st.booleans() | json_value,
        "temperature": st.floats(0, 2) | json_value,
        "stream": st.booleans() | json_value,
        "return_token_ids": st.booleans() | json_value,
        "seed": json_value,
        "stream_options": st.just({"include_usage": True}) | json_value,
    },
)
completion_body = st.fixed_dictionaries(
    {"model": st.just("tiny"), "prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(3, 200), min_size=1, max_size=8) | json_leaf},
    optional={
        "max_tokens": st.integers(-5, 64) | st.integers(min_value=INT64 - 2, max_value=2**80) | json_value,
        "n": small_or_huge,
        "logprobs": small_or_huge,
        "stream": st.booleans(),
    },
)
messages_body = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 32) | json_value, "messages": st.lists(message, max_size=3) | json_value},
    optional={"stream": st.booleans() | json_value, "system": json_value, "temperature": json_value},
)
responses_body = st.fixed_dictionaries(
    {"model": st.just("tiny"), "input": st.text(max_size=40) | json_value},
    optional={"stream": st.booleans() | json_value, "max_output_tokens": json_value, "instructions": json_value},
)
BODIES = {
    "/v1/chat/completions": chat_body,
    "/v1/completions": completion_body,
    "/v1/messages": messages_body,
    "/v1/responses": responses_body,
}


@st.composite
def deep(draw: Any) -> bytes:
    # Deeper than the decoder goes (hypothesis raises the recursion limit while it runs a test, so
    # further than the ~900 levels the sidecar refuses at the default limit): refused before the engine.
    depth = draw(st.integers(20_000, 40_000))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    inner = opener * depth + b"1" + closer * depth if opener != b"[" else opener * depth + closer * depth
    return draw(st.sampled_from([b'{"model":"tiny","messages":%s}', b'{"model":"tiny","prompt":%s}', b"%s"])) % inner


def raw_bodies(path: str) -> st.SearchStrategy[bytes]:
    return (
        BODIES[path].map(msgspec.json.encode)
        | json_value.map(msgspec.json.encode)
        | deep()
        | st.binary(max_size=64)
    )


# Header values as a client can send them (no CR, LF, NUL or other controls: HTTP forbids them and
# the client library refuses), any other byte included: 0x80-0xFF arrive undecodable.
header_byte = st.integers(0x20, 0xFF).filter(lambda b: b != 0x7F)
header_value = st.lists(header_byte, min_size=1, max_size=24).map(bytes).map(lambda b: b.strip() or b"x") | st.sampled_from(
    [b"\xff", b"r-\xff\xfe", "r-é".encode(), "r-é".encode("latin-1"), b"%FF", b"r\x80"]
)
id_value = header_value | st.text(min_size=1, max_size=12).map(
    lambda t: bytes(b for b in t.encode("utf-8", "surrogatepass") if b >= 0x20 and b != 0x7F).strip() or b"x"
)
HEADER_NAMES = [
    semconv.HEADER_ROLLOUT_ID, semconv.HEADER_TASK_ID, semconv.HEADER_ATTEMPT, semconv.HEADER_MODE,
    "baggage", "traceparent", "authorization", "x-api-key",
    semconv.HEADER_AGENT_ID, semconv.HEADER_PARENT_AGENT_ID, semconv.HEADER_CLAUDE_CODE_AGENT_ID,
    semconv.HEADER_CLAUDE_CODE_PARENT_AGENT_ID, semconv.HEADER_COMPACTION,
]
headers = st.dictionaries(st.sampled_from(HEADER_NAMES), id_value, max_size=4)
attempt_text = (st.integers(-10, 2**70).map(str) | st.text(max_size=6)).map(lambda t: t.encode("utf-8", "surrogatepass"))
segment = st.binary(min_size=1, max_size=12) | st.text(min_size=1, max_size=12).map(lambda t: t.encode("utf-8", "surrogatepass"))


@st.composite
def prefix(draw: Any) -> str:
    kind = draw(st.sampled_from(["", "rollout", "attempt"]))
    if not kind:
        return ""
    rollout = quote_from_bytes(draw(segment), safe=b"")
    if kind == "rollout":
        return f"/rollouts/{rollout}"
    return f"/rollouts/{rollout}/attempts/{quote_from_bytes(draw(attempt_text), safe=b'')}"


def _send(sidecar: BackgroundSidecar, path: str, body: bytes, sent_headers: dict[str, bytes]) -> httpx.Response:
    return httpx.post(
        sidecar.url + path,
        content=body,
        headers={"content-type": "application/json", **sent_headers},
        timeout=60,
    )


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400 and response.headers.get("content-type", "").startswith("application/json"):
        payload = response.json()
        assert isinstance(payload, dict) and ("error" in payload), payload


# --- properties ------------------------------------------------------------------------------------
@FUZZ
@given(data=st.data())
def test_model_calls_never_5xx_and_every_200_has_its_span(stack, quiet_log, data):
    sidecar, _, tally = stack
    path = data.draw(st.sampled_from(MODEL_PATHS))
    body = data.draw(raw_bodies(path))
    response = _send(sidecar, data.draw(prefix()) + path, body, data.draw(headers))
    _check(response)
    if response.status_code == 200:
        tally.model_ok += 1


VALID = {
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 3},
    "/v1/messages": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 3},
}


@FUZZ
@given(data=st.data())
def test_any_path_and_headers_on_a_valid_call_never_5xx_and_every_200_has_its_span(stack, quiet_log, data):
    sidecar, _, tally = stack
    path = data.draw(st.sampled_from(MODEL_PATHS))
    body = dict(VALID[path], stream=data.draw(st.booleans()))
    sent = data.draw(st.dictionaries(st.sampled_from(HEADER_NAMES), id_value, max_size=3))
    # The ids a span carries, always sent: raw bytes, mostly not UTF-8.
    sent[semconv.HEADER_ROLLOUT_ID] = data.draw(header_value)
    sent[semconv.HEADER_TASK_ID] = data.draw(header_value)
    response = _send(sidecar, data.draw(prefix()) + path, msgspec.json.encode(body), sent)
    _check(response)
    if response.status_code == 200:
        tally.model_ok += 1


@FUZZ
@given(data=st.data())
def test_rewards_and_ends_never_5xx_and_every_200_has_its_span(stack, quiet_log, data):
    sidecar, _, tally = stack
    endpoint = data.draw(st.sampled_from(["/reward", "/end"]))
    reward = st.fixed_dictionaries(
        {"value": json_value},
        optional={"name": json_value, "call_seq": json_value, "task_id": json_value, "attributes": json_value},
    )
    end = st.fixed_dictionaries({}, optional={"status": st.sampled_from(["succeeded", "failed"]) | json_value, "task_id": json_value, "mode": json_value})
    structured = (reward if endpoint == "/reward" else end).map(msgspec.json.encode)
    body = data.draw(structured | json_value.map(msgspec.json.encode) | deep() | st.binary(max_size=32))
    rollout = quote_from_bytes(data.draw(segment), safe=b"")
    response = _send(sidecar, f"/rollouts/{rollout}{endpoint}", body, data.draw(headers))
    _check(response)
    if response.status_code == 200:
        if endpoint == "/reward":
            tally.rewards_ok += 1
        else:
            tally.ends_ok += 1


@FUZZ
@given(data=st.data())
def test_admin_resume_never_5xx_and_a_taken_version_fits_a_span(stack, quiet_log, data):
    sidecar, _, _ = stack
    body = data.draw(
        st.fixed_dictionaries({"policy_version": json_value}).map(msgspec.json.encode)
        | json_value.map(msgspec.json.encode)
        | deep()
    )
    response = _send(sidecar, "/agl/v1/resume", body, data.draw(headers))
    _check(response)
    version = httpx.get(sidecar.url + "/agl/v1/state").json()["policy_version"]
    assert isinstance(version, int) and 0 <= version < INT64
