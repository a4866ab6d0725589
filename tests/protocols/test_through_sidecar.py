"""End to end: the official `anthropic` SDK and the `openai` SDK's Responses client through the real
agl sidecar to a faithful engine (the fake vLLM; for tool calls, a scripted upstream answering in
vLLM's tool-call wire shape). What the SDKs receive is well-formed for them, and each call's span,
received by a real OTLP receiver, holds the engine's token IDs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from agl import semconv
from agl_sidecar.config import SidecarConfig
from agl_sidecar.server import BackgroundSidecar

from tests.protocols.adapter_host import AdapterHost
from agl_testing.wire import PROMPT_IDS, TOOL_ARGUMENTS, TOOL_CALL_ID, tool_then_text
from agl_testing.fake_vllm import FakeVLLM
from tests.support.otlp_sink import OTLPSink, ReceivedSpan

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}


def start_sidecar(upstream: str, sink: OTLPSink, spool: Path) -> BackgroundSidecar:
    config = SidecarConfig(
        upstream=[upstream],
        listen="127.0.0.1:0",
        otlp_endpoint=sink.endpoint,
        spool_dir=str(spool),
        export_interval_s=0.05,
    )
    return BackgroundSidecar(config)


@pytest.fixture
def fake() -> Iterator[FakeVLLM]:
    with FakeVLLM() as engine:
        yield engine


@pytest.fixture
def sidecar(fake: FakeVLLM, otlp_sink: OTLPSink, tmp_path: Path) -> Iterator[BackgroundSidecar]:
    with start_sidecar(fake.base_url, otlp_sink, tmp_path) as s:
        yield s


@pytest.fixture
def tool_sidecar(otlp_sink: OTLPSink, tmp_path: Path) -> Iterator[BackgroundSidecar]:
    with (
        AdapterHost(tool_then_text("It is 18C.")) as upstream,
        start_sidecar(upstream.url, otlp_sink, tmp_path) as s,
    ):
        yield s


def call_span(sink: OTLPSink, response_id: str) -> ReceivedSpan:
    spans = sink.wait_for(
        lambda spans: any(s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == response_id for s in spans)
    )
    return next(s for s in spans if s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == response_id)


def engine_answer(fake: FakeVLLM, request: dict) -> dict:
    """The engine's answer to the request the sidecar sent, replayed (the fake is deterministic)."""
    plain = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
    return httpx.post(fake.base_url + "/v1/chat/completions", json=plain).json()


def assert_engine_tokens(span: ReceivedSpan, answer: dict, api: str) -> None:
    assert span.attributes[semconv.CALL_API] == api
    assert span.attributes[semconv.TOKENS_SOURCE] == semconv.TOKENS_FROM_ENGINE
    assert span.attributes[semconv.PROMPT_TOKEN_IDS] == answer["prompt_token_ids"]
    assert span.attributes[semconv.COMPLETION_TOKEN_IDS] == answer["choices"][0]["token_ids"]
    assert span.raw_attribute_kinds[semconv.COMPLETION_TOKEN_IDS] == "array_value"


def test_anthropic_sdk_create_and_stream(
    fake: FakeVLLM, sidecar: BackgroundSidecar, otlp_sink: OTLPSink
) -> None:
    client = anthropic.Anthropic(base_url=sidecar.url + "/rollouts/r-anth", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    message = client.messages.create(model="tiny", max_tokens=60, system="Be brief.", messages=messages)
    answer = engine_answer(fake, fake.requests[-1])
    assert message.content[0].text == answer["choices"][0]["message"]["content"]
    assert_engine_tokens(call_span(otlp_sink, message.id), answer, semconv.API_ANTHROPIC_MESSAGES)
    with client.messages.stream(model="tiny", max_tokens=60, messages=messages) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    answer = engine_answer(fake, fake.requests[-1])
    assert "".join(pieces) == final.content[0].text == answer["choices"][0]["message"]["content"]
    assert final.usage.output_tokens == len(answer["choices"][0]["token_ids"])
    span = call_span(otlp_sink, final.id)
    assert_engine_tokens(span, answer, semconv.API_ANTHROPIC_MESSAGES)
    assert (
        span.attributes[semconv.ROLLOUT_ID] == "r-anth"
        and span.attributes[semconv.GEN_AI_REQUEST_STREAM] is True
    )


def test_anthropic_sdk_tool_use(tool_sidecar: BackgroundSidecar, otlp_sink: OTLPSink) -> None:
    client = anthropic.Anthropic(base_url=tool_sidecar.url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    message = client.messages.create(model="tiny", max_tokens=64, tools=[WEATHER], messages=messages)
    assert message.stop_reason == "tool_use" and message.content[-1].input == json.loads(TOOL_ARGUMENTS)
    span = call_span(otlp_sink, message.id)
    assert span.attributes[semconv.PROMPT_TOKEN_IDS] == PROMPT_IDS
    assert span.attributes[semconv.COMPLETION_TOKEN_IDS] == [40, 41, 42, 43, 2]
    with client.messages.stream(model="tiny", max_tokens=64, tools=[WEATHER], messages=messages) as stream:
        final = stream.get_final_message()
    assert final.content[-1].type == "tool_use" and final.content[-1].id == TOOL_CALL_ID
    assert final.content[-1].input == json.loads(TOOL_ARGUMENTS)
    follow = client.messages.create(
        model="tiny",
        max_tokens=64,
        tools=[WEATHER],
        messages=[
            *messages,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": TOOL_CALL_ID, "content": "18C"}],
            },
        ],
    )
    assert follow.content[0].text == "It is 18C." and follow.stop_reason == "end_turn"


def test_anthropic_count_tokens_and_errors(fake: FakeVLLM, sidecar: BackgroundSidecar) -> None:
    client = anthropic.Anthropic(base_url=sidecar.url, api_key="unused", max_retries=0)
    count = client.messages.count_tokens(
        model="tiny", messages=[{"role": "user", "content": "What is 2 + 2?"}]
    )
    tokenized = httpx.post(
        fake.base_url + "/tokenize",
        json={"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
    )
    assert count.input_tokens == tokenized.json()["count"]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": ""}])
    assert info.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": info.value.body["error"]["message"]},
    }
    assert "$.messages[0].content" in info.value.body["error"]["message"]
    broken = httpx.post(
        sidecar.url + "/v1/messages", content=b"{oops", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and broken.json()["type"] == "error"


def test_responses_client_create_stream_and_chain(
    fake: FakeVLLM, sidecar: BackgroundSidecar, otlp_sink: OTLPSink
) -> None:
    client = openai.OpenAI(base_url=sidecar.url + "/rollouts/r-resp/v1", api_key="unused", max_retries=0)
    first = client.responses.create(
        model="tiny", instructions="Be brief.", input="What is 2 + 2?", max_output_tokens=200
    )
    answer = engine_answer(fake, fake.requests[-1])
    assert first.output_text == answer["choices"][0]["message"]["content"]
    assert_engine_tokens(
        call_span(otlp_sink, "chatcmpl-" + first.id.removeprefix("resp_")), answer, semconv.API_RESPONSES
    )
    with client.responses.stream(
        model="tiny", input="And 3 + 3?", previous_response_id=first.id, max_output_tokens=200
    ) as stream:
        final = stream.get_final_response()
    sent = fake.requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"] and sent[1][
        "content"
    ] == first.output_text
    answer = engine_answer(fake, fake.requests[-1])
    assert (
        final.output_text == answer["choices"][0]["message"]["content"]
        and final.previous_response_id == first.id
    )
    assert_engine_tokens(
        call_span(otlp_sink, "chatcmpl-" + final.id.removeprefix("resp_")), answer, semconv.API_RESPONSES
    )


def test_responses_client_tool_calls(tool_sidecar: BackgroundSidecar, otlp_sink: OTLPSink) -> None:
    client = openai.OpenAI(base_url=tool_sidecar.url + "/v1", api_key="unused", max_retries=0)
    with client.responses.stream(
        model="tiny", input="Weather in Paris?", tools=[RESPONSES_WEATHER]
    ) as stream:
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.call_id == TOOL_CALL_ID and call.arguments == TOOL_ARGUMENTS
    span = call_span(otlp_sink, "chatcmpl-" + final.id.removeprefix("resp_"))
    assert span.attributes[semconv.COMPLETION_TOKEN_IDS] == [40, 41, 41, 41, 41, 2]
    answer = client.responses.create(
        model="tiny",
        previous_response_id=final.id,
        input=[{"type": "function_call_output", "call_id": TOOL_CALL_ID, "output": "18C"}],
        tools=[RESPONSES_WEATHER],
    )
    assert answer.output_text == "It is 18C."


def test_responses_errors_in_openai_format(sidecar: BackgroundSidecar) -> None:
    client = openai.OpenAI(base_url=sidecar.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input=42)  # type: ignore[arg-type]
    assert info.value.body["type"] == "invalid_request_error" and "input" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_gone")
    broken = httpx.post(
        sidecar.url + "/v1/responses", content=b"[", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
