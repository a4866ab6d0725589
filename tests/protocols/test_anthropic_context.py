"""Anthropic's context management through the sidecar, applied as the API applies it: thinking and
tool-use clearing (what each clears, its keep / trigger / clear_at_least / exclude_tools /
clear_tool_inputs options, `context_management.applied_edits` with the tokens the engine's tokenizer
counts), and server-side compaction (`compact_20260112`), whose summary the policy writes in a call
of its own. The edited call says so on its span (agl.call.context_edits, agl.call.compaction)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
from agl import semconv
from agl_sidecar.protocols.anthropic_context import CLEARED_RESULT
from agl_sidecar.protocols.anthropic_thinking import sign
from anthropic.lib.streaming._beta_messages import accumulate_event
from anthropic.types.beta import BetaMessage, BetaRawMessageStreamEvent
from pydantic import TypeAdapter

from agl_testing.wire import parse_sse
from tests.harnesses.support import Turn
from tests.protocols.scripted import scripted_sidecar, small_agent_tokenizer

TOOL = {"name": "look", "input_schema": {"type": "object", "properties": {"at": {"type": "string"}}}}
KEEP = {"name": "note", "input_schema": {"type": "object", "properties": {}}}
EVENT = TypeAdapter(BetaRawMessageStreamEvent)


def tool_history(uses: int) -> list[dict[str, Any]]:
    """A user turn, then `uses` tool calls each answered (the last a `note`), the last result last."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "look around"}]
    for i in range(uses):
        name = "note" if i == uses - 1 else "look"
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"step {i}", "signature": "other-provider"},
            {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {"at": f"place {i}"}}]})  # fmt: skip
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"the view at place {i} " * 20}]})  # fmt: skip
    return messages


def body(edits: list[dict[str, Any]], uses: int = 4, **more: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": 16, "tools": [TOOL, KEEP], "messages": tool_history(uses),
            "thinking": {"type": "adaptive"}, "context_management": {"edits": edits}, **more}  # fmt: skip


def beta_stream(data: bytes) -> BetaMessage:
    snapshot, bufs = None, {}
    for _, payload in parse_sse(data):
        event = EVENT.validate_python(payload)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs, request_headers=httpx.Headers())
    assert snapshot is not None
    return BetaMessage.model_validate(snapshot.to_dict())


def test_tool_uses_are_cleared_oldest_first_with_what_they_freed_reported(tmp_path: Path) -> None:
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 10},
            "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["note"], "clear_tool_inputs": True}  # fmt: skip
    keep_all = {"type": "clear_thinking_20251015", "keep": "all"}
    with scripted_sidecar(small_agent_tokenizer(), lambda m, b: Turn("seen"), tmp_path) as scripted:
        answer = httpx.post(f"{scripted.url}/rollouts/clear/v1/messages", json=body([keep_all, edit]), timeout=60).json()
        [served] = scripted.engine.served
        [span] = scripted.spans("clear", 1)
        before, after = (len(scripted.engine.encode(scripted.engine.render(t))) for t in scripted.engine.tokenized)
    # four uses: `note` (the last) is excluded, and of the three `look`s the last is kept
    tools = [m for m in served.request["messages"] if m["role"] == "tool"]
    assert [t["content"] == CLEARED_RESULT for t in tools] == [True, True, False, False]
    calls = [c for m in served.request["messages"] for c in m.get("tool_calls") or ()]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{}, {}, {"at": "place 2"}, {"at": "place 3"}]
    assert answer["context_management"] == {"applied_edits": [
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 2, "cleared_input_tokens": before - after}]}  # fmt: skip
    assert before - after > 0 and len(served.prompt_ids) == after  # counted by the engine's own template
    assert span.attributes[semconv.CALL_CONTEXT_EDITS] == ["clear_tool_uses_20250919"]
    assert BetaMessage.model_validate(answer).context_management.applied_edits[0].cleared_tool_uses == 2  # type: ignore[union-attr]


def test_nothing_is_cleared_below_the_trigger_or_short_of_clear_at_least(tmp_path: Path) -> None:
    high = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 9}}
    greedy = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
              "keep": {"type": "tool_uses", "value": 3}, "clear_at_least": {"type": "input_tokens", "value": 10**6}}  # fmt: skip
    with scripted_sidecar(small_agent_tokenizer(), lambda m, b: Turn("seen"), tmp_path) as scripted:
        for edit in (high, greedy):
            answer = httpx.post(f"{scripted.url}/rollouts/kept/v1/messages", json=body([edit]), timeout=60).json()
            assert answer["context_management"] == {"applied_edits": []}
        assert all(CLEARED_RESULT not in json.dumps(s.request) for s in scripted.engine.served)
        assert len(scripted.engine.tokenized) == 2  # greedy: counted before and after, then not applied
        assert all(semconv.CALL_CONTEXT_EDITS not in s.attributes or s.attributes[semconv.CALL_CONTEXT_EDITS] == ["clear_thinking_20251015"]
                   for s in scripted.spans("kept", 2))  # fmt: skip


def test_thinking_of_older_turns_is_cleared_and_counted_streaming(tmp_path: Path) -> None:
    """Four turns (a question, a tool call, its result, an answer), each with its thinking: keep two
    and the first two turns lose theirs; a turn's tool loop keeps its thinking together."""
    edit = {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}
    messages: list[dict[str, Any]] = []
    for turn in range(4):
        messages += [
            {"role": "user", "content": f"question {turn}"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": f"plan {turn}", "signature": sign(f"plan {turn}")},
                                              {"type": "tool_use", "id": f"toolu_{turn}", "name": "look", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": "seen"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": f"answer {turn}", "signature": sign(f"answer {turn}")},
                                              {"type": "text", "text": f"answer {turn}"}]},
        ]  # fmt: skip
    request = {**body([edit]), "messages": [*messages, {"role": "user", "content": "go on"}], "stream": True}
    with scripted_sidecar(small_agent_tokenizer(), lambda m, b: Turn("seen"), tmp_path) as scripted:
        data = httpx.post(f"{scripted.url}/rollouts/think/v1/messages", json=request, timeout=60).content
        [served] = scripted.engine.served
        before, after = (len(scripted.engine.encode(scripted.engine.render(t))) for t in scripted.engine.tokenized)
        [span] = scripted.spans("think", 1)
    reasoning = [m.get("reasoning_content") for m in served.request["messages"] if m["role"] == "assistant"]
    assert reasoning == [None, None, None, None, "plan 2", "answer 2", "plan 3", "answer 3"]
    message = beta_stream(data)
    [applied] = message.context_management.applied_edits  # type: ignore[union-attr]
    assert (applied.type, applied.cleared_thinking_turns, applied.cleared_input_tokens) == ("clear_thinking_20251015", 2, before - after)  # type: ignore[union-attr]
    assert span.attributes[semconv.CALL_CONTEXT_EDITS] == ["clear_thinking_20251015"]


SUMMARY = "<summary>The user asked me to look around; I looked at four places.</summary>"


def compaction_script(messages: list[dict[str, Any]], body: dict[str, Any]) -> Turn:
    if "Summarize the conversation so far" in str(messages[-1]["content"]):
        return Turn(SUMMARY)
    return Turn("Onwards.")


def test_server_side_compaction_asks_the_policy_for_the_summary(tmp_path: Path) -> None:
    """Past its trigger, the request is compacted: the policy writes the summary in a call of its
    own (its own span, declared a compaction), the answer comes from the compacted context and opens
    with the compaction block, and the next request, carrying that block, extends the compacted
    call's tokens exactly."""
    edit = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 1000}}
    request = body([edit], system="You look around.")
    with scripted_sidecar(small_agent_tokenizer(), compaction_script, tmp_path) as scripted:
        client = anthropic.Anthropic(base_url=f"{scripted.url}/rollouts/compact", api_key="unused", max_retries=0)
        first = client.beta.messages.create(**request, betas=["compact-2026-01-12"])
        assert [b.type for b in first.content] == ["compaction", "text"]
        assert first.content[0].content == SUMMARY and first.content[1].text == "Onwards."  # type: ignore[union-attr]
        # the harness appends the answer and goes on; the API drops everything before the block
        follow = {**request, "messages": [*request["messages"], {"role": "assistant", "content": [
            b.model_dump(exclude_none=True) for b in first.content]}, {"role": "user", "content": "and then?"}]}  # fmt: skip
        second = client.beta.messages.create(**follow, betas=["compact-2026-01-12"])
        assert [b.type for b in second.content] == ["text"]
        summary_call, compacted, after = scripted.engine.served
        spans = scripted.spans("compact", 3)
    assert summary_call.request["messages"][-1]["role"] == "user" and not summary_call.request.get("stream")
    assert compacted.request["messages"] == [{"role": "system", "content": "You look around."}, {"role": "user", "content": SUMMARY}]
    assert after.prompt_ids[: len(compacted.prompt_ids) + len(compacted.completion_ids)] == compacted.prompt_ids + compacted.completion_ids
    apis = [s.attributes[semconv.CALL_API] for s in spans]
    assert apis == [semconv.API_CHAT_COMPLETIONS, semconv.API_ANTHROPIC_MESSAGES, semconv.API_ANTHROPIC_MESSAGES]
    assert [s.attributes.get(semconv.CALL_COMPACTION) for s in spans] == [True, True, None]
    assert spans[1].attributes[semconv.CALL_CONTEXT_EDITS] == ["compact_20260112"]
    assert spans[0].attributes[semconv.COMPLETION_TOKEN_IDS] == summary_call.completion_ids  # the summary: recorded, trained


def test_a_compaction_that_pauses_answers_with_the_block_alone(tmp_path: Path) -> None:
    edit = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 1000}, "pause_after_compaction": True,
            "instructions": "Summarize the conversation so far, briefly."}  # fmt: skip
    with scripted_sidecar(small_agent_tokenizer(), compaction_script, tmp_path) as scripted:
        unary = httpx.post(f"{scripted.url}/v1/messages", json=body([edit]), timeout=60).json()
        streamed = httpx.post(f"{scripted.url}/v1/messages", json=body([edit], stream=True), timeout=60).content
        assert len(scripted.engine.served) == 2  # the two summaries: no answer was generated
        assert scripted.engine.served[0].request["messages"][-1]["content"] == edit["instructions"]
    for message in (BetaMessage.model_validate(unary), beta_stream(streamed)):
        assert message.stop_reason == "compaction"
        assert [(b.type, b.content) for b in message.content] == [("compaction", SUMMARY)]  # type: ignore[union-attr]
