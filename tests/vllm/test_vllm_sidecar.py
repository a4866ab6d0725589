"""The sidecar in front of real vLLM (CPU build): spans carry vLLM's own token IDs, which decode to
the text the harness received; a pause / weight sync / resume cycle stamps the new policy version.

The harness side is the openai SDK; spans go to a real OTLP/HTTP receiver (tests/support/otlp_sink).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from agl import semconv
from agl_trainer.weights.update import WeightUpdate

from tests.support.otlp_sink import OTLPSink, ReceivedSpan
from tests.vllm.conftest import SERVED_NAME, hf_token_logprobs

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def ascii_token_ids(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    """Tokens that decode on their own to printable ASCII: text and token IDs then map one to one,
    whatever a random model samples (no partial UTF-8 bytes for a detokenizer to hold back)."""
    special = set(tokenizer.all_special_ids)
    ids = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if token_id not in special and text and text.isascii() and text.isprintable():
            ids.append(token_id)
    assert len(ids) > 50
    return ids


@pytest.fixture(scope="module")
def sink() -> Iterator[OTLPSink]:
    with OTLPSink() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def sidecar(vllm_engine, sink: OTLPSink, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from agl_trainer.run.sidecar_client import SidecarProcess

    logs = tmp_path_factory.mktemp("sidecar")
    process = SidecarProcess(
        vllm_engine.urls,
        sink.endpoint,
        log_path=logs / "sidecar.log",
        extra_args=["--spool-dir", str(logs / "spool")],
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()


def harness(sidecar, rollout_id: str):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(
        base_url=f"{sidecar.url}/rollouts/{rollout_id}/v1", api_key="unused", max_retries=0, timeout=300
    )


def call_span(sink: OTLPSink, rollout_id: str) -> ReceivedSpan:
    spans = sink.wait_for(
        lambda spans: any(s.attributes.get(semconv.ROLLOUT_ID) == rollout_id for s in spans), timeout=60
    )
    (span,) = [s for s in spans if s.attributes.get(semconv.ROLLOUT_ID) == rollout_id]
    assert span.name == semconv.call_span_name(semconv.OPERATION_CHAT, SERVED_NAME)
    return span


def direct_chat(url: str, **body: object) -> dict:
    """The same request straight to vLLM, asking for its token IDs and logprobs."""
    payload = {"model": SERVED_NAME, "messages": MESSAGES, "return_token_ids": True, "logprobs": True, **body}
    response = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_span_holds_vllms_token_ids_and_they_decode_to_the_reply(
    vllm_engine,
    sidecar,
    sink,
    tokenizer,
    ascii_token_ids,  # type: ignore[no-untyped-def]
) -> None:
    sampling = {"max_tokens": 16, "seed": 7, "temperature": 1.0}
    reply = harness(sidecar, "r-chat").chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, extra_body={"allowed_token_ids": ascii_token_ids}, **sampling
    )
    text = reply.choices[0].message.content
    span = call_span(sink, "r-chat")
    ids = span.attributes[semconv.COMPLETION_TOKEN_IDS]
    assert span.raw_attribute_kinds[semconv.COMPLETION_TOKEN_IDS] == "array_value"
    assert all(isinstance(i, int) for i in ids) and len(ids) == reply.usage.completion_tokens
    assert text and tokenizer.decode(ids, skip_special_tokens=True) == text

    engine_said = direct_chat(vllm_engine.urls[0], allowed_token_ids=ascii_token_ids, **sampling)
    assert ids == engine_said["choices"][0]["token_ids"]  # vLLM's own IDs, not a re-tokenization
    prompt = span.attributes[semconv.PROMPT_TOKEN_IDS]
    assert prompt == engine_said["prompt_token_ids"]
    rendered = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert prompt == list(rendered["input_ids"])
    engine_logprobs = [entry["logprob"] for entry in engine_said["choices"][0]["logprobs"]["content"]]
    assert span.attributes[semconv.COMPLETION_LOGPROBS] == pytest.approx(engine_logprobs, abs=1e-5)
    assert span.attributes[semconv.TOKENS_SOURCE] == semconv.TOKENS_FROM_ENGINE


def test_streamed_chat_span_decodes_to_the_streamed_text(
    vllm_engine,
    sidecar,
    sink,
    tokenizer,
    ascii_token_ids,  # type: ignore[no-untyped-def]
) -> None:
    sampling = {"max_tokens": 16, "seed": 11, "temperature": 1.0}
    stream = harness(sidecar, "r-stream").chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        stream=True,
        extra_body={"allowed_token_ids": ascii_token_ids},
        **sampling,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    span = call_span(sink, "r-stream")
    ids = span.attributes[semconv.COMPLETION_TOKEN_IDS]
    assert text and tokenizer.decode(ids, skip_special_tokens=True) == text
    engine_said = direct_chat(vllm_engine.urls[0], allowed_token_ids=ascii_token_ids, **sampling)
    assert ids == engine_said["choices"][0]["token_ids"]
    assert span.attributes[semconv.GEN_AI_REQUEST_STREAM] is True


def test_partial_utf8_tokens_reach_the_span_as_vllm_sampled_them(vllm_engine, sidecar, sink) -> None:  # type: ignore[no-untyped-def]
    """Unrestricted sampling from a random byte-level model: many tokens are partial UTF-8 bytes
    that never appear in the text; the span still holds exactly vLLM's IDs."""
    sampling = {"max_tokens": 24, "seed": 1234, "temperature": 1.0}
    reply = harness(sidecar, "r-bytes").chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, **sampling
    )
    span = call_span(sink, "r-bytes")
    engine_said = direct_chat(vllm_engine.urls[0], **sampling)
    assert span.attributes[semconv.COMPLETION_TOKEN_IDS] == engine_said["choices"][0]["token_ids"]
    assert reply.choices[0].message.content == engine_said["choices"][0]["message"]["content"]


def test_pause_sync_resume_serves_held_calls_with_the_new_policy(
    vllm_engine,
    sidecar,
    sink,
    tiny_model_dir,  # type: ignore[no-untyped-def]
) -> None:
    from transformers import AutoModelForCausalLM

    updated = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in updated.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    admin = httpx.Client(
        base_url=sidecar.url, headers={"authorization": f"Bearer {sidecar.admin_token}"}, timeout=120
    )

    assert admin.post("/agl/v1/pause", json={"drain": True, "timeout_s": 60}).status_code == 200
    replies: list[object] = []
    held = threading.Thread(
        target=lambda: replies.append(
            harness(sidecar, "r-held").chat.completions.create(
                model=SERVED_NAME, messages=MESSAGES, max_tokens=8, seed=3, temperature=1.0
            )
        )
    )
    held.start()
    deadline = time.monotonic() + 60
    while admin.get("/agl/v1/state").json()["held"] < 1:  # the call is waiting at the sidecar
        assert time.monotonic() < deadline and held.is_alive(), "the call was not held by the pause"
        time.sleep(0.05)
    vllm_engine.update_weights(WeightUpdate(version=1, state_dict=updated.state_dict()))
    resumed = admin.post("/agl/v1/resume", json={"policy_version": 1})
    assert resumed.status_code == 200 and resumed.json()["policy_version"] == 1
    held.join(timeout=300)

    assert replies, "the held call failed instead of waiting for the resume"
    span = call_span(sink, "r-held")
    assert span.attributes[semconv.POLICY_VERSION] == 1
    prompt = span.attributes[semconv.PROMPT_TOKEN_IDS]
    ids = span.attributes[semconv.COMPLETION_TOKEN_IDS]
    # served by the new weights: vLLM's logprobs are the trainer's for the updated model
    assert span.attributes[semconv.COMPLETION_LOGPROBS] == pytest.approx(
        hf_token_logprobs(updated, prompt, ids), abs=2e-4
    )
