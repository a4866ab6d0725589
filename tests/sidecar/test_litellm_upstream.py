"""`--upstream litellm:<provider/model>`: through litellm (imported on first use) to an
OpenAI-compatible server, with spans of the same shape and agl.tokens.source=absent."""

from __future__ import annotations

import httpx
import openai
import pytest

from agl import semconv

pytestmark = pytest.mark.slow  # importing litellm costs seconds

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_litellm_upstream_chat_unary_and_stream(fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(
        upstream=["litellm:openai/tiny"],
        otlp_endpoint=otlp_sink.endpoint,
        litellm_params={"api_base": fake.base_url + "/v1", "api_key": "unused"},
    )
    client = openai.OpenAI(base_url=sidecar.url + "/rollouts/hosted/v1", api_key="unused")
    request = {"model": "anything", "messages": MESSAGES, "max_tokens": 12, "seed": 1234}
    reply = client.chat.completions.create(**request)
    direct = httpx.post(fake.base_url + "/v1/chat/completions", json={**request, "model": "tiny"}).json()
    assert reply.choices[0].message.content == direct["choices"][0]["message"]["content"]
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**request, stream=True) if c.choices
    )
    assert streamed == direct["choices"][0]["message"]["content"]
    assert all("return_token_ids" not in body for body in fake.requests)  # engine-only flags dropped

    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 2)
    for span in spans:
        attrs = span.attributes
        assert span.name == "chat anything"
        assert attrs[semconv.TOKENS_SOURCE] == semconv.TOKENS_ABSENT
        assert semconv.PROMPT_TOKEN_IDS not in attrs and semconv.COMPLETION_TOKEN_IDS not in attrs
        assert attrs[semconv.ROLLOUT_ID] == "hosted" and attrs[semconv.CALL_UPSTREAM] == "litellm:openai/tiny"
        assert attrs[semconv.GEN_AI_PROVIDER_NAME] == "openai"
        assert attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] == [direct["choices"][0]["finish_reason"]]
    assert len({s.attributes[semconv.CALL_SEQ] for s in spans}) == 2
    models = client.models.list()
    assert [m.id for m in models.data] == ["openai/tiny"]
