"""The Responses WebSocket transport (`GET /v1/responses` upgraded), through the real sidecar: the
openai SDK's own WebSocket client (`client.responses.connect()`), and Codex 0.169.0's messages
replayed from the capture in its wire format (prewarm with `generate: false`, requests chained by
`previous_response_id` with `store: false`, errors as `{"type": "error", "status": ...}` events).
The same translation and spans as over HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from agl import semconv
from agl_sidecar.config import SidecarConfig
from agl_sidecar.server import BackgroundSidecar

from agl_testing.fake_vllm import FakeVLLM
from tests.harnesses.codex_support import captured
from tests.support.otlp_sink import OTLPSink

CODEX_HEADERS = ("authorization", "openai-beta", "originator", "user-agent", "session-id", "thread-id",
                 "x-codex-beta-features", "x-codex-turn-metadata", "x-codex-window-id", "x-client-request-id")  # fmt: skip


@pytest.fixture
def served(tmp_path: Path, otlp_sink: OTLPSink) -> Iterator[tuple[FakeVLLM, BackgroundSidecar]]:
    with FakeVLLM() as fake:
        config = SidecarConfig(upstream=[fake.base_url], listen="127.0.0.1:0", spool_dir=str(tmp_path / "spool"),
                               otlp_endpoint=otlp_sink.endpoint, export_interval_s=0.05)  # fmt: skip
        with BackgroundSidecar(config) as sidecar:
            yield fake, sidecar


def test_the_openai_sdks_websocket_client_creates_and_chains_responses(served, otlp_sink: OTLPSink) -> None:
    fake, sidecar = served
    client = openai.OpenAI(base_url=f"{sidecar.url}/rollouts/ws-sdk/v1", api_key="unused", max_retries=0)
    with client.responses.connect() as connection:
        connection.response.create(model="tiny", input="Tell me a story", max_output_tokens=20, store=False)
        events = []
        for event in connection:  # each event parsed by the SDK's own types
            events.append(event)
            if event.type in ("response.completed", "response.incomplete", "error"):
                break
        first = events[-1].response
        assert events[0].type == "response.created" and first.output_text
        connection.response.create(model="tiny", input="And then?", previous_response_id=first.id, store=False)
        for event in connection:
            if event.type in ("response.completed", "response.incomplete", "error"):
                break
        assert event.type != "error", event
    # the second request chained to the first on the same connection, store false as it was
    assert [m["role"] for m in fake.requests[-1]["messages"]] == ["user", "assistant", "user"]
    assert fake.requests[-1]["messages"][1]["content"] == first.output_text
    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 2)
    assert {s.attributes[semconv.CALL_API] for s in spans} == {semconv.API_RESPONSES}
    assert {s.rollout_id for s in spans} == {"ws-sdk"}


async def _codex_session(url: str, headers: dict[str, str], messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Codex's turn on one WebSocket: each message sent after the previous response ended, its
    `previous_response_id` the id this server gave the response before it. The events of each."""
    answers: list[list[dict[str, Any]]] = []
    async with aiohttp.ClientSession() as session, session.ws_connect(url, headers=headers) as socket:
        previous = None
        for message in messages:
            if message.get("previous_response_id"):
                message = {**message, "previous_response_id": previous}
            await socket.send_str(json.dumps(message))
            events: list[dict[str, Any]] = []
            while not events or events[-1]["type"] not in ("response.completed", "response.incomplete", "error"):
                events.append(json.loads((await socket.receive()).data))
            answers.append(events)
            previous = events[-1].get("response", {}).get("id")
        # an acknowledgement Codex may send, and a message this server cannot read: the first is not
        # answered, the second is an error event, and the connection still serves the next request
        await socket.send_str(json.dumps({"type": "response.processed", "response_id": previous}))
        await socket.send_str("{not json")
        answers.append([json.loads((await socket.receive()).data)])
        await socket.send_str(json.dumps({"type": "response.create", "model": "tiny", "input": "", "stream": True}))
        answers.append([json.loads((await socket.receive()).data)])
        await socket.send_str(json.dumps({"type": "response.create", "model": "tiny", "input": "hi", "max_output_tokens": 4}))
        events = []
        while not events or events[-1]["type"] not in ("response.completed", "response.incomplete", "error"):
            events.append(json.loads((await socket.receive()).data))
        answers.append(events)
    return answers


@pytest.mark.parametrize("durable", [False, True])
def test_codex_messages_over_the_websocket(tmp_path: Path, otlp_sink: OTLPSink, durable: bool) -> None:
    record = captured("websocket_shell_loop")
    (exchange,) = record["exchanges"]
    headers = {k: v for k, v in exchange["headers"].items() if k.lower() in CODEX_HEADERS}
    prewarm, turn, outcome = exchange["messages"]
    with FakeVLLM() as fake:
        config = SidecarConfig(upstream=[fake.base_url], listen="127.0.0.1:0", spool_dir=str(tmp_path / "spool"),
                               otlp_endpoint=otlp_sink.endpoint, export_interval_s=0.05, durable_spans=durable)  # fmt: skip
        with BackgroundSidecar(config) as sidecar:
            url = sidecar.url.replace("http://", "ws://") + "/rollouts/ws-codex/v1/responses"
            warm, first, second, error, refused, last = asyncio.run(_codex_session(url, headers, [prewarm, turn, outcome]))
            http = httpx.post(f"{sidecar.url}/v1/responses", json={**turn, "previous_response_id": None,
                                                                   "input": prewarm["input"] + turn["input"]})  # fmt: skip
    # the prewarm: a completed empty response, the engine not called
    assert [e["type"] for e in warm] == ["response.created", "response.completed"] and warm[-1]["response"]["output"] == []
    assert len(fake.requests) == 4  # the two turns, the request after the errors, and the HTTP one
    turn_request, outcome_request, _, over_http = fake.requests
    # the turn chained to the prewarm (store false): Codex's instructions + its new items, in one chat
    assert [m["role"] for m in turn_request["messages"]] == ["system", "system", "user", "user"]
    assert over_http["messages"] == turn_request["messages"] and over_http["tools"] == turn_request["tools"]
    # the function call output, chained to the turn's answer
    assert first[-1]["type"] in ("response.completed", "response.incomplete")
    answered = first[-1]["response"]["output"][0]["content"][0]["text"]
    assert outcome_request["messages"][:-2] == turn_request["messages"]
    assert outcome_request["messages"][-2:] == [
        {"role": "assistant", "content": answered},
        {"role": "tool", "tool_call_id": outcome["input"][0]["call_id"], "content": outcome["input"][0]["output"]},
    ]
    assert second[-1]["type"] in ("response.completed", "response.incomplete")
    # errors: events with the HTTP status they stand for (Codex reads `status`), connection kept
    assert error == [{"type": "error", "status": 400, "error": error[0]["error"], "code": None,
                      "message": error[0]["message"], "param": None, "sequence_number": 0}]  # fmt: skip
    assert "not valid JSON" in error[0]["message"]
    assert refused[0]["type"] == "error" and refused[0]["status"] == 400 and refused[0]["param"] == "input"
    assert last[-1]["type"] in ("response.completed", "response.incomplete")
    assert http.status_code == 200
    spans = [s for s in otlp_sink.wait_for(lambda spans: len(spans) >= 4) if s.rollout_id == "ws-codex"]
    assert len(spans) == 3
    thread = turn["client_metadata"]["thread_id"]
    for span in spans[:2]:  # what Codex's client_metadata declares: its thread
        assert span.attributes[semconv.CALL_AGENT_ID] == thread
        assert "client_metadata: read for the call's declared structure; the engine has no use for it" in (
            span.attributes[semconv.REQUEST_FIELDS_DROPPED]
        )


def test_a_get_without_upgrade_and_an_unauthorized_upgrade_are_refused(tmp_path: Path) -> None:
    with FakeVLLM() as fake:
        config = SidecarConfig(upstream=[fake.base_url], listen="127.0.0.1:0", spool_dir=str(tmp_path / "spool"),
                               api_key="secret")  # fmt: skip
        with BackgroundSidecar(config) as sidecar:
            plain = httpx.get(f"{sidecar.url}/v1/responses", headers={"Authorization": "Bearer secret"})
            assert plain.status_code == 405 and plain.headers["Allow"] == "POST"
            assert "Upgrade: websocket" in plain.json()["error"]["message"]

            async def upgrade(key: str) -> int:
                async with aiohttp.ClientSession() as session:
                    try:
                        async with session.ws_connect(sidecar.url + "/v1/responses", headers={"Authorization": key}):
                            return 101
                    except aiohttp.WSServerHandshakeError as exc:
                        return exc.status

            assert asyncio.run(upgrade("Bearer wrong")) == 401
            assert asyncio.run(upgrade("Bearer secret")) == 101
