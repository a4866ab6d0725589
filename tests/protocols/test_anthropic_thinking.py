"""Adaptive thinking: the engine's reasoning (vLLM's `reasoning`) returned as thinking blocks whose
signature carries the text, `display: "omitted"` honoured as Anthropic does (no text, the signature
only), and a thinking block sent back rendered as the model's reasoning, token-exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import pytest
from agl import semconv
from agl_sidecar.protocols import anthropic_thinking as thinking
from agl_sidecar.protocols.anthropic import MESSAGES
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from agl_testing.wire import chat_fixture, parse_sse, stream_fixture, translate_stream
from tests.harnesses.support import Turn
from tests.protocols.scripted import scripted_sidecar, small_agent_tokenizer

BODY = {"model": "tiny", "max_tokens": 12, "messages": [{"role": "user", "content": "What is 2 + 2?"}]}
OMITTED = {**BODY, "thinking": {"type": "adaptive", "display": "omitted"}}
EVENT = TypeAdapter(RawMessageStreamEvent)


def accumulate(data: bytes) -> Message:
    snapshot, bufs = None, {}
    for _, payload in parse_sse(data):
        snapshot = accumulate_event(event=EVENT.validate_python(payload), current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot is not None
    return Message.model_validate(snapshot.to_dict())


@pytest.mark.parametrize("reasoning", ["2 and 2 make 4.", "", "ünïcödé\n<think> and \u2028 lines"])
def test_a_signature_carries_the_reasoning_whole(reasoning: str) -> None:
    assert thinking.unsign(thinking.sign(reasoning)) == reasoning
    assert thinking.unsign("EqQBCgIYAhIM-anthropic-signed") is None  # another provider's
    assert thinking.unsign(thinking.PREFIX + "!!not base64!!") is None


@pytest.mark.parametrize("body", [BODY, OMITTED], ids=["shown", "omitted"])
def test_the_reasoning_is_a_signed_thinking_block(body: dict[str, Any]) -> None:
    chat = chat_fixture("chat_nonstream_finish_stop_eos")
    chat["choices"][0]["message"]["reasoning"] = "2 and 2 make 4."
    message = Message.model_validate(MESSAGES.from_chat_response(chat, body))
    block = message.content[0]
    assert block.type == "thinking" and thinking.unsign(block.signature) == "2 and 2 make 4."
    assert block.thinking == ("" if body is OMITTED else "2 and 2 make 4.")


@pytest.mark.parametrize("body", [BODY, OMITTED], ids=["shown", "omitted"])
def test_a_streamed_thinking_block_sends_its_signature_last(body: dict[str, Any]) -> None:
    chunks = stream_fixture("chat_stream_include_usage")
    for chunk in chunks[1:3]:
        chunk["choices"][0]["delta"] = {"reasoning": "think "}
    data, _ = translate_stream(MESSAGES.stream_translator(body), chunks)
    deltas = [p["delta"]["type"] for name, p in parse_sse(data) if name == "content_block_delta" and p["index"] == 0]
    assert deltas == (["signature_delta"] if body is OMITTED else ["thinking_delta", "thinking_delta", "signature_delta"])
    block = accumulate(data).content[0]
    assert block.type == "thinking" and thinking.unsign(block.signature) == "think think "
    assert block.thinking == ("" if body is OMITTED else "think think ")


def test_a_returned_thinking_block_is_the_assistant_s_reasoning() -> None:
    signed = thinking.sign("exactly this")
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}  # as Claude Code asks
    body = {**OMITTED, "context_management": keep_all, "messages": [
        *BODY["messages"],
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": signed},
                                          {"type": "text", "text": "4"}]},
        {"role": "user", "content": [{"type": "text", "text": "and 3 + 3?"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "shown text", "signature": "anthropic-sig"},
                                          {"type": "text", "text": "6"}]},
        {"role": "user", "content": "and 4 + 4?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "anthropic-sig"},
                                          {"type": "text", "text": "8"}]},
        {"role": "user", "content": "thanks"},
    ]}  # fmt: skip
    translation = MESSAGES.to_chat_request(body)
    assistants = [m for m in translation.chat["messages"] if m["role"] == "assistant"]
    # ours: read from the signature; another provider's with text: its text; without: nothing to read
    assert [(m.get("reasoning_content"), m.get("reasoning")) for m in assistants] == [
        ("exactly this", "exactly this"), ("shown text", "shown text"), (None, None),
    ]
    assert "thinking_blocks" not in str(translation.chat)
    assert translation.dropped == ("messages[5].content[0]: a thinking block another provider signed, its text omitted: unreadable",)
    assert translation.context_edits == ()  # keep all: nothing cleared
    # Without the edit, the API keeps the last assistant turn's thinking only, and so does the sidecar.
    default = MESSAGES.to_chat_request({k: v for k, v in body.items() if k != "context_management"})
    assert [m.get("reasoning_content") for m in default.chat["messages"] if m["role"] == "assistant"] == [None, None, None]
    assert default.context_edits == ("clear_thinking_20251015",)
    last_turn = {**body, "context_management": None, "messages": body["messages"][:4]}
    kept = MESSAGES.to_chat_request(last_turn)
    assert [m.get("reasoning_content") for m in kept.chat["messages"] if m["role"] == "assistant"] == [None, "shown text"]


def test_thinking_renders_back_token_exactly_through_the_sidecar(tmp_path: Path) -> None:
    """Claude Code's way: `display: omitted`, streaming, the turn sent back as it came. The second
    call's prompt extends the first call's prompt and completion exactly, reasoning tokens included,
    and those tokens are the span's."""

    def script(messages: list[dict[str, Any]], body: dict[str, Any]) -> Turn:
        if messages[-1]["role"] == "tool":
            return Turn("It is 4.", reasoning="The tool says 4.")
        return Turn(reasoning="I will add with the tool.", tool_calls=[("add", {"a": 2, "b": 2})])

    tool = {"name": "add", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
    with scripted_sidecar(small_agent_tokenizer(), script, tmp_path) as scripted:
        client = anthropic.Anthropic(base_url=f"{scripted.url}/rollouts/think", api_key="unused", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 2?"}]
        for _ in range(2):
            with client.messages.stream(model="tiny", max_tokens=64, messages=messages, tools=[tool],
                                        thinking={"type": "adaptive", "display": "omitted"}) as stream:  # type: ignore[typeddict-item]
                message = stream.get_final_message()
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
            if message.stop_reason == "tool_use":
                messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": message.content[-1].id, "content": "4"}]})  # type: ignore[union-attr]
        first_thinking = messages[1]["content"][0]
        assert first_thinking["type"] == "thinking" and first_thinking["thinking"] == ""  # omitted
        assert message.content[1].text == "It is 4."  # type: ignore[union-attr]
        first, second = scripted.engine.served
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == first.prompt_ids + first.completion_ids
        spans = scripted.spans("think", 2)
        assert [s.attributes[semconv.COMPLETION_TOKEN_IDS] for s in spans] == [first.completion_ids, second.completion_ids]
