"""An engine that dies mid-stream: the harness talking through the sidecar must see a broken stream,
as it does talking to the engine directly, on every API the sidecar serves (chat and completions
through the openai SDK, Anthropic Messages through the anthropic SDK, the Responses API through the
openai SDK); the call's span records the failure, so it is never trained on."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from agl import semconv
from agl_testing.fake_vllm import FakeVLLM, Reply, Request, sse_events

SSE = "text/event-stream; charset=utf-8"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
# What a dying engine sent before it went: the first events of real vLLM streams.
CHAT_START = sse_events("chat_stream_token_ids_logprobs.sse")[:4]
COMPLETIONS_START = sse_events("completions_stream_token_ids_logprobs.sse")[:4]
BROKEN: tuple[type[BaseException], ...] = (httpx.HTTPError, openai.APIError, anthropic.APIError)
try:  # the anthropic SDK may bring its own httpx fork
    import httpx2

    BROKEN += (httpx2.HTTPError,)
except ImportError:
    pass


def _dies_mid_stream(request: Request) -> Reply:
    start = COMPLETIONS_START if request.path.endswith("/v1/completions") else CHAT_START
    return Reply(content_type=SSE, chunks=start, cut=True)


@pytest.fixture
def engine() -> Iterator[FakeVLLM]:
    with FakeVLLM(script=_dies_mid_stream) as server:
        yield server


def _chat(base: str) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    for _ in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True):  # type: ignore[arg-type]
        pass


def _completions(base: str) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    for _ in client.completions.create(model="tiny", prompt="What is 2 + 2?", stream=True):
        pass


def _messages(base: str) -> None:
    client = anthropic.Anthropic(base_url=base, api_key="k", max_retries=0)
    for _ in client.messages.create(model="tiny", max_tokens=12, messages=MESSAGES, stream=True):  # type: ignore[arg-type]
        pass


def _responses(base: str) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
    for _ in client.responses.create(model="tiny", input="What is 2 + 2?", stream=True):
        pass


HARNESSES: dict[str, Callable[[str], None]] = {
    semconv.API_CHAT_COMPLETIONS: _chat,
    semconv.API_COMPLETIONS: _completions,
    "messages": _messages,
    "responses": _responses,
}


@pytest.mark.parametrize("api", list(HARNESSES))
def test_engine_dying_mid_stream_is_an_error_for_the_harness_and_in_the_span(
    api: str, engine: FakeVLLM, make_sidecar: Any, otlp_sink: Any
) -> None:
    harness = HARNESSES[api]
    if api in (semconv.API_CHAT_COMPLETIONS, semconv.API_COMPLETIONS):
        with pytest.raises(BROKEN):  # direct: what the harness sees without the sidecar
            harness(engine.base_url)
    sidecar = make_sidecar(upstream=[engine.base_url], otlp_endpoint=otlp_sink.endpoint)
    with pytest.raises(BROKEN):
        harness(sidecar.url + "/rollouts/r-cut")
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.CALL_END_REASON] == semconv.END_UPSTREAM_ERROR
    assert span.attributes[semconv.ERROR_TYPE] == "upstream_stream_broken"
    assert span.status_code == 2
    # The sidecar itself is fine: the next call on a new connection works.
    assert httpx.get(sidecar.url + "/healthz").status_code == 200


@pytest.mark.slow  # importing litellm costs seconds
def test_a_provider_dying_mid_stream_through_litellm_is_an_error_for_the_harness(engine, make_sidecar, otlp_sink):
    sidecar = make_sidecar(
        upstream=["litellm:openai/tiny"],
        otlp_endpoint=otlp_sink.endpoint,
        litellm_params={"api_base": engine.base_url + "/v1", "api_key": "unused", "max_retries": 0},
    )
    with pytest.raises(BROKEN):
        _chat(sidecar.url + "/rollouts/r-cut")
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.CALL_END_REASON] == semconv.END_UPSTREAM_ERROR
    assert span.attributes[semconv.ERROR_TYPE] == "upstream_stream_broken"
