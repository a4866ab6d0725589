"""The demo harness through a real agl-sidecar to the embedded engine: the recorded token IDs of the
second call extend the first call's prompt and completion exactly, so assembly can merge them.

Exactly, that is, when the completion's text carries all of it back: a sampled completion may hold
a special token other than the final end of turn (<unk>, or <|im_start|> when max_tokens cuts it
off), which the text drops and the chat template does not write back (the test once failed on
`call k1 <|im_start|>` followed by `call k1 <|im_end|>`). For those the word tokens must still come
back in order right after the first prompt; every greedy episode must extend exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from agl import semconv

from examples.demo import harness
from examples.demo.task import make_tasks

SPECIAL = {0, 1, 2}  # <unk>, <|im_start|>, <|im_end|> in the demo vocabulary
IM_END = 2  # the end of turn, which the chat template writes after the assistant's text
SIDECAR = Path(sys.executable).parent / "agl-sidecar"


@pytest.fixture
def sidecar(demo_engine: Any, otlp_sink: Any) -> Any:
    if not SIDECAR.exists():
        pytest.fail(f"{SIDECAR} is missing: install the project with its sidecar extra")
    process = subprocess.Popen(
        [
            str(SIDECAR),
            "--upstream",
            demo_engine.urls[0],
            "--listen",
            "127.0.0.1:0",
            "--otlp-endpoint",
            otlp_sink.endpoint,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "AGL_SIDECAR_LOG_LEVEL": "warning"},
    )
    try:
        deadline = time.monotonic() + 120
        url = None
        while time.monotonic() < deadline and url is None:
            line = process.stdout.readline()
            if not line and process.poll() is not None:
                raise AssertionError(f"agl-sidecar exited with {process.returncode}")
            if "listening on" in line:
                url = line.split("listening on", 1)[1].strip()
        assert url, "agl-sidecar did not report its address"
        yield url.rstrip("/")
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def _full_prompts(spans: list[Any]) -> dict[int, tuple[list[int], list[int]]]:
    calls: dict[int, tuple[list[int], list[int]]] = {}
    for span in sorted(spans, key=lambda s: s.attributes[semconv.CALL_SEQ]):
        attrs = span.attributes
        prompt = list(attrs[semconv.PROMPT_TOKEN_IDS])
        if semconv.PROMPT_REF_CALL_SEQ in attrs:
            ref_prompt, ref_completion = calls[attrs[semconv.PROMPT_REF_CALL_SEQ]]
            prompt = (ref_prompt + ref_completion)[: attrs[semconv.PROMPT_REF_LENGTH]] + prompt
        calls[attrs[semconv.CALL_SEQ]] = (prompt, list(attrs[semconv.COMPLETION_TOKEN_IDS]))
    return calls


def test_two_calls_recorded_with_extending_token_ids(sidecar: str, otlp_sink: Any) -> None:
    tasks = make_tasks(6, seed=3)
    for number, task in enumerate(tasks):  # greedy and sampled episodes
        harness.run_episode(task, f"{sidecar}/rollouts/r{number}/v1", temperature=0.0 if number % 2 else 1.0)
    spans = otlp_sink.wait_for(
        lambda s: sum(1 for x in s if semconv.COMPLETION_TOKEN_IDS in x.attributes) >= 2 * len(tasks),
        timeout=60,
    )
    checked = 0
    for number in range(len(tasks)):
        mine = [
            s
            for s in spans
            if s.attributes.get(semconv.ROLLOUT_ID) == f"r{number}" and semconv.CALL_SEQ in s.attributes
        ]
        calls = _full_prompts(mine)
        assert len(calls) == 2, (number, calls)
        (prompt1, completion1), (prompt2, completion2) = (calls[seq] for seq in sorted(calls))
        seen = f"episode {number}: call 1 {prompt1} + {completion1}, call 2 {prompt2} + {completion2}"
        assert 1 <= len(completion1) <= 3 and 1 <= len(completion2) <= 2, seen
        assert prompt2[: len(prompt1)] == prompt1, seen
        words = [t for t in completion1 if t not in SPECIAL]  # what the completion's text carries
        assert prompt2[len(prompt1) : len(prompt1) + len(words)] == words, seen
        ends_its_turn = completion1[-1] not in SPECIAL or completion1[-1] == IM_END
        if ends_its_turn and not any(t in SPECIAL for t in completion1[:-1]):
            assert prompt2[: len(prompt1) + len(completion1)] == prompt1 + completion1, seen
            checked += 1
        else:
            assert number % 2 == 0, f"a greedy episode must extend exactly: {seen}"
        assert all(s.attributes.get(semconv.TOKENS_SOURCE) == semconv.TOKENS_FROM_ENGINE for s in mine)
        assert all(
            len(s.attributes[semconv.COMPLETION_LOGPROBS]) == len(s.attributes[semconv.COMPLETION_TOKEN_IDS])
            for s in mine
        )
    assert checked >= 3
    assert httpx.get(f"{sidecar}/healthz").status_code == 200
