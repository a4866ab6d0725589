"""Concurrent requests are batched, and batching does not change any request's answer."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

PROMPTS = ["hello", "The quick brown fox jumps over the lazy dog", "What is 2 + 2?", "a b c", "def main():"]


def _body(i: int, greedy: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPTS[i % len(PROMPTS)] * (1 + i % 3),  # different lengths: left padding in the batch
        "max_tokens": 4 + i % 7,  # different lengths: rows leave the batch at different steps
        "return_token_ids": True,
        "logprobs": 0,
    }
    body.update({"temperature": 0} if greedy else {"seed": 100 + i, "temperature": 0.9, "top_p": 0.95})
    return body


async def _all(base_url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(
        base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=100)
    ) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return [r.json()["choices"][0] for r in responses]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
async def test_concurrent_answers_equal_single_answers(base_url: str, engine: Any, greedy: bool) -> None:
    bodies = [_body(i, greedy) for i in range(24)]
    steps_before = engine._scheduler.steps
    together = await _all(base_url, bodies)
    steps_together = engine._scheduler.steps - steps_before
    alone = []
    for body in bodies:
        alone += await _all(base_url, [body])
    for one, many in zip(alone, together):
        assert many["token_ids"] == one["token_ids"]
        assert many["finish_reason"] == one["finish_reason"]
        for a, b in zip(many["logprobs"]["token_logprobs"], one["logprobs"]["token_logprobs"]):
            assert abs(a - b) < 1e-4  # same numbers up to float noise from padding
    generated = sum(len(c["token_ids"]) for c in together)
    # batched: far fewer forward steps than tokens (one at a time would need one step per token)
    assert steps_together < generated / 3


async def test_requests_joining_a_running_batch(base_url: str) -> None:
    """A request that arrives while others generate joins mid-way and still gets its own answer."""
    long = {"model": "tiny", "prompt": "hello", "max_tokens": 60, "temperature": 0, "return_token_ids": True}
    shorts = [_body(i, greedy=True) for i in range(8)]
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        long_task = asyncio.create_task(client.post("/v1/completions", json=long))
        short_answers = []
        for body in shorts:  # staggered arrivals
            short_answers.append((await client.post("/v1/completions", json=body)).json()["choices"][0])
        long_answer = (await long_task).json()["choices"][0]
    alone_long = (await _all(base_url, [long]))[0]
    assert long_answer["token_ids"] == alone_long["token_ids"]
    for body, answer in zip(shorts, short_answers):
        assert answer["token_ids"] == (await _all(base_url, [body]))[0]["token_ids"]


async def test_a_client_that_leaves_frees_its_rows(base_url: str, engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import time

    body = {"model": "tiny", "prompt": "hello", "max_tokens": 500, "stream": True, "ignore_eos": True}
    steps_before = engine._scheduler.steps
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        async for _ in response.aiter_lines():
            break  # one chunk, then hang up
    deadline = time.monotonic() + 30
    while engine._scheduler._live and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert engine._scheduler._live == []
    assert engine._scheduler.steps - steps_before < 400  # it left long before its 500 tokens
    # a client hanging up is no error of the engine's (it was an aiohttp traceback at ERROR)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(base_url: str, engine: Any) -> None:
    import time

    from agl_trainer.engines.embedded.batching import SamplingParams, Sequence

    broken = Sequence([10**6], SamplingParams(max_tokens=2), sink=asyncio.Queue())  # no such embedding row
    engine._scheduler.submit([broken])
    deadline = time.monotonic() + 30
    while not broken.finished and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert broken.finish_reason == "error" and "index" in str(broken.stop_reason).lower()
    assert (await _all(base_url, [_body(0, greedy=True)]))[0]["finish_reason"] == "length"


def test_simulated_device_time_waits_each_step_and_leaves_answers_alone(bpe_model_dir: Any, base_url: str) -> None:
    """`device_step_ms` (benches model an accelerator with it) makes every step wait that long, with
    the same answer as an engine without it; out-of-range values are refused naming the key."""
    import time

    from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig, EmbeddedOptions

    body = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}  # fmt: skip
    plain = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    config = EmbeddedEngineConfig(model_path=bpe_model_dir, served_model_name="tiny", options=EmbeddedOptions(device_step_ms=40))
    with EmbeddedEngine(config) as slow:
        started = time.perf_counter()
        answer = httpx.post(f"{slow.urls[0]}/v1/completions", json=body, timeout=60).json()["choices"][0]
        elapsed = time.perf_counter() - started
        steps = slow._scheduler.steps
    assert answer["token_ids"] == plain["token_ids"]
    # one step per token after the first (the prompt's step samples it), each step waited 40 ms
    assert len(answer["token_ids"]) == 6 and steps >= 5 and elapsed >= steps * 0.040
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="device_step_ms"):
            EmbeddedEngine(EmbeddedEngineConfig(model_path=bpe_model_dir, options=EmbeddedOptions(device_step_ms=bad)))


def test_stopping_with_requests_frozen_or_generating_answers_them_aborted(
    bpe_model_dir: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine stopped while calls are in flight (frozen by a switch, or generating) ends them as
    aborted: every client gets its answer, and nothing is left pending on a closed event loop."""
    import gc
    import logging
    import threading

    from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig, EmbeddedOptions
    from tests.support.waiting import wait_until

    caplog.set_level(logging.ERROR)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    answers: list[Any] = []
    engine = EmbeddedEngine(
        EmbeddedEngineConfig(model_path=bpe_model_dir, served_model_name="tiny", options=EmbeddedOptions(device_step_ms=5))
    )
    engine.start()
    url = engine.urls[0]

    def call(stream: bool) -> None:
        try:
            answers.append(httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=60))
        except httpx.HTTPError as error:  # a closed connection is an answer too, not a hang
            answers.append(error)

    callers = [threading.Thread(target=call, args=(stream,)) for stream in (False, True, False)]
    for caller in callers:
        caller.start()
    progress = engine._scheduler.progress
    wait_until(lambda: len(progress()) == 3 and min(progress().values()) >= 2, timeout=30)
    engine.freeze()
    engine.stop()
    for caller in callers:
        caller.join(timeout=30)
    assert len(answers) == 3 and not any(caller.is_alive() for caller in callers)
    assert all(isinstance(a, httpx.Response) and a.status_code == 200 for a in answers), answers
    streams = [a for a in answers if a.text.startswith("data:")]
    unary = [a for a in answers if not a.text.startswith("data:")]
    assert len(streams) == 1 and streams[0].text.rstrip().endswith("data: [DONE]")
    assert len(unary) == 2 and all(a.json()["choices"][0]["finish_reason"] == "abort" for a in unary)
    gc.collect()  # a handler left pending on the closed loop complains when it is collected
    messages = [record.getMessage() for record in caplog.records]
    assert not [m for m in messages if "destroyed but it is pending" in m or "Error handling request" in m]
