"""prompt_logprobs on the embedded engine's /v1/completions, in vLLM's wire format: the served
weights' logprob of every prompt token (what the canary scores its probes with)."""

from __future__ import annotations

from typing import Any

import httpx
import torch
from agl_trainer.engines.embedded.engine import EmbeddedEngine
from agl_trainer.weights.update import WeightUpdate

PROMPT = [5, 17, 42, 99, 7, 63, 12]


def _score(base_url: str, **extra: Any) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1, **extra}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=60)


def _own(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def test_prompt_logprobs_are_the_served_weights(engine: EmbeddedEngine, base_url: str) -> None:
    answer = _score(base_url)
    assert answer.status_code == 200, answer.text
    scored = answer.json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(PROMPT)
    want = _own(engine.model, PROMPT)
    for position, token in enumerate(PROMPT[1:], start=1):
        entry = scored[position][str(token)]  # the prompt's own token is always there, top-1 too
        assert abs(entry["logprob"] - float(want[position - 1])) < 1e-5
        assert entry["rank"] >= 1 and any(e["rank"] == 1 for e in scored[position].values())
    # after a weight update the same prompt is scored by the new weights
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    moved = {k: v + 0.05 for k, v in original.items()}
    try:
        engine.update_weights(WeightUpdate(version=1, state_dict=moved))
        after = _score(base_url).json()["choices"][0]["prompt_logprobs"]
        assert abs(after[1][str(PROMPT[1])]["logprob"] - scored[1][str(PROMPT[1])]["logprob"]) > 1e-4
        assert abs(after[1][str(PROMPT[1])]["logprob"] - float(_own(engine.model, PROMPT)[0])) < 1e-5
    finally:
        engine.update_weights(WeightUpdate(version=2, state_dict=original))


def test_bad_prompt_logprobs_are_named(base_url: str) -> None:
    for extra in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 1, "stream": True}):
        answer = _score(base_url, **extra)
        assert answer.status_code == 400, extra
        assert answer.json()["error"]["param"] == "prompt_logprobs"
