"""Real vLLM (CPU build) behind VLLMEngine: weights trained here reach the server without a restart.

One server for the module (a start costs 30-70 s). The tiny model ties its embeddings, the case
where the CPU build keeps a stale packed copy of the output head unless the worker re-packs it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from agl_trainer.weights.update import WeightUpdate

from tests.vllm.conftest import SERVED_NAME, hf_token_logprobs

pytestmark = pytest.mark.vllm

# Long enough to fill whole KV blocks, so vLLM's prefix cache holds it across the sync.
PROMPT = [random.Random(0).randrange(3, 380) for _ in range(300)]
TARGET = [random.Random(1).randrange(3, 380) for _ in range(8)]  # ids >= 3: no special tokens
ATOL = 2e-4  # float32 on both sides; measured differences are ~1e-5


@dataclass
class Sample:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


def complete(url: str, prompt: list[int], max_tokens: int = len(TARGET), **extra: object) -> Sample:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 0, "return_token_ids": True, **extra}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300.0)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return Sample(choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["finish_reason"])


def train_to_emit(model: torch.nn.Module, prompt: list[int], target: list[int]) -> torch.nn.Module:
    """A few Adam steps until greedy decoding of `prompt` gives `target` with a clear margin."""
    sequence = torch.tensor([prompt + target])
    labels = sequence.clone()
    labels[0, : len(prompt)] = -100
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(300):
        loss = model(sequence, labels=labels).loss
        if loss.item() < 0.02:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    assert loss.item() < 0.02, f"the tiny model did not learn the target (loss {loss.item():.3f})"
    return model


@pytest.fixture(scope="module")
def original(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    return train_to_emit(model, PROMPT, TARGET)


def test_server_serves_the_model_it_was_given(vllm_engine, original) -> None:  # type: ignore[no-untyped-def]
    (url,) = vllm_engine.urls
    vllm_engine.update_weights(WeightUpdate(version=0, directory=Path(vllm_engine.config.model)))
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]
    sample = complete(url, PROMPT)
    assert sample.logprobs == pytest.approx(hf_token_logprobs(original, PROMPT, sample.tokens), abs=ATOL)


def test_weight_sync_gives_the_trainers_logprobs(vllm_engine, original, trained) -> None:  # type: ignore[no-untyped-def]
    (url,) = vllm_engine.urls
    vllm_engine.update_weights(WeightUpdate(version=1, directory=Path(vllm_engine.config.model)))
    before = complete(url, PROMPT)  # also leaves the prompt's KV blocks in the prefix cache
    assert before.tokens != TARGET

    seconds = vllm_engine.update_weights(WeightUpdate(version=2, state_dict=trained.state_dict()))

    after = complete(url, PROMPT)
    assert after.tokens == TARGET  # what the trainer taught, served without a restart
    assert after.logprobs == pytest.approx(hf_token_logprobs(trained, PROMPT, TARGET), abs=ATOL)
    old = hf_token_logprobs(original, PROMPT, TARGET)
    assert max(abs(a - o) for a, o in zip(after.logprobs, old)) > 1.0  # and not the old weights'
    report = vllm_engine.last_sync
    assert report.version == 2 and report.seconds == seconds and report.write_seconds > 0
    (worker,) = report.worker_results
    assert worker["repacked_lm_head"] is True and worker["tensors"] > 0 and worker["bytes"] > 0
    assert 0 < report.load_seconds[0] <= report.server_seconds[0] <= seconds


def test_sync_from_a_directory_restores_the_original(vllm_engine, original, trained) -> None:  # type: ignore[no-untyped-def]
    (url,) = vllm_engine.urls
    vllm_engine.update_weights(WeightUpdate(version=3, state_dict=trained.state_dict()))
    assert complete(url, PROMPT).tokens == TARGET
    vllm_engine.update_weights(WeightUpdate(version=4, directory=Path(vllm_engine.config.model)))
    restored = complete(url, PROMPT)
    assert restored.logprobs == pytest.approx(hf_token_logprobs(original, PROMPT, restored.tokens), abs=ATOL)
    assert restored.tokens != TARGET


def stream_completion(url: str, prompt: list[int], max_tokens: int, started: threading.Event) -> Sample:
    """A streamed greedy completion; sets `started` once the first token has arrived."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    tokens: list[int] = []
    finish_reason = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300.0) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                tokens += choice.get("token_ids") or []
                finish_reason = choice.get("finish_reason") or finish_reason
            if tokens:
                started.set()
    return Sample(tokens, [], finish_reason)


def test_a_request_in_flight_finishes_across_a_sync(vllm_engine, trained) -> None:  # type: ignore[no-untyped-def]
    """pause_mode="wait": a sync lets running requests finish rather than aborting them."""
    (url,) = vllm_engine.urls
    started = threading.Event()
    results: list[Sample] = []
    request = threading.Thread(
        target=lambda: results.append(stream_completion(url, PROMPT[:20], 400, started))
    )
    request.start()
    assert started.wait(timeout=120), "the request never produced a token"
    vllm_engine.update_weights(WeightUpdate(version=5, state_dict=trained.state_dict()))
    request.join(timeout=300)
    assert results and results[0].finish_reason == "length" and len(results[0].tokens) == 400


def test_sleep_is_skipped_on_cpu_and_the_server_keeps_serving(vllm_engine) -> None:  # type: ignore[no-untyped-def]
    assert vllm_engine.device == "cpu"
    assert vllm_engine.sleep() is False
    assert vllm_engine.wake_up() is False
    assert len(complete(vllm_engine.urls[0], PROMPT[:10], max_tokens=2).tokens) == 2


def test_a_dead_server_comes_back_with_the_latest_weights(vllm_engine, trained) -> None:  # type: ignore[no-untyped-def]
    """Last in the module: it costs a second server start."""
    (url,) = vllm_engine.urls
    vllm_engine.update_weights(WeightUpdate(version=6, state_dict=trained.state_dict()))
    process = vllm_engine._servers[0].process
    os.killpg(process.pid, signal.SIGKILL)  # the API server, its engine core and workers
    process.wait(timeout=30)

    assert vllm_engine.ensure_alive() == [url]

    assert vllm_engine._servers[0].process.pid != process.pid
    assert complete(url, PROMPT).tokens == TARGET  # not the --model directory's weights
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "6"}
