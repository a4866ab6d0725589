"""The rule for what the sidecar does not know, for Anthropic Messages (docs/protocols.md): a field,
block type, role or header it does not know is accepted, passed to the engine where the engine can
use it, otherwise dropped, and the call's span says which (agl.request.fields.*); never a 4xx for an
additive field. (A known field with a wrong value keeps its 400: test_refusals.py.)"""

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

BODY = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"type": "text", "text": "hi"}


def _blocks(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {**BODY, "messages": [{"role": "user", "content": list(blocks)}]}


# (case, body, the span's dropped entries, its passed entries, what the engine must be sent)
CASES = [
    ("unknown top-level field", {**BODY, "mood": "x"},
     ["mood: not a field of the Messages API the sidecar knows"], [], lambda chat: "mood" not in chat),
    ("engine sampling parameter", {**BODY, "frequency_penalty": 0.5}, [],
     ["frequency_penalty: an engine sampling parameter, not Anthropic's: sent to the engine as is"],
     lambda chat: chat["frequency_penalty"] == 0.5),
    ("unknown field in a block", _blocks({**TEXT, "colour": "red"}),
     ["messages[0].content[0].colour: not a field of a 'text' block"], [],
     lambda chat: chat["messages"][0]["content"] == [TEXT]),
    ("unknown block with text", _blocks(TEXT, {"type": "poem", "text": "roses"}), [],
     ["messages[0].content[1]: a 'poem' block the sidecar does not know: sent as its text"],
     lambda chat: chat["messages"][0]["content"] == [TEXT, {"type": "text", "text": "roses"}]),
    ("unknown block without text", _blocks(TEXT, {"type": "video", "url": "x"}),
     ["messages[0].content[1]: a 'video' block the sidecar does not know, without text"], [],
     lambda chat: chat["messages"][0]["content"] == [TEXT]),
    ("unknown field in a message", {**BODY, "messages": [{"role": "user", "content": "hi", "name": "bob"}]},
     ["messages[0].name: not a field of a message"], [], lambda chat: "name" not in chat["messages"][0]),
    ("unknown role", {**BODY, "messages": [*BODY["messages"], {"role": "developer", "content": "be brief"}]}, [],
     ["messages[1].role: 'developer' is not an Anthropic role: sent to the engine as a 'developer' message"],
     lambda chat: chat["messages"][1] == {"role": "developer", "content": "be brief"}),
    ("unknown context edit", {**BODY, "context_management": {"edits": [{"type": "clear_everything_20990101"}]}},
     ["context_management.edits[0]: an edit of type 'clear_everything_20990101' the sidecar does not implement"], [],
     lambda chat: "context_management" not in chat),
    ("options an engine has no use for", {**BODY, "service_tier": "auto", "output_config": {"effort": "high"},
                                          "metadata": {"user_id": "u", "team": "t"}},
     ["service_tier: Anthropic's capacity tier", "output_config.effort: an output option with no engine equivalent",
      "metadata.team: request metadata the engine has no use for"], [],
     lambda chat: chat["user"] == "u" and "service_tier" not in chat),
    ("Claude Code's billing header", {**BODY, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.d9f; cc_entrypoint=sdk-cli;"},
        {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]},
     ["system[0]: Claude Code's x-anthropic-billing-header, which Anthropic's API reads and removes",
      "system[1].cache_control: a prompt-caching mark: the engine caches prefixes by itself"], [],
     lambda chat: chat["messages"][0] == {"role": "system", "content": [{"type": "text", "text": "You are a coding agent."}]}),
    ("a deferred tool and a server tool", {**BODY, "tools": [
        {"name": "Read", "input_schema": {"type": "object"}},
        {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]},
     ["tools[1]: defer_loading: not in the model's context until a tool search loads it",
      "tools[2]: a server tool (web_search_20250305): the engine cannot run it"], [],
     lambda chat: [t["function"]["name"] for t in chat["tools"]] == ["Read"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeVLLM, str, OTLPSink]]:
    spool = Path(tmp_path_factory.mktemp("spool"))
    with FakeVLLM() as fake, OTLPSink() as sink:
        config = SidecarConfig(
            upstream=[fake.base_url], listen="127.0.0.1:0", spool_dir=str(spool),
            otlp_endpoint=sink.endpoint, export_interval_s=0.05,
        )  # fmt: skip
        with BackgroundSidecar(config) as sidecar:
            yield fake, sidecar.url, sink


@pytest.mark.parametrize(("case", "body", "dropped", "passed", "sent"), CASES, ids=[c[0] for c in CASES])
def test_what_the_sidecar_does_not_know_is_accepted_and_recorded(served, case, body, dropped, passed, sent) -> None:
    fake, url, sink = served
    rollout = "unknown-" + case.replace(" ", "-").replace("'", "")
    answer = httpx.post(f"{url}/rollouts/{rollout}/v1/messages", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["type"] == "message"
    mine = lambda spans: [s for s in spans if s.attributes.get(semconv.ROLLOUT_ID) == rollout]  # noqa: E731
    [span] = mine(sink.wait_for(mine))
    assert sorted(span.attributes.get(semconv.REQUEST_FIELDS_DROPPED, [])) == sorted(dropped)
    assert sorted(span.attributes.get(semconv.REQUEST_FIELDS_PASSED, [])) == sorted(passed)
    assert sent(fake.requests[-1])


def test_system_entries_in_messages_reach_the_engine_in_place_as_one_string(served) -> None:
    """Claude Code sends `system` entries after the first user message: a list of blocks in one call,
    the same text as a string in the next. Both reach the engine as the same system message."""
    fake, url, _ = served
    listed = [{"type": "text", "text": "# Environment", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "cwd: /w"}]
    for content in (listed, "# Environment\ncwd: /w"):
        body = {**BODY, "messages": [*BODY["messages"], {"role": "system", "content": content}]}
        assert httpx.post(f"{url}/v1/messages", json=body, timeout=30).status_code == 200
        assert fake.requests[-1]["messages"][1] == {"role": "system", "content": "# Environment\ncwd: /w"}


def test_anthropic_headers_the_sidecar_does_not_know_are_accepted(served) -> None:
    _, url, _ = served
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
        "mid-conversation-tool-changes-2026-07-01,some-beta-from-the-future-2099-01-01",
        "anthropic-dangerous-direct-browser-access": "true",
        "anthropic-new-header": "x",
        "x-app": "cli",
        "X-Stainless-Retry-Count": "0",
    }
    answer = httpx.post(f"{url}/v1/messages?beta=true", json=BODY, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
