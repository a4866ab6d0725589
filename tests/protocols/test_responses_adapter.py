"""The Responses API adapter against real vLLM captures, checked with the openai SDK's types."""

from __future__ import annotations

import json

import pytest
from agl_sidecar.protocols.base import ProtocolError
from agl_sidecar.protocols.registry import adapter_for
from agl_sidecar.protocols.responses import RESPONSES, ConversationStore, ResponsesAdapter
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from agl_testing.wire import (
    TOOL_ARGUMENTS,
    TOOL_CALL_ID,
    chat_fixture,
    parse_sse,
    stream_fixture,
    tool_call_response,
    tool_call_stream,
    translate_stream,
)

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
BODY = {"model": "tiny", "input": "What is 2 + 2?", "max_output_tokens": 12}


def events_of(data: bytes) -> list[tuple[str, dict]]:
    """Every event validated strictly by the openai SDK's stream event union; sequence numbers checked."""
    events = parse_sse(data)
    for position, (_, payload) in enumerate(events):
        EVENT.validate_python(payload)
        assert payload["sequence_number"] == position
    return events


def test_registry_resolves_the_responses_route() -> None:
    assert adapter_for("/responses") is RESPONSES and RESPONSES.api == "openai.responses"


def test_request_with_instructions_items_and_tools_becomes_chat() -> None:
    body = {
        "model": "tiny",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather in Paris?"}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
        "temperature": 0.3,
        "max_output_tokens": 40,
        "metadata": {"k": "v"},
    }
    chat = ResponsesAdapter().to_chat_request(body).chat
    assert [m["role"] for m in chat["messages"]] == ["system", "system", "user", "assistant", "tool"]
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][3]["tool_calls"][0]["id"] == "call_1"
    assert chat["messages"][4]["tool_call_id"] == "call_1" and chat["messages"][4]["content"] == "18C"
    assert chat["tools"][0]["function"]["name"] == "get_weather"
    assert chat["max_tokens"] == 40 and chat["temperature"] == 0.3
    # litellm's own keys never reach the engine
    assert not {"custom_llm_provider", "metadata", "extra_headers"} & set(chat)
    json.dumps(chat)


def test_streaming_request_asks_for_usage() -> None:
    chat = ResponsesAdapter().to_chat_request({**BODY, "stream": True}).chat
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "stream" not in ResponsesAdapter().to_chat_request(BODY).chat


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("text", "JSON object"),
        ({"input": "hi"}, "model"),
        ({"model": "tiny"}, "input"),
        ({"model": "tiny", "input": 5}, "$.input"),
        ({**BODY, "max_output_tokens": -1}, "$.max_output_tokens"),
        ({**BODY, "tools": {"type": "function"}}, "$.tools"),
        ({**BODY, "previous_response_id": 3}, "$.previous_response_id"),
    ],
)
def test_malformed_requests_raise_openai_errors(body: object, needle: str) -> None:
    with pytest.raises(ProtocolError) as info:
        ResponsesAdapter().to_chat_request(body).chat  # type: ignore[arg-type]
    assert info.value.status == 400 and needle in info.value.message
    error = RESPONSES.error_body(info.value.status, info.value.message, info.value.error_type)
    assert error == {
        "error": {"message": info.value.message, "type": "invalid_request_error", "param": None, "code": None}
    }


def test_unknown_previous_response_is_a_404() -> None:
    with pytest.raises(ProtocolError) as info:
        ResponsesAdapter().to_chat_request({**BODY, "previous_response_id": "resp_nope"}).chat
    assert info.value.status == 404 and "resp_nope" in info.value.message


def test_text_response_is_a_valid_openai_response() -> None:
    adapter = ResponsesAdapter()
    adapter.to_chat_request(BODY).chat
    chat = chat_fixture("chat_nonstream_token_ids_logprobs")
    response = Response.model_validate(adapter.from_chat_response(chat, BODY))
    assert response.id == "resp_b4521538401b4e10"
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        18,
        12,
        30,
    )
    eos = Response.model_validate(
        adapter.from_chat_response(chat_fixture("chat_nonstream_finish_stop_eos"), BODY)
    )
    assert eos.status == "completed" and eos.incomplete_details is None


def test_tool_call_response_is_a_function_call_item() -> None:
    body = {**BODY, "tools": [WEATHER_TOOL]}
    response = Response.model_validate(RESPONSES.from_chat_response(tool_call_response("Checking."), body))
    assert [item.type for item in response.output] == ["message", "function_call"]
    call = response.output[1]
    assert call.call_id == TOOL_CALL_ID and call.name == "get_weather" and call.arguments == TOOL_ARGUMENTS
    assert response.tools[0].name == "get_weather"


def test_previous_response_id_replays_the_conversation() -> None:
    adapter = ResponsesAdapter()
    first_body = {
        "model": "tiny",
        "instructions": "Be brief.",
        "input": "Weather in Paris?",
        "tools": [WEATHER_TOOL],
    }
    adapter.to_chat_request(first_body).chat
    first = adapter.from_chat_response(tool_call_response(), first_body)
    second_body = {
        "model": "tiny",
        "previous_response_id": first["id"],
        "input": [{"type": "function_call_output", "call_id": TOOL_CALL_ID, "output": "18C"}],
        "tools": [WEATHER_TOOL],
    }
    chat = adapter.to_chat_request(second_body).chat
    # instructions are not inherited; the user turn, the tool call and its output are
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool"]
    assert chat["messages"][1]["tool_calls"][0]["id"] == TOOL_CALL_ID
    assert chat["messages"][2]["tool_call_id"] == TOOL_CALL_ID
    second = adapter.from_chat_response(chat_fixture("chat_nonstream_finish_stop_eos"), second_body)
    assert Response.model_validate(second).previous_response_id == first["id"]
    third = adapter.to_chat_request(
        {"model": "tiny", "previous_response_id": second["id"], "input": "Thanks"}
    ).chat
    assert [m["role"] for m in third["messages"]] == ["user", "assistant", "tool", "assistant", "user"]


def test_store_false_is_not_kept() -> None:
    adapter = ResponsesAdapter()
    body = {**BODY, "store": False}
    adapter.to_chat_request(body).chat
    response = adapter.from_chat_response(chat_fixture("chat_nonstream_finish_stop_eos"), body)
    assert response["id"] not in adapter.store and len(adapter.store) == 0


def test_conversation_store_is_bounded_by_count_and_bytes() -> None:
    store = ConversationStore(max_entries=3, max_bytes=10_000)
    for i in range(5):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}])
    assert len(store) == 3 and "r0" not in store and "r1" not in store
    store.get("r2")  # touch: now the most recently used
    store.put("r5", [{"role": "user", "content": "5"}])
    assert "r2" in store and "r3" not in store
    store.put("big", [{"role": "user", "content": "x" * 9_950}])
    assert "big" in store and store.bytes <= 10_000 and len(store) == 1  # evicted by bytes
    store.put("huge", [{"role": "user", "content": "x" * 20_000}])  # larger than the whole store
    assert "huge" not in store and "big" in store
    assert store.get("big") == [{"role": "user", "content": "x" * 9_950}]


@pytest.mark.parametrize("fixture", ["chat_stream_include_usage", "chat_stream_token_ids_logprobs_usage"])
def test_text_stream_is_translated_chunk_by_chunk(fixture: str) -> None:
    chunks = stream_fixture(fixture)
    adapter = ResponsesAdapter()
    body = {**BODY, "stream": True}
    adapter.to_chat_request(body).chat
    data, sizes = translate_stream(adapter.stream_translator(body), chunks)
    assert sizes[0] > 0 and sizes[1] > 0
    events = events_of(data)
    names = [name for name, _ in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-1] == "response.incomplete"  # finish_reason length
    expected = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "".join(p["delta"] for n, p in events if n == "response.output_text.delta") == expected
    final = Response.model_validate(events[-1][1]["response"])
    assert final.output_text == expected and final.usage.output_tokens == 12
    assert final.id in adapter.store


def test_tool_call_stream_carries_argument_deltas_and_chains() -> None:
    adapter = ResponsesAdapter()
    body = {"model": "tiny", "input": "Weather in Paris?", "tools": [WEATHER_TOOL], "stream": True}
    adapter.to_chat_request(body).chat
    data, _ = translate_stream(adapter.stream_translator(body), tool_call_stream(text_first="Checking."))
    events = events_of(data)
    names = [n for n, _ in events]
    assert names.count("response.function_call_arguments.delta") == 4
    done = next(p for n, p in events if n == "response.function_call_arguments.done")
    assert done["arguments"] == TOOL_ARGUMENTS
    final = Response.model_validate(events[-1][1]["response"])
    assert names[-1] == "response.completed"
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert final.output[1].call_id == TOOL_CALL_ID and final.output[1].arguments == TOOL_ARGUMENTS
    follow = adapter.to_chat_request(
        {
            "model": "tiny",
            "previous_response_id": final.id,
            "input": [{"type": "function_call_output", "call_id": TOOL_CALL_ID, "output": "18C"}],
        }
    ).chat
    assistant = follow["messages"][1]
    assert (
        assistant["content"] == "Checking."
        and assistant["tool_calls"][0]["function"]["arguments"] == TOOL_ARGUMENTS
    )


def test_a_stream_cut_before_finishing_ends_as_failed() -> None:
    chunks = stream_fixture("chat_stream_include_usage")[:4]
    data, _ = translate_stream(RESPONSES.stream_translator(BODY), chunks)
    name, payload = events_of(data)[-1]
    assert name == "response.failed" and Response.model_validate(payload["response"]).status == "failed"


def test_reasoning_becomes_a_reasoning_item_streamed_and_not() -> None:
    chunks = stream_fixture("chat_stream_include_usage")
    for chunk in chunks[1:3]:
        chunk["choices"][0]["delta"] = {"reasoning": "think "}
    data, _ = translate_stream(ResponsesAdapter().stream_translator(BODY), chunks)
    events = events_of(data)
    assert [n for n, _ in events].count("response.reasoning_text.delta") == 2
    final = Response.model_validate(events[-1][1]["response"])
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "think think "
    chat = chat_fixture("chat_nonstream_finish_stop_eos")
    chat["choices"][0]["message"]["reasoning"] = "2 and 2 make 4."
    response = Response.model_validate(ResponsesAdapter().from_chat_response(chat, BODY))
    assert [i.type for i in response.output] == ["reasoning", "message"]
