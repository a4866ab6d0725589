"""An engine that compresses its answers when the client accepts it (uvicorn's GZipMiddleware,
a proxy in front of vLLM): the sidecar asks for identity, so it reads the token IDs and the harness
gets the answer it would get from the engine."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from aiohttp import web

from agl import semconv
from agl_testing.fake_vllm import FakeVLLM

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
