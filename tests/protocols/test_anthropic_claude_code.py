"""What Claude Code 2.1.328 really sends (tests/fixtures/claude-code-2.1.328, captured from its own
traffic), read by the Anthropic adapter: every request translates; its `system` entries render the
same tokens whether sent as blocks or as a string; its compaction calls are recognised; count_tokens
counts exactly the prompt the same request gets as a generation call."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from agl_sidecar.protocols import anthropic as adapter_module
from agl_sidecar.protocols.anthropic import COUNT_TOKENS, MESSAGES
from agl_sidecar.protocols.anthropic_compaction import SeenSummaries

from tests.harnesses.support import Turn, captured
from tests.protocols.scripted import scripted_sidecar, small_agent_tokenizer

SCENARIOS = ["plain", "tool_loop", "subagents", "compaction", "count_tokens"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_captured_request_translates(scenario: str) -> None:
    for request in captured(scenario):
        adapter = COUNT_TOKENS if request["path"].startswith("/rollouts/r1/v1/messages/count_tokens") else MESSAGES
        translation = adapter.to_chat_request(copy.deepcopy(request["body"]))
        json.dumps(translation.chat)
        assert translation.step is None  # keep-all thinking: no count needed, no engine round trip
        if adapter is MESSAGES:
            assert "x-anthropic-billing-header" not in json.dumps(translation.chat)
            assert set(translation.chat) <= adapter_module.ENGINE_KEYS | {"chat_template_kwargs", "stream_options"}
            assert translation.passed == ()


def test_the_dropped_parts_of_a_claude_code_request_are_named() -> None:
    translation = MESSAGES.to_chat_request(captured("tool_loop")[1]["body"])
    assert set(translation.dropped) == {
        "tools[10]: defer_loading: not in the model's context until a tool search loads it",
        "output_config.effort: an output option with no engine equivalent",
        "system[0]: Claude Code's x-anthropic-billing-header, which Anthropic's API reads and removes",
        "system[1].cache_control: a prompt-caching mark: the engine caches prefixes by itself",
        "system[2].cache_control: a prompt-caching mark: the engine caches prefixes by itself",
        "messages[2].content[0]: a thinking block another provider signed, its text omitted: unreadable",
        "messages[3].content[0].cache_control: a prompt-caching mark: the engine caches prefixes by itself",
    }


def test_claude_code_s_compaction_calls_are_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    """The auto-compaction capture: two calls of the task, the summary call, the first call on the
    summary (then again the same way). The summary calls and each summary's first call declare it."""
    monkeypatch.setattr(adapter_module, "SEEN_SUMMARIES", SeenSummaries())
    requests = captured("compaction")
    declared = [MESSAGES.to_chat_request(r["body"]).compaction for r in requests]
    assert declared == [False, False, True, True, True, True]
    # a later call on the same compacted context extends the first one: not declared again
    assert MESSAGES.to_chat_request(requests[3]["body"]).compaction is False


def test_system_entries_render_the_same_tokens_as_blocks_or_as_a_string(tmp_path: Path) -> None:
    """Claude Code's first call carries its environment note as a `system` entry of blocks, the
    next as a string of the same text. The second call's prompt still extends the first call's
    prompt and answer token-exactly, through that entry."""

    def script(messages: list[dict[str, Any]], body: dict[str, Any]) -> Turn:
        if messages[-1]["role"] == "tool":
            return Turn("Done.")
        return Turn(tool_calls=[("Bash", {"command": "echo one", "description": "Print one"})])

    first, second = (copy.deepcopy(r["body"]) for r in captured("tool_loop")[:2])
    first["stream"] = second["stream"] = False
    assert isinstance(first["messages"][1]["content"], list) and isinstance(second["messages"][1]["content"], str)
    with scripted_sidecar(small_agent_tokenizer(), script, tmp_path) as scripted:
        answer = httpx.post(f"{scripted.url}/v1/messages", json=first, timeout=60).json()
        second["messages"][2] = {"role": "assistant", "content": answer["content"]}  # the turn as the engine gave it
        second["messages"][3]["content"][0]["tool_use_id"] = answer["content"][0]["id"]
        assert httpx.post(f"{scripted.url}/v1/messages", json=second, timeout=60).status_code == 200
        one, two = scripted.engine.served
    entry = one.request["messages"][2]
    assert entry["role"] == "system" and entry == two.request["messages"][2]
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.completion_ids)] == one.prompt_ids + one.completion_ids


@pytest.mark.parametrize("scenario,index", [("tool_loop", 0), ("tool_loop", 2), ("subagents", 5), ("compaction", 2)])
def test_count_tokens_counts_the_generation_call_s_own_prompt(tmp_path: Path, scenario: str, index: int) -> None:
    """count_tokens of a request = the prompt tokens of the same request as a generation call: the
    engine's chat template with the system prompt, the tools, the thinking switch and all."""
    body = copy.deepcopy(captured(scenario)[index]["body"])
    body["stream"] = False
    counted = {k: v for k, v in body.items() if k not in ("max_tokens", "stream", "metadata")}
    with scripted_sidecar(small_agent_tokenizer(), lambda m, b: Turn("ok"), tmp_path) as scripted:
        count = httpx.post(f"{scripted.url}/v1/messages/count_tokens", json=counted, timeout=60)
        generated = httpx.post(f"{scripted.url}/v1/messages", json=body, timeout=60)
        assert count.status_code == 200 and generated.status_code == 200, (count.text, generated.text)
        [served] = scripted.engine.served
    assert count.json() == {"input_tokens": len(served.prompt_ids)}
    assert generated.json()["usage"]["input_tokens"] == len(served.prompt_ids)
    assert scripted.engine.tokenized[0]["chat_template_kwargs"] == {"enable_thinking": True}
