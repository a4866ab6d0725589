"""A drain-free policy switch on the embedded engine, through the real sidecar: generations frozen
mid-way, new weights loaded, resumed. The response is whole, the span says where the new version
starts, and the engine's logprobs are exactly the old weights' before it and, after it, the new
weights' attending to the old weights' KV cache of the prefix (what a frozen request keeps)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from agl import semconv
from agl_sidecar.config import SidecarConfig
from agl_sidecar.server import BackgroundSidecar
from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig, EmbeddedOptions
from agl_trainer.weights.update import WeightUpdate

from tests.support.otlp_sink import OTLPSink, ReceivedSpan
from tests.support.waiting import wait_until

TOLERANCE = 1e-4  # float32 logprobs, batched vs one sequence (as tests/engine/test_openai_sdk.py)


@pytest.fixture
def engine(bpe_model_dir: Path) -> Iterator[EmbeddedEngine]:
    config = EmbeddedEngineConfig(model_path=bpe_model_dir, served_model_name="tiny", options=EmbeddedOptions(max_model_len=512))
    with EmbeddedEngine(config) as running:
        yield running


@pytest.fixture
def sidecar(engine: EmbeddedEngine, otlp_sink: OTLPSink, tmp_path: Path) -> Iterator[BackgroundSidecar]:
    config = SidecarConfig(
        upstream=engine.urls, listen="127.0.0.1:0", otlp_endpoint=otlp_sink.endpoint,
        spool_dir=str(tmp_path / "spool"), export_interval_s=0.05,
    )  # fmt: skip
    with BackgroundSidecar(config) as running:
        yield running


def weights_of(engine: EmbeddedEngine) -> dict[str, torch.Tensor]:
    """Each parameter once (a tied output head under the embedding's name)."""
    return {k: v.detach().clone() for k, v in engine.model.named_parameters()}


def perturbed(state: dict[str, torch.Tensor], scale: float = 0.05) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in state.items()}


def freeze_at(engine: EmbeddedEngine, tokens: int, calls: int) -> dict[str, int]:
    """Freeze the engine once each of `calls` unfinished calls has at least `tokens` tokens. Frozen
    first, checked after (thawed again if short), so the batch cannot run to its end between the
    check and the freeze however slowly this thread or the switch's HTTP calls are scheduled."""
    deadline = time.monotonic() + 120
    while True:
        progress = engine.freeze()
        if len(progress) == calls and min(progress.values()) >= tokens:
            return progress
        assert len(progress) >= calls, f"a call ended before {tokens} tokens: {progress}"
        assert time.monotonic() < deadline, f"the batch did not reach {tokens} tokens: {progress}"
        engine.thaw()
        time.sleep(0.001)  # let a step run


def switch(sidecar: BackgroundSidecar, engine: EmbeddedEngine, weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """One keep-mode switch as the loop does it: hold, freeze, load, record, continue."""
    paused = httpx.post(f"{sidecar.url}{semconv.ADMIN_PAUSE_PATH}", json={"mode": "keep"}, timeout=30)
    assert paused.status_code == 200 and paused.json()["paused"] is True
    progress = engine.freeze()
    engine.update_weights(WeightUpdate(version=1, state_dict=weights))
    resumed = httpx.post(
        f"{sidecar.url}{semconv.ADMIN_RESUME_PATH}",
        json={"policy_version": 1, "switch": True, "engine_progress": progress},
        timeout=30,
    )
    assert resumed.status_code == 200 and resumed.json()["policy_version"] == 1
    engine.thaw()
    return progress


def span_of(sink: OTLPSink, response_id: str) -> ReceivedSpan:
    def found(spans: list[ReceivedSpan]) -> bool:
        return any(s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == response_id for s in spans)

    return next(s for s in sink.wait_for(found) if s.attributes.get(semconv.GEN_AI_RESPONSE_ID) == response_id)


def token_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """log p(ids[i+1] | ids[:i+1]) for every i, one full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits.float().log_softmax(-1)[0]
    return logits[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_a_200_token_generation_frozen_mid_way_continues_on_the_old_kv(
    engine: EmbeddedEngine, sidecar: BackgroundSidecar, otlp_sink: OTLPSink, bpe_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    new_state = perturbed(weights_of(engine))
    body = {
        "model": "tiny", "prompt": "The quick brown fox", "max_tokens": 200, "ignore_eos": True, "seed": 7,
        "logprobs": 0, "return_token_ids": True, "stream": True,
    }  # fmt: skip
    events: list[dict] = []

    def read() -> None:
        url = f"{sidecar.url}/rollouts/r-keep/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))

    reader = threading.Thread(target=read)
    reader.start()
    wait_until(lambda: len(engine.scheduler.progress()) == 1, "the call at the engine")
    freeze_at(engine, 60, calls=1)  # switch() freezes again: the same place
    progress = switch(sidecar, engine, new_state)
    reader.join(120)

    response_id = events[0]["id"]
    boundary = progress[response_id]
    tokens = [t for e in events for c in e["choices"] for t in c["token_ids"] or []]
    logprobs = [p for e in events for c in e["choices"] if c["logprobs"] for p in c["logprobs"]["token_logprobs"]]
    prompt = events[0]["choices"][0]["prompt_token_ids"]
    assert len(tokens) == len(logprobs) == 200 and 60 <= boundary < 200  # whole, frozen mid-way

    span = span_of(otlp_sink, response_id)
    assert span.attributes[semconv.COMPLETION_POLICY_VERSIONS] == [0, 0, boundary, 1]
    assert span.attributes[semconv.COMPLETION_TOKEN_IDS] == tokens and span.attributes[semconv.POLICY_VERSION] == 0

    old = AutoModelForCausalLM.from_pretrained(bpe_model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(bpe_model_dir, dtype=torch.float32).eval()
    new.load_state_dict(new_state, strict=False)  # the tied head follows the embedding
    assert torch.equal(new.lm_head.weight, new_state["model.embed_tokens.weight"])
    engine_lp = torch.tensor(logprobs)
    before = token_logprobs(old, prompt + tokens[:boundary])[len(prompt) - 1 :]
    assert torch.allclose(engine_lp[:boundary], before, atol=TOLERANCE)
    with torch.no_grad():  # the old weights' KV of everything before the last old token ...
        cache = old(torch.tensor([prompt + tokens[: boundary - 1]]), use_cache=True).past_key_values
        # ... and the new weights from that token on, attending to it
        logits = new(torch.tensor([tokens[boundary - 1 : -1]]), past_key_values=cache, use_cache=True).logits
    after = logits.float().log_softmax(-1)[0].gather(1, torch.tensor(tokens[boundary:])[:, None])[:, 0]
    assert torch.allclose(engine_lp[boundary:], after, atol=TOLERANCE)
    # and that is not what a recomputed prefix would have given: the old KV mattered
    recomputed = token_logprobs(new, prompt + tokens)[len(prompt) - 1 + boundary :]
    assert (engine_lp[boundary:] - recomputed).abs().max() > 10 * TOLERANCE


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 48, "temperature": 0}
REQUESTS: dict[str, tuple[str, dict]] = {
    "chat": ("/v1/chat/completions", CHAT),
    "completions": ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 48, "temperature": 0}),
    "responses": ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 48, "temperature": 0}),
    "messages": ("/v1/messages", {**CHAT, "max_tokens": 48}),
}


def test_every_api_streaming_and_unary_records_where_the_new_version_starts(
    engine: EmbeddedEngine, sidecar: BackgroundSidecar, otlp_sink: OTLPSink
) -> None:
    new_state = perturbed(weights_of(engine))
    answers: dict[str, int] = {}

    def call(name: str, path: str, body: dict, stream: bool) -> None:
        url = f"{sidecar.url}/rollouts/r-{name}-{stream}{path}"
        with httpx.stream("POST", url, json={**body, "stream": stream}, timeout=120) as response:
            response.read()
            answers[f"{name}-{stream}"] = response.status_code

    threads = [
        threading.Thread(target=call, args=(name, path, body, stream))
        for name, (path, body) in REQUESTS.items()
        for stream in (False, True)
    ]
    engine.freeze()  # the eight calls queue at the engine, then generate in one batch, in step
    for thread in threads:
        thread.start()
    wait_until(lambda: len(engine.scheduler.progress()) == 8, "8 calls at the engine", timeout=120)
    engine.thaw()
    freeze_at(engine, 4, calls=8)  # switch() freezes again: the same place
    progress = switch(sidecar, engine, new_state)
    for thread in threads:
        thread.join(120)
    assert answers == {f"{name}-{stream}": 200 for name in REQUESTS for stream in (False, True)}  # no call failed

    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 8)
    assert len(spans) == 8
    for span in spans:
        attributes = span.attributes
        boundary = progress[attributes[semconv.GEN_AI_RESPONSE_ID]]
        length = len(attributes[semconv.COMPLETION_TOKEN_IDS])
        assert 4 <= boundary < length == 48, attributes[semconv.CALL_API]
        assert attributes[semconv.COMPLETION_POLICY_VERSIONS] == [0, 0, boundary, 1], attributes[semconv.CALL_API]
    apis = sorted((s.attributes[semconv.CALL_API], s.attributes[semconv.GEN_AI_REQUEST_STREAM]) for s in spans)
    assert len(set(apis)) == 8  # four APIs, each streamed and unary


def test_without_the_engines_word_a_stream_is_cut_where_the_sidecar_saw_the_switch(
    engine: EmbeddedEngine, sidecar: BackgroundSidecar, otlp_sink: OTLPSink
) -> None:
    """An engine that cannot say how far its requests got: the sidecar resumes before the engine,
    so a stream's boundary is the tokens it had received; a unary call keeps its entry version."""
    new_state = perturbed(weights_of(engine))
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 64, "ignore_eos": True, "seed": 3, "return_token_ids": True}
    received: dict[bool, list[int]] = {True: [], False: []}
    ids: dict[bool, str] = {}

    def call(stream: bool) -> None:
        url = f"{sidecar.url}/rollouts/r-fallback-{stream}/v1/completions"
        with httpx.stream("POST", url, json={**body, "stream": stream}, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") or line.startswith("{"):
                    event = json.loads(line[6:] if line.startswith("data: ") else line)
                    ids[stream] = event["id"]
                    received[stream] += [t for c in event["choices"] for t in c["token_ids"] or []]

    engine.freeze()
    threads = [threading.Thread(target=call, args=(stream,)) for stream in (True, False)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(engine.scheduler.progress()) == 2, "2 calls at the engine")
    engine.thaw()
    freeze_at(engine, 4, calls=2)
    assert httpx.post(f"{sidecar.url}{semconv.ADMIN_PAUSE_PATH}", json={"mode": "keep"}).status_code == 200
    progress = engine.freeze()  # already frozen: the same place
    wait_until(lambda: True in ids and len(received[True]) == progress[ids[True]], "the frozen stream's tokens")
    engine.update_weights(WeightUpdate(version=1, state_dict=new_state))
    resumed = httpx.post(f"{sidecar.url}{semconv.ADMIN_RESUME_PATH}", json={"policy_version": 1, "switch": True})
    assert resumed.status_code == 200
    engine.thaw()
    for thread in threads:
        thread.join(120)
    streamed = progress[ids[True]]
    assert len(received[True]) == len(received[False]) == 64 and 4 <= streamed < 64
    stream_span, unary_span = span_of(otlp_sink, ids[True]), span_of(otlp_sink, ids[False])
    assert stream_span.attributes[semconv.COMPLETION_POLICY_VERSIONS] == [0, 0, streamed, 1]
    assert semconv.COMPLETION_POLICY_VERSIONS not in unary_span.attributes  # unknown: its entry version
    assert unary_span.attributes[semconv.POLICY_VERSION] == 0


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        (semconv.ADMIN_PAUSE_PATH, {"mode": "keep", "drain": True}, 'mode "keep" does not drain'),
        (semconv.ADMIN_PAUSE_PATH, {"mode": "freeze"}, "mode"),
        (semconv.ADMIN_RESUME_PATH, {"switch": True}, "switch needs the policy_version"),
        (semconv.ADMIN_RESUME_PATH, {"policy_version": 1, "engine_progress": {"x": 1}}, 'add "switch": true'),
        (semconv.ADMIN_RESUME_PATH, {"policy_version": 1, "switch": True, "engine_progress": {"x": -1}}, "engine_progress"),
    ],
)
def test_bad_switch_requests_are_refused_naming_the_problem(
    sidecar: BackgroundSidecar, path: str, body: dict, error: str
) -> None:
    response = httpx.post(f"{sidecar.url}{path}", json=body)
    assert response.status_code == 400 and error in response.json()["error"]
    assert httpx.get(f"{sidecar.url}{semconv.ADMIN_STATE_PATH}").json()["policy_version"] == 0  # nothing changed
