"""Bodies the real APIs refuse are refused at the sidecar's door, in the API's error shape with the
field named, and never reach the engine: a harness is trained on what it sent, not on a rewrite
(issue 26: an unknown content block deleted its message, a tool_use without id became a call with
id "", an unknown input item was dropped, a tool without a name was sent as "").

For the Responses API, what the sidecar does not know (a field, an item or content part type, a tool
type, a role) is not refused: accepted, handled as faithfully as the engine allows, and named in the
call's span as dropped or passed (issue 39: Codex's `client_metadata` was a 400). A known field with
a wrong type or an impossible value keeps its 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agl import semconv
from agl_sidecar.config import SidecarConfig
from agl_sidecar.server import BackgroundSidecar
from agl_testing.fake_vllm import FakeVLLM
from tests.support.otlp_sink import OTLPSink

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}
MESSAGES = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
CALLED = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
]
RESPONSES = {"model": "tiny", "input": "hi"}
FUNCTION = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


def _with_block(block: dict[str, Any]) -> dict[str, Any]:
    return {**MESSAGES, "messages": [{"role": "user", "content": [block]}]}


def _called(block: dict[str, Any]) -> dict[str, Any]:
    return {**MESSAGES, "messages": [CALLED[0], {"role": "assistant", "content": [block]}]}


ANTHROPIC = [
    (_called({"type": "tool_use", "name": "get_weather", "input": {}}), "messages[1].content[0].id"),
    (_called({"type": "tool_use", "id": "toolu_1", "input": {}}), "messages[1].content[0].name"),
    (_called({"type": "tool_use", "id": "", "name": "get_weather", "input": {}}), "messages[1].content[0].id"),
    ({**MESSAGES, "messages": [*CALLED, {"role": "user", "content": [{"type": "tool_result", "content": "9C"}]}]},
     "messages[2].content[0].tool_use_id"),
    (_with_block({"type": "text"}), "messages[0].content[0].text"),
    (_with_block({"text": "hi"}), "messages[0].content[0].type"),
    ({**MESSAGES, "temperature": 1.5}, "temperature"),
    ({**MESSAGES, "top_p": 1.2}, "top_p"),
    ({**MESSAGES, "top_k": -1}, "top_k"),
    ({**MESSAGES, "tools": [{"input_schema": TOOL["input_schema"]}]}, "tools[0].name"),
    ({**MESSAGES, "tools": [{"name": "get_weather"}]}, "tools[0].input_schema"),
    ({**MESSAGES, "tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({**MESSAGES, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({**MESSAGES, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    # issue 42 (finding 9): the API refuses a message without content; it must not reach the engine
    ({**MESSAGES, "messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
    ({**MESSAGES, "messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({**MESSAGES, "messages": [{"role": "system", "content": [{"type": "text", "text": "s"}]},
                               {"role": "user", "content": ""}]}, "messages[1].content"),
    ({**MESSAGES, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []},
                               {"role": "user", "content": "go on"}]}, "messages[1].content"),
    # the only content is a block the engine cannot be given: nothing is left to answer
    (_with_block({"type": "video", "url": "x"}), "messages"),
    # known context edits with impossible options
    ({**MESSAGES, "context_management": {"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": -1}}]}},
     "context_management.edits[0].keep.value"),
    ({**MESSAGES, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "some"}]}},
     "context_management.edits[0].keep"),
    ({**MESSAGES, "context_management": {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 0}}]}},
     "context_management.edits[0].trigger.value"),
]  # fmt: skip

FN_OUT = {"type": "function_call_output", "call_id": "c1", "output": "9C"}
NAMESPACE = {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [FUNCTION]}
OPENAI = [
    ({**RESPONSES, "input": [{"type": "function_call_output", "output": "9C"}]}, "input[0].call_id"),
    ({**RESPONSES, "input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input[0].name"),
    ({**RESPONSES, "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({**RESPONSES, "input": [{"content": "hi"}]}, "input[0].type"),
    ({**RESPONSES, "input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({**RESPONSES, "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({**RESPONSES, "tools": [{**NAMESPACE, "tools": None}]}, "tools[0].tools"),
    ({**RESPONSES, "tools": [NAMESPACE, {**FUNCTION, "name": "agents__get_weather"}]}, "tools[1].name"),
    ({**RESPONSES, "temperature": 2.5}, "temperature"),
    ({**RESPONSES, "top_p": -0.1}, "top_p"),
    ({**RESPONSES, "max_output_tokens": 0}, "max_output_tokens"),
    # issue 42, finding 9: impossible values of known fields
    ({**RESPONSES, "tool_choice": "bogus"}, "tool_choice"),
    ({**RESPONSES, "input": ""}, "input"),
    ({**RESPONSES, "input": []}, "input"),
    ({**RESPONSES, "text": {"format": {"type": "bogus"}}}, "text.format.type"),
    ({**RESPONSES, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({**RESPONSES, "reasoning": {"effort": "bogus"}}, "reasoning.effort"),
    ({**RESPONSES, "reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    ({**RESPONSES, "truncation": "sometimes"}, "truncation"),
    # nothing the engine could be given is left (the items are hosted tools' own)
    ({**RESPONSES, "input": [{"type": "web_search_call", "id": "ws_1"}]}, "input"),
    # state the sidecar does not hold
    ({**RESPONSES, "conversation": "conv_1"}, "conversation"),
]  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeVLLM, str]]:
    spool = Path(tmp_path_factory.mktemp("spool"))
    with FakeVLLM() as fake:
        config = SidecarConfig(upstream=[fake.base_url], listen="127.0.0.1:0", spool_dir=str(spool))
        with BackgroundSidecar(config) as sidecar:
            yield fake, sidecar.url


@pytest.mark.parametrize(("body", "field"), ANTHROPIC, ids=[f for _, f in ANTHROPIC])
def test_anthropic_refusals_name_the_field(served: tuple[FakeVLLM, str], body: dict, field: str) -> None:
    fake, url = served
    before = len(fake.requests)
    answer = httpx.post(f"{url}/v1/messages", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert f"$.{field}".replace("$.[", "$[") in error["error"]["message"]
    assert len(fake.requests) == before  # nothing reached the engine


@pytest.mark.parametrize(("body", "field"), OPENAI, ids=[f for _, f in OPENAI])
def test_responses_refusals_name_the_field(served: tuple[FakeVLLM, str], body: dict, field: str) -> None:
    fake, url = served
    before = len(fake.requests)
    answer = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == field
    assert len(fake.requests) == before


UNKNOWN = "unknown to the sidecar; the engine has no use for it"
PASSED = "unknown to the sidecar; passed to the engine as written"
# Parts of a Responses request the sidecar does not know: accepted, and the span says what became of
# each (docs/protocols.md "What the sidecar does not know"); the engine gets what it can use.
ACCEPTED = [
    (  # Codex's additions, a newer content part, a field of another API, an engine sampling field
        {**RESPONSES, "input": [{"role": "user", "mood": "x", "content": [
            {"type": "input_text", "text": "hi"}, {"type": "input_audio", "data": "AAAA"}]}],
         "client_metadata": {"k": "v"}, "prompt_cache_key": "k", "max_tokens": 5, "top_k": 3,
         "tools": [FUNCTION, {"type": "web_search", "external_web_access": False}]},
        {"input[0].content[1]: input_audio: " + UNKNOWN, "input[0].mood: " + UNKNOWN, "max_tokens: " + UNKNOWN,
         "client_metadata: read for the call's declared structure; the engine has no use for it",
         "prompt_cache_key: the engine caches prompt prefixes by itself",
         "tools[1]: web_search: a hosted tool the engine cannot run"},
        {"top_k: " + PASSED},
        {"messages": [{"role": "user", "content": "hi"}], "top_k": 3, "tool_names": ["get_weather"]},
    ),
    (  # an item of a hosted tool, a role the sidecar does not know
        {**RESPONSES, "input": [{"type": "computer_call_output", "call_id": "c"}, {"role": "critic", "content": "no"},
                                {"role": "user", "content": "hi"}]},
        {"input[0]: computer_call_output: an item of a hosted tool or of OpenAI's stored state; the engine has no use for it"},
        {"input[1].role: critic: " + PASSED},
        {"messages": [{"role": "critic", "content": "no"}, {"role": "user", "content": "hi"}]},
    ),
    (  # the same unknown key on several items: one entry
        {**RESPONSES, "input": [{"role": "user", "content": "a", "meta": 1}, {"role": "user", "content": "b", "meta": 2},
                                {"role": "user", "content": "c"}]},
        {"input[*].meta: " + UNKNOWN + " (2 items)"},
        set(),
        {"messages": [{"role": "user", "content": t} for t in "abc"]},
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeVLLM, str, OTLPSink]]:
    spool = Path(tmp_path_factory.mktemp("spool"))
    with FakeVLLM() as fake, OTLPSink() as sink:
        config = SidecarConfig(upstream=[fake.base_url], listen="127.0.0.1:0", spool_dir=str(spool),
                               otlp_endpoint=sink.endpoint, export_interval_s=0.05)  # fmt: skip
        with BackgroundSidecar(config) as sidecar:
            yield fake, sidecar.url, sink


@pytest.mark.parametrize(("body", "dropped", "passed", "engine"), ACCEPTED)
def test_responses_parts_the_sidecar_does_not_know_are_accepted_and_recorded(
    traced: tuple[FakeVLLM, str, OTLPSink], body: dict, dropped: set, passed: set, engine: dict
) -> None:
    fake, url, sink = traced
    rollout = f"unknown-{len(fake.requests)}"
    answer = httpx.post(f"{url}/rollouts/{rollout}/v1/responses", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    sent = fake.requests[-1]
    assert sent["messages"] == engine["messages"]
    assert [t["function"]["name"] for t in sent.get("tools", [])] == engine.get("tool_names", [])
    assert sent.get("top_k") == engine.get("top_k") and "max_tokens" not in sent
    (span,) = [s for s in sink.wait_for(lambda spans: any(s.rollout_id == rollout for s in spans)) if s.rollout_id == rollout]
    assert set(span.attributes.get(semconv.REQUEST_FIELDS_DROPPED, [])) == dropped
    assert set(span.attributes.get(semconv.REQUEST_FIELDS_PASSED, [])) == passed


def test_well_formed_bodies_still_pass(served: tuple[FakeVLLM, str]) -> None:
    _, url = served
    tools = {**MESSAGES, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}, "temperature": 1}
    assert httpx.post(f"{url}/v1/messages", json=tools, timeout=30).status_code == 200
    items = {**RESPONSES, "tools": [FUNCTION], "temperature": 2, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "9C"},
    ]}  # fmt: skip
    assert httpx.post(f"{url}/v1/responses", json=items, timeout=30).status_code == 200


@pytest.mark.parametrize(("header", "value"), [("x-agl-mode", "training"), ("baggage", "agl.rollout.mode=warmup")])
def test_a_mode_the_sidecar_does_not_know_is_a_400_wherever_it_is_sent(served, header, value) -> None:
    fake, url = served
    before = len(fake.requests)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = httpx.post(f"{url}/rollouts/m/v1/chat/completions", json=body, headers={header: value}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] in (header, "baggage agl.rollout.mode")
    assert len(fake.requests) == before
