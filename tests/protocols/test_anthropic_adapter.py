"""The Anthropic Messages adapter against real vLLM captures, checked with the anthropic SDK's types."""

from __future__ import annotations

import json

import pytest
from agl_sidecar.protocols.anthropic import COUNT_TOKENS, MESSAGES
from agl_sidecar.protocols.base import ProtocolError
from agl_sidecar.protocols.registry import adapter_for
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
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

EVENT = TypeAdapter(RawMessageStreamEvent)
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
BODY = {"model": "tiny", "max_tokens": 12, "messages": [{"role": "user", "content": "What is 2 + 2?"}]}


def accumulate(data: bytes) -> Message:
    """Validate every event strictly, then fold them as the anthropic SDK's MessageStream does."""
    snapshot, bufs = None, {}
    for _, payload in parse_sse(data):
        event = EVENT.validate_python(payload)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot is not None
    return Message.model_validate(snapshot.to_dict())


def test_registry_resolves_both_anthropic_routes() -> None:
    assert adapter_for("/messages") is MESSAGES
    assert adapter_for("/messages/count_tokens") is COUNT_TOKENS
    assert MESSAGES.api == "anthropic.messages" and not MESSAGES.tokenize_only and COUNT_TOKENS.tokenize_only


def test_request_with_system_tools_and_tool_results_becomes_chat() -> None:
    body = {
        "model": "tiny",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Be brief."}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "stop_sequences": ["\n\nHuman:"],
        "temperature": 0.2,
        "top_k": 5,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "18C"}],
            },
        ],
    }
    chat = MESSAGES.to_chat_request(body).chat
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert "Be brief." in json.dumps(chat["messages"][0]["content"])
    call = chat["messages"][2]["tool_calls"][0]
    assert call["id"] == "toolu_01" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert "thinking_blocks" not in chat["messages"][2]
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_01", "content": "18C"}
    assert chat["tools"][0]["function"]["name"] == "get_weather"
    assert chat["tools"][0]["function"]["parameters"] == WEATHER_TOOL["input_schema"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["stop"] == ["\n\nHuman:"] and chat["max_tokens"] == 64 and chat["top_k"] == 5
    assert "stream" not in chat
    assert body["messages"][0] == {"role": "user", "content": "Weather in Paris?"}  # body left intact
    json.dumps(chat)  # plain JSON, ready for the engine


def test_streaming_request_asks_the_engine_for_usage() -> None:
    chat = MESSAGES.to_chat_request({**BODY, "stream": True}).chat
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ([1, 2], "JSON object"),
        ({"model": "tiny", "messages": BODY["messages"]}, "max_tokens"),
        ({"model": "tiny", "max_tokens": 5}, "messages"),
        ({**BODY, "max_tokens": "12"}, "$.max_tokens"),
        ({**BODY, "max_tokens": 0}, "$.max_tokens"),
        ({**BODY, "messages": []}, "$.messages"),
        ({**BODY, "messages": [{"role": "", "content": "x"}]}, "$.messages[0].role"),
        ({**BODY, "messages": [{"role": "user", "content": ""}]}, "$.messages[0].content"),
        ({**BODY, "messages": [{"role": "user", "content": []}]}, "$.messages[0].content"),
        ({**BODY, "messages": [{"role": "assistant", "content": ""}, *BODY["messages"]]}, "$.messages[0].content"),
        ({**BODY, "messages": [{"role": "user", "content": 7}]}, "$.messages[0].content"),
        ({**BODY, "tools": [{"description": "no name"}]}, "$.tools[0]"),
        ({**BODY, "stream": "yes"}, "$.stream"),
    ],
)
def test_malformed_requests_raise_anthropic_errors(body: object, needle: str) -> None:
    with pytest.raises(ProtocolError) as info:
        MESSAGES.to_chat_request(body).chat  # type: ignore[arg-type]
    assert info.value.status == 400 and needle in info.value.message
    error = MESSAGES.error_body(info.value.status, info.value.message, info.value.error_type)
    assert error == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": info.value.message},
    }


def test_error_body_types_by_status_when_the_type_is_not_anthropic() -> None:
    assert MESSAGES.error_body(404, "no such model", "NotFoundError")["error"]["type"] == "not_found_error"
    assert MESSAGES.error_body(503, "engine down", "upstream_error")["error"]["type"] == "api_error"
    assert MESSAGES.error_body(429, "slow down", "rate_limit_error")["error"]["type"] == "rate_limit_error"


def test_text_response_is_a_valid_anthropic_message() -> None:
    chat = chat_fixture("chat_nonstream_token_ids_logprobs")
    message = Message.model_validate(MESSAGES.from_chat_response(chat, BODY))
    assert (
        message.content[0].type == "text"
        and message.content[0].text == chat["choices"][0]["message"]["content"]
    )
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (18, 12)


def test_eos_stop_is_end_turn_and_a_stop_string_is_reported() -> None:
    eos = MESSAGES.from_chat_response(chat_fixture("chat_nonstream_finish_stop_eos"), BODY)
    assert eos["stop_reason"] == "end_turn" and eos["stop_sequence"] is None
    # litellm drops vLLM's `stop_reason` ("sy" here): the adapter puts it back.
    stopped = Message.model_validate(
        MESSAGES.from_chat_response(chat_fixture("chat_nonstream_stop_string"), BODY)
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "sy"


def test_only_the_first_choice_becomes_the_message() -> None:
    chat = chat_fixture("chat_nonstream_n2_token_ids")
    message = Message.model_validate(MESSAGES.from_chat_response(chat, BODY))
    assert len(message.content) == 1 and message.content[0].text == chat["choices"][0]["message"]["content"]


def test_tool_call_response_becomes_tool_use() -> None:
    message = Message.model_validate(MESSAGES.from_chat_response(tool_call_response(content=""), BODY))
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["tool_use"]  # the empty text block is dropped
    block = message.content[0]
    assert (
        block.id == TOOL_CALL_ID and block.name == "get_weather" and block.input == json.loads(TOOL_ARGUMENTS)
    )


def test_vllm_reasoning_becomes_a_thinking_block() -> None:
    chat = chat_fixture("chat_nonstream_finish_stop_eos")
    chat["choices"][0]["message"]["reasoning"] = "2 and 2 make 4."
    message = Message.model_validate(MESSAGES.from_chat_response(chat, BODY))
    assert message.content[0].type == "thinking" and message.content[0].thinking == "2 and 2 make 4."
    assert message.content[1].type == "text"


@pytest.mark.parametrize("fixture", ["chat_stream_include_usage", "chat_stream_token_ids_logprobs_usage"])
def test_text_stream_is_translated_chunk_by_chunk(fixture: str) -> None:
    chunks = stream_fixture(fixture)
    data, sizes = translate_stream(MESSAGES.stream_translator({**BODY, "stream": True}), chunks)
    assert sizes[0] > 0 and sizes[1] > 0  # message_start, then the first text, before the stream ends
    names = [name for name, _ in parse_sse(data)]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    message = accumulate(data)
    expected = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == expected
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 12


def test_stream_with_stop_string_and_no_usage_chunk_still_closes() -> None:
    chunks = stream_fixture("chat_stream_stop_string")
    assert not any(c.get("usage") for c in chunks)
    translator = MESSAGES.stream_translator(BODY)
    head = b"".join(b for c in chunks for b in translator.feed(c))
    assert b"message_stop" not in head  # waits for a usage chunk that may still come
    message = accumulate(head + b"".join(translator.finish()))
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "sy"


def test_tool_use_stream_carries_input_json_deltas() -> None:
    chunks = tool_call_stream(text_first="Let me check.")
    data, _ = translate_stream(MESSAGES.stream_translator(BODY), chunks)
    events = parse_sse(data)
    deltas = [p["delta"] for n, p in events if n == "content_block_delta"]
    assert [d["type"] for d in deltas] == ["text_delta"] + ["input_json_delta"] * 4
    message = accumulate(data)
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Let me check."
    tool = message.content[1]
    assert tool.id == TOOL_CALL_ID and tool.name == "get_weather" and tool.input == json.loads(TOOL_ARGUMENTS)
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 6


def test_two_parallel_tool_calls_are_two_blocks() -> None:
    chunks = tool_call_stream()
    second = json.loads(json.dumps(chunks[1]))
    call = second["choices"][0]["delta"]["tool_calls"][0]
    call.update(index=1, id="chatcmpl-tool-second")
    call["function"]["arguments"] = '{"city": "Oslo"}'
    message = accumulate(
        translate_stream(MESSAGES.stream_translator(BODY), [*chunks[:-2], second, *chunks[-2:]])[0]
    )
    assert [(b.id, b.input) for b in message.content] == [
        (TOOL_CALL_ID, json.loads(TOOL_ARGUMENTS)),
        ("chatcmpl-tool-second", {"city": "Oslo"}),
    ]


def test_an_empty_stream_still_yields_a_well_formed_message() -> None:
    message = accumulate(b"".join(MESSAGES.stream_translator(BODY).finish()))
    assert message.content == [] and message.stop_reason == "end_turn"


def test_count_tokens_uses_the_engine_tokenizer_answer() -> None:
    body = {"model": "tiny", "messages": BODY["messages"], "tools": [WEATHER_TOOL], "system": "Be brief."}
    request = COUNT_TOKENS.to_chat_request(body).chat
    assert request["add_generation_prompt"] is True and request["messages"][0]["role"] == "system"
    assert request["tools"][0]["function"]["name"] == "get_weather"
    assert set(request) == {"model", "messages", "add_generation_prompt", "tools"}
    answer = chat_fixture("info_tokenize_chat")
    assert MessageTokensCount.model_validate(COUNT_TOKENS.from_chat_response(answer, body)).input_tokens == 18
    with pytest.raises(ProtocolError) as info:
        COUNT_TOKENS.from_chat_response({"detail": "Not Found"}, body)
    assert info.value.status == 502


def test_count_tokens_needs_no_max_tokens_but_checks_messages() -> None:
    COUNT_TOKENS.to_chat_request({"model": "tiny", "messages": BODY["messages"]}).chat
    with pytest.raises(ProtocolError, match="messages"):
        COUNT_TOKENS.to_chat_request({"model": "tiny"}).chat


@pytest.mark.parametrize("arguments", ['{"city": "Par', "[1, 2]", "null"])
def test_tool_arguments_that_are_not_a_json_object_are_kept_whole(arguments: str) -> None:
    chat = tool_call_response()
    chat["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = arguments
    message = Message.model_validate(MESSAGES.from_chat_response(chat, BODY))
    assert message.content[0].input == {"_raw_arguments": arguments}


def test_no_choices_is_still_a_message() -> None:
    chat = {**chat_fixture("chat_nonstream_plain"), "choices": []}
    message = Message.model_validate(MESSAGES.from_chat_response(chat, BODY))
    assert message.content == [] and message.stop_reason == "end_turn"


def test_claude_code_shaped_request_is_cleaned_for_the_engine() -> None:
    mark = {"type": "ephemeral"}
    body = {
        "model": "tiny",
        "max_tokens": 32000,
        "stream": True,
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": mark}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": "user_1"},
        "tools": [{**WEATHER_TOOL, "cache_control": mark}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": mark}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Look first.", "signature": ""},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "9C"}],
                    }
                ],
            },
        ],
    }
    original = json.loads(json.dumps(body))
    chat = MESSAGES.to_chat_request(body).chat
    assert body == original  # the harness's request is not modified
    wire = json.dumps(chat)
    assert "cache_control" not in wire and "thinking_blocks" not in wire and "budget_tokens" not in wire
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assistant = chat["messages"][2]
    assert assistant["reasoning_content"] == "Look first." and assistant["tool_calls"][0]["id"] == "toolu_1"
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "9C"}
    assert chat["user"] == "user_1"


def test_reasoning_stream_opens_a_thinking_block_first() -> None:
    chunks = stream_fixture("chat_stream_include_usage")
    for chunk in chunks[1:3]:
        chunk["choices"][0]["delta"] = {"reasoning": "think "}
    data, _ = translate_stream(MESSAGES.stream_translator(BODY), chunks)
    message = accumulate(data)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "think think "
