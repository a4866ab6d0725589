"""A stream whose events arrive cut across reads: the harness gets the same events as when each
arrives whole, and the span the same token IDs. The upstream replays a stream captured from vLLM,
writing it in pieces (with a pause after each, so the sidecar reads them separately)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from aiohttp import web

from agl import semconv
from agl_testing.captures import VLLM_CAPTURES

CAPTURED = VLLM_CAPTURES / "chat_stream_token_ids_logprobs_usage.sse"


def _cuts(stream: bytes) -> list[int]:
    """Cut between the two newlines of every separator and in the middle of every event."""
    cuts: set[int] = set()
    start = 0
    while (at := stream.find(b"\n\n", start)) >= 0:
        cuts.add((start + at) // 2)
        cuts.add(at + 1)
        start = at + 2
    return sorted(cuts)


class ReplayUpstream:
    """Answers every chat call with the captured stream, whole or in `pieces`."""

    def __init__(self, stream: bytes) -> None:
        self.stream = stream
        self.pieces: list[bytes] = [stream]
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        for piece in self.pieces:
            await response.write(piece)
            await asyncio.sleep(0.002)
        await response.write_eof()
        return response

    def __enter__(self) -> ReplayUpstream:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, access_log=None)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(runner.setup(), self._loop).result()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        asyncio.run_coroutine_threadsafe(site.start(), self._loop).result()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._runner = runner
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture
def replay() -> Iterator[ReplayUpstream]:
    with ReplayUpstream(CAPTURED.read_bytes()) as upstream:
        yield upstream


def _events(sidecar_url: str, rollout: str) -> list[bytes]:
    request = {"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "stream": True}
    with httpx.Client(timeout=10) as client:
        reply = client.post(f"{sidecar_url}/rollouts/{rollout}/v1/chat/completions", json=request)
    assert reply.status_code == 200
    return [event for event in reply.content.split(b"\n\n") if event]


def test_events_cut_across_reads_reach_the_harness_and_the_span_whole(replay, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[replay.url], otlp_endpoint=otlp_sink.endpoint)
    whole = _events(sidecar.url, "whole")
    stream = replay.stream
    cuts = _cuts(stream)
    replay.pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert len(replay.pieces) > 20
    cut = _events(sidecar.url, "cut")
    assert cut == whole
    captured = [json.loads(e[6:]) for e in stream.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(whole) == len(captured) + 1 and whole[-1] == b"data: [DONE]"
    for event, original in zip(whole, captured, strict=False):  # what the harness did not ask for is gone
        sent = json.loads(event[6:])
        assert sent.get("prompt_token_ids") is None
        assert all(c.get("token_ids") is None and c.get("logprobs") is None for c in sent["choices"])
        assert [c.get("delta") for c in sent["choices"]] == [c.get("delta") for c in original["choices"]]
    engine_ids = [i for chunk in captured for c in chunk["choices"] for i in c.get("token_ids") or []]
    prompt_ids = captured[0]["prompt_token_ids"]
    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 2)
    by_rollout = {span.attributes[semconv.ROLLOUT_ID]: span.attributes for span in spans}
    for rollout in ("whole", "cut"):
        attrs = by_rollout[rollout]
        assert attrs[semconv.COMPLETION_TOKEN_IDS] == engine_ids
        assert attrs[semconv.PROMPT_TOKEN_IDS] == prompt_ids
