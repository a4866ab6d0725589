"""The structure a harness declares reaches the call's span: Claude Code's agent-id headers (sent by
the real `anthropic` SDK as Claude Code sends them), agl's own pair (which wins), a declared
compaction; a hostile declared value is a 400 naming its header, in the API's own error shape,
before anything reaches the engine."""

from __future__ import annotations

import functools

import anthropic
import httpx
import pytest

from agl import semconv

post = functools.partial(httpx.post, timeout=60)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}


def test_claude_code_agent_headers_reach_the_span_and_agl_s_pair_wins(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    client = anthropic.Anthropic(base_url=sidecar.url + "/rollouts/r1", api_key="unused", max_retries=0)
    client.messages.create(
        model="tiny", max_tokens=4, messages=MESSAGES,
        extra_headers={"x-claude-code-agent-id": "sub-1", "x-claude-code-parent-agent-id": "main"},
    )  # fmt: skip
    client.messages.create(
        model="tiny", max_tokens=4, messages=MESSAGES,
        extra_headers={
            "x-claude-code-agent-id": "sub-1", "x-agl-agent-id": "planner ✓",
            "x-claude-code-parent-agent-id": "main", "x-agl-parent-agent-id": "root", "x-agl-compaction": "1",
        },
    )  # fmt: skip
    client.messages.create(model="tiny", max_tokens=4, messages=MESSAGES)
    spans = sorted(otlp_sink.wait_for(lambda s: len(s) >= 3), key=lambda s: s.attributes[semconv.CALL_SEQ])
    first, second, third = (s.attributes for s in spans)
    assert (first[semconv.CALL_AGENT_ID], first[semconv.CALL_PARENT_AGENT_ID]) == ("sub-1", "main")
    assert semconv.CALL_COMPACTION not in first
    assert (second[semconv.CALL_AGENT_ID], second[semconv.CALL_PARENT_AGENT_ID]) == ("planner ✓", "root")
    assert second[semconv.CALL_COMPACTION] is True
    assert not {semconv.CALL_AGENT_ID, semconv.CALL_PARENT_AGENT_ID, semconv.CALL_COMPACTION} & set(third)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-claude-code-agent-id", "a" * 257),
        ("x-claude-code-parent-agent-id", b"main\xff"),
        ("x-agl-agent-id", "a\tb"),
        ("x-agl-parent-agent-id", b"p\xc2\x85"),  # U+0085, a C1 control character, in UTF-8
        ("x-agl-agent-id", b"\xc3\x28"),  # invalid UTF-8
        ("x-agl-compaction", "maybe"),
        ("baggage", "agl.call.agent_id=a%09b"),  # a tab, percent-encoded
    ],
)
def test_hostile_declared_values_are_a_400_naming_the_header(fake, make_sidecar, header, value):
    sidecar = make_sidecar(upstream=[fake.base_url])
    response = post(sidecar.url + "/rollouts/r/v1/chat/completions", json=CHAT, headers={header: value})
    assert response.status_code == 400, response.text
    named = "baggage agl.call.agent_id" if header == "baggage" else header
    assert response.json()["error"]["param"] == named
    # The Anthropic front answers in Anthropic's shape, naming the header too (the SDK sends only
    # text headers: raw bytes go through httpx).
    if isinstance(value, str):
        client = anthropic.Anthropic(base_url=sidecar.url + "/rollouts/r", api_key="unused", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model="tiny", max_tokens=4, messages=MESSAGES, extra_headers={header: value})
        body = info.value.body
    else:
        response = post(sidecar.url + "/rollouts/r/v1/messages", json=CHAT, headers={header: value})
        assert response.status_code == 400, response.text
        body = response.json()
    assert body["type"] == "error" and named in body["error"]["message"]
    assert fake.requests == []


def test_the_longest_declared_agent_id_is_accepted(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    longest = "é" * semconv.AGENT_ID_MAX_CHARS
    response = post(sidecar.url + "/rollouts/r/v1/chat/completions", json=CHAT, headers={"x-agl-agent-id": longest.encode()})
    assert response.status_code == 200, response.text
    (span,) = otlp_sink.wait_for(lambda s: len(s) >= 1)
    assert span.attributes[semconv.CALL_AGENT_ID] == longest


def test_baggage_declares_agents_between_agl_s_headers_and_claude_code_s(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    url = sidecar.url + "/rollouts/r/v1/chat/completions"
    baggage = {"baggage": "agl.call.agent_id=from%20baggage,agl.call.parent_agent_id=boss"}
    post(url, json=CHAT, headers={**baggage, "x-claude-code-agent-id": "cc", "x-claude-code-parent-agent-id": "cc-p"})
    post(url, json=CHAT, headers={**baggage, "x-agl-agent-id": "own"})
    spans = sorted(otlp_sink.wait_for(lambda s: len(s) >= 2), key=lambda s: s.attributes[semconv.CALL_SEQ])
    first, second = (s.attributes for s in spans)
    assert (first[semconv.CALL_AGENT_ID], first[semconv.CALL_PARENT_AGENT_ID]) == ("from baggage", "boss")
    assert (second[semconv.CALL_AGENT_ID], second[semconv.CALL_PARENT_AGENT_ID]) == ("own", "boss")
