"""The core proxy through the official openai SDK: responses equal vLLM's own (as if the sidecar
were not there), spans carry exactly the engine's token IDs."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from agl import semconv
from agl_testing.captures import VLLM_CAPTURES
from agl_testing.fake_vllm import FakeVLLM, chat_prompt_ids, encode
from tests.support.waiting import wait_until

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def _normalize(body: dict) -> dict:
    body = dict(body)
    body.pop("id", None)
    body.pop("created", None)
    return body


def _direct(fake: FakeVLLM, path: str, body: dict) -> httpx.Response:
    return httpx.post(fake.base_url + path, json=body, timeout=10)


def _engine_tokens(fake: FakeVLLM, body: dict) -> dict:
    """What the engine produces for `body` when asked for token IDs and logprobs."""
    return _direct(fake, "/v1/chat/completions", {**body, "return_token_ids": True, "logprobs": True}).json()


def test_chat_nonstream_sync_equals_upstream_and_span_has_engine_tokens(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    client = openai.OpenAI(base_url=sidecar.url + "/rollouts/r-1/v1", api_key="unused")
    request = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "seed": 1234}

    through = client.chat.completions.with_raw_response.create(**request)
    raw = json.loads(through.http_response.content)
    direct = _direct(fake, "/v1/chat/completions", request).json()
    assert _normalize(raw) == _normalize(direct)
    assert list(raw) == list(direct)  # same keys in the same order
    assert raw["choices"][0]["token_ids"] is None and raw["prompt_token_ids"] is None
    assert raw["choices"][0]["logprobs"] is None
    # The engine was asked for token IDs and logprobs.
    assert fake.requests[0]["return_token_ids"] is True and fake.requests[0]["logprobs"] is True

    engine = _engine_tokens(fake, request)
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    attrs = span.attributes
    assert span.name == "chat tiny"
    assert span.kind == 3  # CLIENT
    assert attrs[semconv.PROMPT_TOKEN_IDS] == engine["prompt_token_ids"] == chat_prompt_ids(MESSAGES)
    assert attrs[semconv.COMPLETION_TOKEN_IDS] == engine["choices"][0]["token_ids"]
    assert attrs[semconv.COMPLETION_LOGPROBS] == [e["logprob"] for e in engine["choices"][0]["logprobs"]["content"]]
    assert span.raw_attribute_kinds[semconv.PROMPT_TOKEN_IDS] == "array_value"
    assert attrs[semconv.ROLLOUT_ID] == "r-1"
    assert 0 < attrs[semconv.CALL_SEQ] <= semconv.INT64_MAX  # a clock reading (spans/call_seq.py)
    assert attrs[semconv.TOKENS_SOURCE] == semconv.TOKENS_FROM_ENGINE
    assert attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == [engine["choices"][0]["finish_reason"]]
    assert attrs[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] == len(engine["choices"][0]["token_ids"])
    assert attrs[semconv.POLICY_VERSION] == 0


def test_harness_that_asks_for_token_ids_gets_them(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    request = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "seed": 3, "return_token_ids": True}
    through = httpx.post(sidecar.url + "/v1/chat/completions", json=request).json()
    direct = _direct(fake, "/v1/chat/completions", request).json()
    assert _normalize(through) == _normalize(direct)
    assert through["prompt_token_ids"] == chat_prompt_ids(MESSAGES)
    assert through["choices"][0]["logprobs"] is None  # asked for ids only: logprobs stripped


async def test_chat_stream_async_equals_upstream_chunk_by_chunk(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    request = {"model": "tiny", "messages": MESSAGES, "max_tokens": 30, "seed": 7, "stream": True, "n": 2}
    async with httpx.AsyncClient() as http:
        through = (await http.post(sidecar.url + "/rollouts/s/v1/chat/completions", json=request)).text
        direct = (await http.post(fake.base_url + "/v1/chat/completions", json=request)).text
    events = [e for e in through.split("\n\n") if e]
    expected = [e for e in direct.split("\n\n") if e]
    assert len(events) == len(expected) and events[-1] == "data: [DONE]"
    for got, want in zip(events[:-1], expected[:-1], strict=True):
        assert _normalize(json.loads(got[6:])) == _normalize(json.loads(want[6:]))
        assert "token_ids\":[" not in got and "\"logprobs\":{" not in got

    client = openai.AsyncOpenAI(base_url=sidecar.url + "/rollouts/s/v1", api_key="unused")
    text = {0: "", 1: ""}
    stream = await client.chat.completions.create(**{**request, "stream": True})
    async for chunk in stream:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
    engine = _engine_tokens(fake, {**request, "stream": False})
    assert text[0] == engine["choices"][0]["message"]["content"]
    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 2)
    for span in spans:
        attrs = span.attributes
        assert attrs[semconv.GEN_AI_REQUEST_STREAM] is True
        assert attrs[semconv.COMPLETION_TOKEN_IDS] == engine["choices"][0]["token_ids"]
        assert attrs[semconv.completion_token_ids_key(1)] == engine["choices"][1]["token_ids"]
        assert attrs[semconv.COMPLETION_CHOICES] == 2
        assert len(attrs[semconv.COMPLETION_LOGPROBS]) == len(engine["choices"][0]["token_ids"])
    assert len({s.attributes[semconv.CALL_SEQ] for s in spans}) == 2


def test_completions_stream_and_nonstream(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    client = openai.OpenAI(base_url=sidecar.url + "/v1", api_key="unused")
    request = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8, "seed": 1234}
    raw = json.loads(client.completions.with_raw_response.create(**request).http_response.content)
    direct = _direct(fake, "/v1/completions", request).json()
    assert _normalize(raw) == _normalize(direct)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**request, stream=True) if c.choices)
    assert streamed == direct["choices"][0]["text"]
    engine = _direct(fake, "/v1/completions", {**request, "return_token_ids": True, "logprobs": 1}).json()
    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 2)
    for span in spans:
        assert span.name == "text_completion tiny"
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] == encode("The quick brown fox")
        assert span.attributes[semconv.COMPLETION_TOKEN_IDS] == engine["choices"][0]["token_ids"]
        assert span.attributes[semconv.COMPLETION_LOGPROBS] == engine["choices"][0]["logprobs"]["token_logprobs"]


def test_models_passes_through(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url])
    models = openai.OpenAI(base_url=sidecar.url + "/rollouts/x/attempts/2/v1", api_key="u").models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_prompt_by_reference_round_trip(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    client = openai.OpenAI(base_url=sidecar.url + "/rollouts/multi/v1", api_key="u")
    messages = [{"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": "start"}]
    prompts = []
    for turn in range(3):
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, seed=turn)
        prompts.append(chat_prompt_ids(messages))
        messages = messages + [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": f"tool result {turn}"},
        ]
    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 3)
    seqs = sorted(s.attributes[semconv.CALL_SEQ] for s in spans)  # arrival order
    by_seq = {s.attributes[semconv.CALL_SEQ]: s.attributes for s in spans}
    assert semconv.PROMPT_REF_CALL_SEQ not in by_seq[seqs[0]]

    def full_prompt(seq: int) -> list[int]:
        attrs = by_seq[seq]
        if semconv.PROMPT_REF_CALL_SEQ not in attrs:
            return attrs[semconv.PROMPT_TOKEN_IDS]
        ref = attrs[semconv.PROMPT_REF_CALL_SEQ]
        sequence = full_prompt(ref) + by_seq[ref][semconv.COMPLETION_TOKEN_IDS]
        return sequence[: attrs[semconv.PROMPT_REF_LENGTH]] + attrs[semconv.PROMPT_TOKEN_IDS]

    for turn in (1, 2):
        seq = seqs[turn]
        assert by_seq[seq][semconv.PROMPT_REF_CALL_SEQ] == seqs[turn - 1]
        assert len(by_seq[seq][semconv.PROMPT_TOKEN_IDS]) < len(prompts[turn])
        assert by_seq[seq][semconv.PROMPT_LENGTH] == len(prompts[turn])
    assert [full_prompt(seq) for seq in seqs] == prompts


def test_attribution_header_baggage_api_key_and_traceparent(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(
        upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint, rollout_api_keys={"key-for-r9": "r9"}, api_key="harness-key"
    )
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    url = sidecar.url + "/v1/chat/completions"
    parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    key = {"Authorization": "Bearer harness-key"}
    httpx.post(url, json=body, headers={"x-agl-rollout-id": "r-header", "x-agl-task-id": "t1", "traceparent": parent, **key})
    httpx.post(url, json=body, headers={"baggage": "agl.rollout.id=r-bag,agl.attempt=3,agl.rollout.mode=val", **key})
    httpx.post(url, json=body, headers={"Authorization": "Bearer key-for-r9"})
    # The path prefix wins over the header.
    httpx.post(sidecar.url + "/rollouts/r-path/v1/chat/completions", json=body, headers={"x-agl-rollout-id": "nope", **key})
    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 4)
    by_rollout = {s.attributes.get(semconv.ROLLOUT_ID): s for s in spans}
    assert set(by_rollout) == {"r-header", "r-bag", "r9", "r-path"}
    header = by_rollout["r-header"]
    assert header.attributes[semconv.TASK_ID] == "t1"
    assert header.trace_id == "ab" * 16 and header.parent_span_id == "cd" * 8
    assert by_rollout["r-bag"].attributes[semconv.ATTEMPT] == 3
    assert by_rollout["r-bag"].attributes[semconv.ROLLOUT_MODE] == "val"
    assert by_rollout["r-path"].parent_span_id == ""


def test_sampling_overrides_per_mode(fake, make_sidecar, otlp_sink):
    overrides = {"temperature": 1.0, "n": 2, "max_tokens": 3}
    sidecar = make_sidecar(upstream=[fake.base_url], sampling={"train": overrides}, otlp_endpoint=otlp_sink.endpoint)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "temperature": 0.2}
    httpx.post(sidecar.url + "/rollouts/t/v1/chat/completions", json=body, headers={"x-agl-mode": "train"})
    httpx.post(sidecar.url + "/rollouts/v/v1/chat/completions", json=body, headers={"x-agl-mode": "val"})
    assert {k: fake.requests[0][k] for k in overrides} == overrides
    assert (fake.requests[1]["temperature"], fake.requests[1].get("n")) == (0.2, None)
    spans = {s.attributes[semconv.ROLLOUT_ID]: s.attributes for s in otlp_sink.wait_for(lambda s: len(s) >= 2)}
    asked = [semconv.GEN_AI_REQUEST_TEMPERATURE, semconv.GEN_AI_REQUEST_CHOICE_COUNT, semconv.GEN_AI_REQUEST_MAX_TOKENS]
    assert [spans["t"].get(key) for key in asked] == [1.0, 2, 3]  # what the engine was asked, not the harness
    assert [spans["v"].get(key) for key in asked] == [0.2, None, 4]


def test_sampling_seed_gives_each_call_a_seed_from_its_rollout_and_bytes(fake, make_sidecar):
    """sampling_seed (agl eval): the same rollout and body get the same seed, in any sidecar; another
    rollout (another attempt of the task) or another base seed gets another; no rollout: no seed."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    seeds = []
    for base in (7, 7, 8):
        sidecar = make_sidecar(upstream=[fake.base_url], sampling_seed=base)
        for rollout in ("a", "b"):
            httpx.post(sidecar.url + f"/rollouts/{rollout}/v1/chat/completions", json=body)
        httpx.post(sidecar.url + "/v1/chat/completions", json=body)
    seeds = [request.get("seed") for request in fake.requests]
    assert seeds[0:3] == seeds[3:6] and seeds[2] is None
    assert len({seeds[0], seeds[1], seeds[6], seeds[7]}) == 4 and all(isinstance(s, int) for s in seeds[6:8])


def test_disconnect_mid_stream_cancels_upstream_and_records_partial_tokens(make_sidecar, otlp_sink):
    with FakeVLLM(token_latency_s=0.05) as slow:
        sidecar = make_sidecar(upstream=[slow.base_url], otlp_endpoint=otlp_sink.endpoint)
        request = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", sidecar.url + "/rollouts/d/v1/chat/completions", json=request) as response:
            received = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    received += 1
                if received >= 5:
                    break
        (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
        attrs = span.attributes
        assert attrs[semconv.CALL_END_REASON] == semconv.END_CLIENT_DISCONNECTED
        assert 4 <= len(attrs[semconv.COMPLETION_TOKEN_IDS]) < 200
        wait_until(lambda: slow.cancelled > 0, "the engine's generation cancelled", timeout=10)
        assert slow.cancelled == 1


@pytest.mark.parametrize(
    ("body", "status", "fragment", "param"),
    [
        (b'{"model":"tiny","messages":[{"role":"user","content":"hi"}],', 400, "not valid JSON", None),
        (b'{"model":"tiny","messages":"hi"}', 400, "Expected `array`", "messages"),
        (b'{"model":"tiny","messages":[],"max_tokens":"twelve"}', 400, "Expected `int | null`", "max_tokens"),
        (b'{"model":"tiny"}', 400, "missing required field 'messages'", "messages"),
        (b"", 400, "empty request body", None),
        (b'[1,2]', 400, "Expected `object`", None),
    ],
)
def test_bad_input_gets_openai_style_400(fake, make_sidecar, body, status, fragment, param):
    sidecar = make_sidecar(upstream=[fake.base_url])
    response = httpx.post(sidecar.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"]
    assert error["param"] == param and error["code"] == status and error["type"] == "invalid_request_error"
    assert fake.requests == []  # never reached the engine


def test_upstream_error_passes_through_and_unreachable_is_502(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    response = httpx.post(sidecar.url + "/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
    direct = httpx.post(fake.base_url + "/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
    assert response.status_code == 404 and response.content == direct.content
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.CALL_END_REASON] == semconv.END_UPSTREAM_ERROR
    assert span.attributes[semconv.ERROR_TYPE] == "404" and span.status_code == 2

    dead = make_sidecar(upstream=["http://127.0.0.1:9"])
    response = httpx.post(dead.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
    assert response.status_code == 502
    assert "unreachable" in response.json()["error"]["message"]


def test_harness_api_key_required_when_configured(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url], api_key="secret")
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    assert httpx.post(sidecar.url + "/v1/chat/completions", json=body).status_code == 401
    ok = httpx.post(sidecar.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200


def test_disconnect_while_waiting_for_a_unary_answer_cancels_upstream(make_sidecar, otlp_sink):
    with FakeVLLM(latency_s=3.0) as slow:
        sidecar = make_sidecar(upstream=[slow.base_url], otlp_endpoint=otlp_sink.endpoint)
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(sidecar.url + "/rollouts/u/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
        (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
        assert span.attributes[semconv.CALL_END_REASON] == semconv.END_CLIENT_DISCONNECTED
        assert semconv.COMPLETION_TOKEN_IDS not in span.attributes
        wait_until(lambda: slow.cancelled > 0, "the engine's generation cancelled", timeout=10)
        assert slow.cancelled == 1
        state = httpx.get(sidecar.url + "/agl/v1/state").json()
        assert state["in_flight"] == 0 and state["counters"]["client_disconnects"] == 1


@pytest.mark.parametrize(
    "chunk",
    [
        # vLLM's key order (the fast path)
        b'{"id":"c","choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"content":[{"token":"a",'
        b'"logprob":-0.5,"bytes":[97],"top_logprobs":[]}]},"finish_reason":null,"token_ids":[7]}]}',
        # another server's order (the general path)
        b'{"choices":[{"token_ids":[7],"finish_reason":null,"index":0,"logprobs":{"content":[{"token":"a",'
        b'"logprob":-0.5}]},"delta":{"content":"a"}}],"id":"c"}',
    ],
)
def test_stream_chunk_is_recorded_once_and_stripped_whatever_the_key_order(chunk):
    from agl_sidecar.calls.attribution import Identity
    from agl_sidecar.proxy.recording import StreamRecorder
    from agl_sidecar.proxy.request import CHAT, Flags
    from agl_sidecar.calls.record import CallRecord
    from agl_sidecar.calls.wire import chat_request

    call = CallRecord(api="a", operation="chat", identity=Identity(), trace_parent=None, start_ns=0)
    flags = Flags(CHAT, chat_request.decode(b'{"messages":[]}'))
    recorder = StreamRecorder(CHAT, flags, call)
    out = recorder.event(b"data: " + chunk)
    stripped = json.loads(out[6:])
    assert stripped["choices"][0]["token_ids"] is None and stripped["choices"][0]["logprobs"] is None
    original = json.loads(chunk)
    original["choices"][0]["token_ids"] = original["choices"][0]["logprobs"] = None
    assert stripped == original
    assert call.choices[0].token_ids == [7] and call.choices[0].logprobs == [-0.5]


def _record(body: bytes):
    from agl_sidecar.calls.attribution import Identity
    from agl_sidecar.proxy.recording import record_unary
    from agl_sidecar.proxy.request import CHAT, Flags
    from agl_sidecar.calls.record import CallRecord
    from agl_sidecar.calls.wire import chat_request

    call = CallRecord(api="a", operation="chat", identity=Identity(), trace_parent=None, start_ns=0)
    out = record_unary(CHAT, body, Flags(CHAT, chat_request.decode(b'{"messages":[]}')), call, False)
    prompt = None if call.prompt_ids is None else json.loads(bytes(call.prompt_ids))
    return json.loads(out), prompt, [json.loads(bytes(c.token_ids)) for c in call.choices.values()]


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])  # vLLM's compact JSON, or spaced
def test_the_prompt_array_lifted_out_before_decoding_is_recorded_and_stripped_as_decoded_whole(
    monkeypatch, separators
):
    from agl_sidecar.calls import wire

    engine = json.loads((VLLM_CAPTURES / "chat_nonstream_token_ids_logprobs.json").read_bytes())
    engine["prompt_token_ids"] *= 300  # a long prompt
    body = json.dumps(engine, separators=separators).encode()
    lifts = []

    def spy(data: bytes, key: bytes):
        view, lifted = real_lift(data, key)
        lifts.append(lifted)
        return view, lifted

    real_lift = wire.lift_int_array
    monkeypatch.setattr(wire, "lift_int_array", spy)
    sent, prompt, completions = _record(body)
    assert len(lifts) == 1 and json.loads(bytes(lifts[0])) == engine["prompt_token_ids"]  # it was lifted
    assert prompt == engine["prompt_token_ids"] and completions == [engine["choices"][0]["token_ids"]]
    expected = dict(engine, prompt_token_ids=None)
    expected["choices"] = [dict(c, token_ids=None, logprobs=None) for c in engine["choices"]]
    assert sent == expected
    view, _ = real_lift(body, b'"prompt_token_ids":')
    assert json.loads(view)["prompt_token_ids"] == 0 and len(view) < len(body) // 10


# Long enough to be lifted (wire.LIFT_MIN_BYTES).
_CHOICE = (
    b'{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"' + b"x" * 5000 + b'"},'
    b'"token_ids":[5]'
)


@pytest.mark.parametrize(
    ("body", "prompt"),
    [
        # only a nested key of that name: not the response's prompt
        (_CHOICE + b',"extra":{"prompt_token_ids":[1,2,3]}}]}', None),
        # the key twice: no lift, decoded whole
        (_CHOICE + b',"extra":{"prompt_token_ids":[9]}}],"prompt_token_ids":[1,2,3]}', [1, 2, 3]),
        # a "]" inside the value: the lift cuts wrongly, so the body is decoded whole
        (_CHOICE + b'}],"prompt_token_ids":[1,"]",3]}', [1, "]", 3]),
    ],
)
def test_a_prompt_array_that_cannot_be_lifted_safely_is_decoded_whole(body, prompt):
    from agl_sidecar.calls import wire

    assert len(body) >= wire.LIFT_MIN_BYTES
    sent, recorded, completions = _record(body)
    assert recorded == prompt and completions == [[5]]
    assert sent.get("prompt_token_ids") is None and sent["choices"][0]["token_ids"] is None
