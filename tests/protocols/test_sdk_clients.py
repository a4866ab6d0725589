"""The official `anthropic` and `openai` SDK clients, over loopback HTTP, against the adapters and the
faithful fake vLLM (tool calls from the vLLM-shaped scripted engine): what they receive is
well-formed for them and says what the engine said."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.protocols.adapter_host import AdapterHost
from agl_testing.wire import TOOL_ARGUMENTS, TOOL_CALL_ID, tool_call_response, tool_call_stream
from agl_testing import fake_vllm
from agl_testing.fake_vllm import FakeVLLM

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER["input_schema"]}


@pytest.fixture(scope="module")
def engine() -> Iterator[FakeVLLM]:
    with FakeVLLM() as fake:
        yield fake


@pytest.fixture(scope="module")
def host(engine: FakeVLLM) -> Iterator[AdapterHost]:
    with AdapterHost(engine.base_url) as h:
        yield h


@pytest.fixture(scope="module")
def tool_host() -> Iterator[AdapterHost]:
    with AdapterHost(
        lambda chat: tool_call_stream("Checking.") if chat.get("stream") else tool_call_response()
    ) as h:
        yield h


def engine_text(engine: FakeVLLM, chat: dict) -> str:
    """What the engine answers to the chat request the adapter sent (the fake is deterministic)."""
    plain = {k: v for k, v in chat.items() if k not in ("stream", "stream_options")}
    return httpx.post(engine.base_url + "/v1/chat/completions", json=plain).json()["choices"][0]["message"][
        "content"
    ]


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


# --- Anthropic ---------------------------------------------------------------------------------
def test_anthropic_create(engine: FakeVLLM, host: AdapterHost) -> None:
    client = anthropic_client(host.url + "/rollouts/r1")
    message = client.messages.create(
        model="tiny", max_tokens=30, system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    chat = host.chat_requests[-1]
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ]
    assert message.content[0].text == engine_text(engine, chat)
    assert message.usage.input_tokens == len(fake_vllm.chat_prompt_ids(chat["messages"]))
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_stream(engine: FakeVLLM, host: AdapterHost) -> None:
    client = anthropic_client(host.url)
    messages = [{"role": "user", "content": "Tell me a story"}]
    with client.messages.stream(model="tiny", max_tokens=40, messages=messages) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    expected = engine_text(engine, host.chat_requests[-1])
    assert len(pieces) > 1 and "".join(pieces) == expected == final.content[0].text
    assert final.usage.output_tokens > 0 and final.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_tool_use_create_and_stream(tool_host: AdapterHost) -> None:
    client = anthropic_client(tool_host.url)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    message = client.messages.create(model="tiny", max_tokens=64, tools=[WEATHER], messages=messages)
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.id == TOOL_CALL_ID and block.input == json.loads(TOOL_ARGUMENTS)
    with client.messages.stream(model="tiny", max_tokens=64, tools=[WEATHER], messages=messages) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == json.loads(TOOL_ARGUMENTS) and final.stop_reason == "tool_use"
    # the next turn sends the tool result back: the engine gets a chat tool message
    client.messages.create(
        model="tiny",
        max_tokens=64,
        tools=[WEATHER],
        messages=[
            *messages,
            {"role": "assistant", "content": [b.model_dump() for b in final.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": TOOL_CALL_ID, "content": "18C"}],
            },
        ],
    )
    sent = tool_host.chat_requests[-1]["messages"]
    assert sent[-2]["tool_calls"][0]["id"] == TOOL_CALL_ID and sent[-1] == {
        "role": "tool",
        "tool_call_id": TOOL_CALL_ID,
        "content": "18C",
    }


def test_anthropic_count_tokens(host: AdapterHost) -> None:
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    count = anthropic_client(host.url).messages.count_tokens(
        model="tiny", system="Be brief.", messages=messages
    )
    expected = fake_vllm.chat_prompt_ids([{"role": "system", "content": "Be brief."}, *messages])
    assert count.input_tokens == len(expected)


def test_anthropic_malformed_requests_get_anthropic_errors(host: AdapterHost) -> None:
    client = anthropic_client(host.url)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=-3, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]
    reply = httpx.post(
        host.url + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_engine_errors_reach_anthropic_clients_in_anthropic_format(host: AdapterHost) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        anthropic_client(host.url).messages.create(
            model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert info.value.body["error"]["type"] == "not_found_error"


# --- Responses ---------------------------------------------------------------------------------
def test_responses_create_and_chain(engine: FakeVLLM, host: AdapterHost) -> None:
    client = openai_client(host.url)
    first = client.responses.create(
        model="tiny", instructions="Be brief.", input="Hello", max_output_tokens=30
    )
    assert first.output_text == engine_text(engine, host.chat_requests[-1])
    second = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id)
    sent = host.chat_requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"] == first.output_text
    assert second.previous_response_id == first.id and second.output_text == engine_text(
        engine, host.chat_requests[-1]
    )


def test_responses_stream(engine: FakeVLLM, host: AdapterHost) -> None:
    client = openai_client(host.url)
    deltas = []
    with client.responses.stream(model="tiny", input="Tell me a story", max_output_tokens=200) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    expected = engine_text(engine, host.chat_requests[-1])
    assert len(deltas) > 1 and "".join(deltas) == expected == final.output_text
    assert final.usage.output_tokens > 0 and final.status == "completed"


def test_responses_stream_cut_by_max_output_tokens_ends_incomplete(host: AdapterHost) -> None:
    # As OpenAI's API: `response.incomplete`, not `response.completed` (the SDK's stream helper then
    # has no final response, so read the raw events).
    client = openai_client(host.url)
    events = list(
        client.responses.create(model="tiny", input="Tell me a story", max_output_tokens=2, stream=True)
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 2


def test_responses_tool_calls_create_and_stream(tool_host: AdapterHost) -> None:
    client = openai_client(tool_host.url)
    response = client.responses.create(model="tiny", input="Weather in Paris?", tools=[RESPONSES_WEATHER])
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.call_id == TOOL_CALL_ID and json.loads(call.arguments) == json.loads(TOOL_ARGUMENTS)
    with client.responses.stream(
        model="tiny", input="Weather in Paris?", tools=[RESPONSES_WEATHER]
    ) as stream:
        argument_deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert "".join(argument_deltas) == TOOL_ARGUMENTS
    assert [i.type for i in final.output] == ["message", "function_call"] and final.output_text == "Checking."
    client.responses.create(
        model="tiny",
        previous_response_id=final.id,
        input=[{"type": "function_call_output", "call_id": TOOL_CALL_ID, "output": "18C"}],
        tools=[RESPONSES_WEATHER],
    )
    sent = tool_host.chat_requests[-1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"] and sent[1]["tool_calls"][0][
        "id"
    ] == TOOL_CALL_ID


def test_responses_malformed_requests_get_openai_errors(host: AdapterHost) -> None:
    client = openai_client(host.url)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="x", max_output_tokens="many")  # type: ignore[arg-type]
    assert (
        info.value.body["type"] == "invalid_request_error"
        and "max_output_tokens" in info.value.body["message"]
    )
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_unknown")
    assert "resp_unknown" in missing.value.body["message"]
