"""Codex's Responses wire, in the adapter: every request Codex 0.169.0 sent in the captures
(tests/fixtures/codex-0.169.0) translates; namespace and custom tools go to the engine flattened and
come back as the harness named them; reasoning and compaction summaries travel in the sidecar's own
`encrypted_content`; a `compaction_trigger` asks the engine for the summary; what Codex declares in
`client_metadata` (its thread, the thread that spawned it, a compaction) is read."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from agl_sidecar.protocols.base import Declared
from agl_sidecar.protocols.responses import ResponsesAdapter
from agl_sidecar.protocols.responses_compaction import COMPACTION_PROMPT, SUMMARY_PREFIX
from agl_sidecar.protocols.responses_declared import Windows
from agl_sidecar.protocols.responses_tokens import COMPACTION, REASONING, seal, unseal
from agl_testing.wire import chat_fixture, parse_sse, tool_call_response, tool_call_stream, translate_stream
from tests.harnesses.codex_support import captured

SCENARIOS = ["plain_prompt", "shell_loop", "reasoning_round_trip", "subagent", "local_compaction",
             "websocket_shell_loop", "remote_compaction"]  # fmt: skip
EVENT = TypeAdapter(ResponseStreamEvent)
SHELL = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.",
          "tools": [{**SHELL, "name": "spawn_agent"}, {**SHELL, "name": "wait_agent"}]}  # fmt: skip
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}  # fmt: skip
BASE = {"model": "tiny", "stream": True, "store": False, "include": ["reasoning.encrypted_content"]}


def requests_of(scenario: str) -> list[dict[str, Any]]:
    """Every Responses request body Codex sent in `scenario`, over HTTP or as a WebSocket message."""
    bodies = []
    for exchange in captured(scenario)["exchanges"]:
        if exchange.get("body"):
            bodies.append(exchange["body"])
        for message in exchange.get("messages", ()):
            bodies.append({k: v for k, v in message.items() if k not in ("type", "generate")})
    return bodies


def engine_reply(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    chat = chat_fixture("chat_nonstream_finish_stop_eos")
    chat["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [], "reasoning": None, **message}
    chat["choices"][0]["finish_reason"] = finish
    return chat


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_request_codex_sent_translates(scenario: str) -> None:
    adapter = ResponsesAdapter(keep_unstored=True, windows=Windows())
    previous: dict[str, Any] | None = None
    for body in requests_of(scenario):
        if body.get("previous_response_id") and previous is not None:  # the capture server's ids
            body = {**body, "previous_response_id": previous["id"]}
        translation = adapter.to_chat_request(body)
        chat = translation.chat
        roles = {m["role"] for m in chat["messages"]}
        assert roles <= {"system", "user", "assistant", "tool"}, roles  # developer became system
        names = [t["function"]["name"] for t in chat.get("tools", [])]
        if body.get("tools"):  # Codex's sub-agent tools flattened; web_search dropped and said so
            assert "multi_agent_v1__spawn_agent" in names and "exec_command" in names
            assert "tools[8]: web_search: a hosted tool the engine cannot run" in translation.dropped
        assert translation.declared is not None and translation.declared.agent_id == body["client_metadata"]["thread_id"]
        assert translation.declared.parent_agent_id == body["client_metadata"].get("x-codex-parent-thread-id")
        json.dumps(chat)
        previous = adapter.answer_without_generating(body)


def test_codex_headers_of_the_captures_are_what_the_docs_say() -> None:
    """What docs/protocols.md says Codex sends (so a change in a new Codex shows up here first)."""
    plain = captured("plain_prompt")["exchanges"][0]
    assert plain["headers"]["x-codex-beta-features"] == "remote_compaction_v2"
    assert set(plain["body"]) == {"model", "stream", "input", "tools", "tool_choice", "parallel_tool_calls",
                                  "reasoning", "store", "include", "prompt_cache_key", "client_metadata"}  # fmt: skip
    socket = captured("websocket_shell_loop")["exchanges"][0]
    assert socket["transport"] == "websocket" and socket["headers"]["openai-beta"] == "responses_websockets=2026-02-06"
    prewarm, *later = socket["messages"]
    assert prewarm["generate"] is False and all(m.get("previous_response_id") for m in later)
    sub = captured("subagent")["exchanges"][2]["headers"]
    assert sub["x-openai-subagent"] == "collab_spawn" and sub["x-codex-parent-thread-id"]
    trigger = captured("remote_compaction")["exchanges"][0]["messages"][2]["input"][-1]
    assert trigger == {"type": "compaction_trigger"}


def test_a_namespace_function_goes_flat_to_the_engine_and_comes_back_named_as_codex_sent_it() -> None:
    adapter = ResponsesAdapter()
    body = {**BASE, "stream": False, "tools": [SHELL, AGENTS], "input": "delegate"}
    chat = adapter.to_chat_request(body).chat
    assert [t["function"]["name"] for t in chat["tools"]] == [
        "exec_command", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent"]  # fmt: skip
    called = tool_call_response()
    called["choices"][0]["message"]["tool_calls"][0]["function"]["name"] = "multi_agent_v1__spawn_agent"
    response = Response.model_validate(adapter.from_chat_response(called, body))
    call = response.output[0].model_dump()
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "spawn_agent", "multi_agent_v1")
    # streamed, the same; and sent back, the engine sees the name it wrote
    stream_body = {**body, "stream": True}
    adapter.to_chat_request(stream_body)
    chunks = tool_call_stream()
    for chunk in chunks:
        for choice in chunk["choices"]:
            for delta in choice["delta"].get("tool_calls") or ():
                if "name" in delta.get("function", {}):
                    delta["function"]["name"] = "multi_agent_v1__spawn_agent"
    data, _ = translate_stream(adapter.stream_translator(stream_body), chunks)
    events = [p for _, p in parse_sse(data)]
    for event in events:
        EVENT.validate_python(event)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"][0]
    assert (done["name"], done["namespace"]) == ("spawn_agent", "multi_agent_v1")
    follow = {**body, "input": [{"role": "user", "content": "delegate"}, done,
                                {"type": "function_call_output", "call_id": done["call_id"], "output": "{}"}]}  # fmt: skip
    sent = adapter.to_chat_request(follow).chat["messages"][1]["tool_calls"][0]
    assert sent["function"]["name"] == "multi_agent_v1__spawn_agent" and sent["id"] == done["call_id"]


def test_a_custom_tool_is_a_function_of_one_string_for_the_engine() -> None:
    adapter = ResponsesAdapter()
    body = {**BASE, "stream": False, "tools": [PATCH], "input": "fix it"}
    translation = adapter.to_chat_request(body)
    (tool,) = translation.chat["tools"]
    assert tool["function"]["name"] == "apply_patch"
    assert tool["function"]["parameters"]["required"] == ["input"]
    patch = "*** Begin Patch\n*** End Patch"
    called = tool_call_response()
    called["choices"][0]["message"]["tool_calls"][0]["function"] = {"name": "apply_patch",
                                                                    "arguments": json.dumps({"input": patch})}  # fmt: skip
    item = adapter.from_chat_response(called, body)["output"][0]
    assert (item["type"], item["name"], item["input"]) == ("custom_tool_call", "apply_patch", patch)
    back = adapter.to_chat_request({**body, "input": [item, {"type": "custom_tool_call_output", "call_id": item["call_id"],
                                                             "output": "applied"}]}).chat  # fmt: skip
    assert json.loads(back["messages"][0]["tool_calls"][0]["function"]["arguments"]) == {"input": patch}
    assert back["messages"][1] == {"role": "tool", "tool_call_id": item["call_id"], "content": "applied"}


def test_reasoning_comes_back_from_the_sidecars_token_not_from_what_the_harness_shows() -> None:
    adapter = ResponsesAdapter()
    body = {**BASE, "stream": False, "tools": [SHELL], "input": "list files"}
    adapter.to_chat_request(body)
    thought = "The user wants files.\n  I will run ls."
    answer = engine_reply({"reasoning": thought, "tool_calls": tool_call_response()["choices"][0]["message"]["tool_calls"]},
                          "tool_calls")  # fmt: skip
    output = adapter.from_chat_response(answer, body)["output"]
    reasoning, call = output
    assert unseal(reasoning["encrypted_content"], REASONING) == thought
    outcome = {"type": "function_call_output", "call_id": call["call_id"], "output": "a.py"}

    def assistant(item: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
        translation = adapter.to_chat_request({**body, "input": [{"role": "user", "content": "list files"}, item, call, outcome]})
        return translation.chat["messages"][1], translation.dropped

    shown = {**reasoning, "content": [{"type": "reasoning_text", "text": "edited"}]}
    message, dropped = assistant(shown)  # the token wins over what the harness shows
    assert message["reasoning"] == message["reasoning_content"] == thought and message["tool_calls"][0]["id"] == call["call_id"]
    assert dropped == ()
    tampered = {**shown, "encrypted_content": reasoning["encrypted_content"][:-3] + "AAA"}
    message, dropped = assistant(tampered)  # a changed token is not read: the text shown is used
    assert message["reasoning"] == "edited"
    assert dropped == ("input[1].encrypted_content: not issued by this sidecar, so the engine cannot be given its content",)
    foreign = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}],
               "encrypted_content": "gAAAAABo-openai"}  # fmt: skip
    message, dropped = assistant(foreign)
    assert "reasoning" not in message and len(dropped) == 2  # the token, and the summary


def test_tokens_hold_their_text_and_kind_only() -> None:
    token = seal(COMPACTION, "summary: ünïcode and \n newlines")
    assert unseal(token, COMPACTION) == "summary: ünïcode and \n newlines"
    assert unseal(token, REASONING) is None
    assert unseal(token.replace("agl1.", "agl2."), COMPACTION) is None
    body, mac = token.rsplit(".", 1)
    assert unseal(body + "." + mac[::-1], COMPACTION) is None and unseal(body[:-2] + "." + mac, COMPACTION) is None


def test_a_compaction_trigger_is_served_by_the_engine_and_its_summary_replaces_the_history() -> None:
    adapter = ResponsesAdapter(windows=Windows())
    history = [{"role": "user", "content": "run echo"},
               {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c1", "output": "hi"}]  # fmt: skip
    body = {**BASE, "tools": [SHELL], "input": [*history, {"type": "compaction_trigger"}]}
    translation = adapter.to_chat_request(body)
    chat = translation.chat
    assert chat["messages"][-1] == {"role": "user", "content": COMPACTION_PROMPT}
    assert chat["tool_choice"] == "none" and [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool", "user"]
    assert translation.declared == Declared(compaction=True)
    # streamed: one compaction item, and nothing of the engine's text as a message
    chunks = [{"id": "chatcmpl-c", "choices": [{"index": 0, "delta": {"content": "ran echo"}, "finish_reason": None}]},
              {"id": "chatcmpl-c", "choices": [{"index": 0, "delta": {"content": ", got hi"}, "finish_reason": "stop"}]},
              {"id": "chatcmpl-c", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}]  # fmt: skip
    data, sizes = translate_stream(adapter.stream_translator(body), chunks)
    events = [p for _, p in parse_sse(data)]
    for event in events:
        EVENT.validate_python(event)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                          "response.output_item.done", "response.completed"]  # fmt: skip
    Response.model_validate(events[-1]["response"])
    (item,) = events[-1]["response"]["output"]
    assert item["type"] == "compaction" and unseal(item["encrypted_content"], COMPACTION) == "ran echo, got hi"
    # the next request holds the compaction in place of the history: the summary as a user message
    after = {**BASE, "tools": [SHELL], "input": [{"role": "user", "content": "run echo"}, item]}
    translation = adapter.to_chat_request(after)
    assert translation.chat["messages"][-1] == {"role": "user", "content": SUMMARY_PREFIX + "ran echo, got hi"}
    assert translation.declared == Declared(compaction=True)  # the first call on the compacted context
    later = {**after, "input": [*after["input"], {"type": "function_call", "call_id": "c2", "name": "exec_command",
                                                 "arguments": "{}"}, {"type": "function_call_output", "call_id": "c2", "output": "x"}]}  # fmt: skip
    assert adapter.to_chat_request(later).declared is None  # later calls continue that sample
    # a compaction item another server made cannot be read: dropped, and said so
    foreign = adapter.to_chat_request({**after, "input": [{"role": "user", "content": "go"}, {**item, "encrypted_content": "gAAA-x"}]})
    assert foreign.dropped == ("input[1]: compaction: not issued by this sidecar, so the engine cannot be given its content",)


def test_codex_declares_its_threads_and_compactions_in_client_metadata() -> None:
    windows = Windows()
    adapter = ResponsesAdapter(windows=windows)

    def metadata(thread: str, kind: str, window: int, parent: str | None = None) -> dict[str, Any]:
        turn = json.dumps({"thread_id": thread, "request_kind": kind, "window_number": window})
        meta = {"thread_id": thread, "x-codex-turn-metadata": turn}
        if parent:
            meta["x-codex-parent-thread-id"] = parent
        return meta

    def declared(meta: dict[str, Any]) -> Declared | None:
        return adapter.to_chat_request({**BASE, "input": "hi", "client_metadata": meta}).declared

    assert declared(metadata("main", "turn", 0)) == Declared(agent_id="main")
    assert declared(metadata("sub", "turn", 0, parent="main")) == Declared(agent_id="sub", parent_agent_id="main")
    assert declared(metadata("main", "compaction", 0)) == Declared(agent_id="main", compaction=True)  # the summary call
    assert declared(metadata("main", "turn", 1)) == Declared(agent_id="main", compaction=True)  # first after it
    assert declared(metadata("main", "turn", 1)) == Declared(agent_id="main")  # later ones continue
    assert declared(metadata("sub", "turn", 0, parent="main")) == Declared(agent_id="sub", parent_agent_id="main")
    # an id a span cannot carry declares nothing (and the span says why); never a 400
    translation = adapter.to_chat_request({**BASE, "input": "hi", "client_metadata": {"thread_id": "x" * 300}})
    assert translation.declared is None
    assert any(entry.startswith("client_metadata.thread_id: not usable as an agent id") for entry in translation.dropped)
    translation = adapter.to_chat_request({**BASE, "input": "hi", "client_metadata": {"x-codex-turn-metadata": "{no"}})
    assert translation.declared is None and any("x-codex-turn-metadata" in e for e in translation.dropped)


def test_a_connection_keeps_unstored_conversations_for_the_next_request() -> None:
    """Codex over the WebSocket: `store: false`, each request chained to the previous response."""
    adapter = ResponsesAdapter(keep_unstored=True)
    first = {**BASE, "input": [{"role": "developer", "content": "be brief"}]}
    adapter.to_chat_request(first)
    warm = adapter.answer_without_generating(first)  # generate: false
    assert Response.model_validate(warm).status == "completed" and warm["output"] == []
    second = {**BASE, "previous_response_id": warm["id"], "input": [{"role": "user", "content": "hi"}]}
    assert [m["role"] for m in adapter.to_chat_request(second).chat["messages"]] == ["system", "user"]
    plain = ResponsesAdapter()  # HTTP: store false keeps nothing
    plain.to_chat_request(first)
    assert plain.answer_without_generating(first)["id"] not in plain.store
