"""An engine that compresses its answers when the client accepts it (uvicorn's GZipMiddleware,
a proxy in front of vLLM): the sidecar asks for identity, so it reads the token IDs and the harness
gets the answer it would get from the engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from aiohttp import web

from agl import semconv
from agl_testing.fake_vllm import FakeVLLM, capture, sse_events

MESSAGES = [{"role": "user", "content": "go"}]


class GzippingVLLM(FakeVLLM):
    """The fake engine, compressing every answer the client's Accept-Encoding allows."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.accept_encodings: list[str | None] = []

    def build_app(self) -> web.Application:
        app = super().build_app()

        @web.middleware
        async def compress(request: web.Request, handler: Any) -> web.StreamResponse:
            self.accept_encodings.append(request.headers.get("Accept-Encoding"))
            response = await handler(request)
            response.enable_compression()  # honours Accept-Encoding; identity only: none
            return response

        app.middlewares.append(compress)
        return app


@pytest.mark.parametrize("stream", [False, True])
def test_a_compressing_engine_still_gives_the_calls_tokens(make_sidecar, otlp_sink, stream):
    with GzippingVLLM() as engine:
        direct = httpx.post(f"{engine.base_url}/v1/chat/completions", headers={"Accept-Encoding": "gzip"},
                            json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4})  # fmt: skip
        assert direct.headers.get("Content-Encoding") == "gzip"  # the control: it does compress
        sidecar = make_sidecar(upstream=[engine.base_url], otlp_endpoint=otlp_sink.endpoint)
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": stream}
        answer = httpx.post(f"{sidecar.url}/rollouts/gz/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200
        if stream:
            assert "[DONE]" in answer.text
        else:
            assert answer.json()["choices"][0]["message"]["content"]
        (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
        assert span.attributes[semconv.TOKENS_SOURCE] == semconv.TOKENS_FROM_ENGINE
        assert span.attributes[semconv.COMPLETION_TOKEN_IDS]
        assert engine.accept_encodings[-1] == "identity"


class AlwaysGzippingVLLM(FakeVLLM):
    """An engine (or a proxy before it) that gzips its answers whatever the client asked for:
    vLLM's captured answers, compressed."""

    def build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)

        async def chat(request: web.Request) -> web.StreamResponse:
            stream = (await request.json()).get("stream")
            pieces = sse_events("chat_stream_token_ids_logprobs.sse") if stream else [
                capture("chat_nonstream_token_ids_logprobs.json")]
            kind = "text/event-stream; charset=utf-8" if stream else "application/json"
            response = web.StreamResponse(headers={"Content-Type": kind})
            response.enable_compression(web.ContentCoding.gzip)  # forced: Accept-Encoding ignored
            await response.prepare(request)
            for piece in pieces:
                await response.write(piece)
            await response.write_eof()
            return response

        app.router.add_post("/v1/chat/completions", chat)
        return app


@pytest.mark.parametrize("stream", [False, True])
def test_an_unrequested_compressed_answer_is_an_error_not_a_valid_answer(make_sidecar, otlp_sink, stream):
    # Before: the gzip bytes went to the harness as the answer, without their Content-Encoding.
    with AlwaysGzippingVLLM() as engine:
        direct = httpx.post(f"{engine.base_url}/v1/chat/completions", headers={"Accept-Encoding": "identity"},
                            json={"model": "tiny", "messages": MESSAGES, "stream": stream})  # fmt: skip
        assert direct.headers.get("Content-Encoding") == "gzip"  # the control: it compresses anyway
        sidecar = make_sidecar(upstream=[engine.base_url], otlp_endpoint=otlp_sink.endpoint)
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "stream": stream}
        answer = httpx.post(f"{sidecar.url}/rollouts/gz/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 502
        assert "Content-Encoding: gzip" in answer.json()["error"]["message"]
        (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
        assert span.attributes[semconv.CALL_END_REASON] == semconv.END_UPSTREAM_ERROR
        assert sidecar.sidecar.router.upstreams[0].healthy  # the engine answered: it is not taken out
