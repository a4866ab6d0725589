"""update_weights swaps new weights in place: answers change, old weights restore old answers."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
from agl_trainer.weights.update import WeightUpdate

BODY = {
    "model": "tiny",
    "prompt": "The quick brown fox",
    "max_tokens": 8,
    "temperature": 0,
    "logprobs": 0,
    "return_token_ids": True,
}


def _answer(base_url: str) -> tuple[list[int], list[float]]:
    choice = httpx.post(base_url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _perturbed(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in state.items()}


@pytest.fixture
def own_engine(bpe_model_dir: Path) -> Any:
    with EmbeddedEngine(EmbeddedEngineConfig(model_path=bpe_model_dir)) as engine:
        yield engine


def test_update_changes_logprobs_and_restores(own_engine: EmbeddedEngine) -> None:
    url = own_engine.urls[0]
    original = {k: v.clone() for k, v in own_engine.model.state_dict().items()}
    before = _answer(url)
    seconds = own_engine.update_weights(WeightUpdate(version=1, state_dict=_perturbed(original, 0.5)))
    assert seconds > 0 and own_engine.policy_version == 1
    after = _answer(url)
    assert max(abs(a - b) for a, b in zip(after[1], before[1])) > 1e-3
    own_engine.update_weights(WeightUpdate(version=2, state_dict=original))
    assert _answer(url) == before  # the same weights give the same answer, bit for bit


def test_update_from_a_directory_with_tied_weights(own_engine: EmbeddedEngine, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert own_engine.model.config.tie_word_embeddings
    url = own_engine.urls[0]
    before = _answer(url)
    changed = AutoModelForCausalLM.from_pretrained(own_engine.config.model_path)
    changed.load_state_dict(_perturbed(changed.state_dict(), 0.5))
    changed.save_pretrained(tmp_path / "v1")
    own_engine.update_weights(WeightUpdate(version=1, directory=tmp_path / "v1"))
    with torch.no_grad():  # the tied output head follows the new embedding, unlike vLLM's CPU repack
        assert torch.equal(own_engine.model.lm_head.weight, changed.model.embed_tokens.weight)
    assert _answer(url) != before


def test_bad_state_dicts_are_refused_with_the_reason(own_engine: EmbeddedEngine) -> None:
    state = {k: v.clone() for k, v in own_engine.model.state_dict().items()}
    before = _answer(own_engine.urls[0])
    with pytest.raises(KeyError, match="lacks"):
        own_engine.update_weights(
            WeightUpdate(version=1, state_dict={k: v for k, v in state.items() if "layers.0" not in k})
        )
    with pytest.raises(KeyError, match="does not have"):
        own_engine.update_weights(
            WeightUpdate(version=1, state_dict={**state, "model.extra.weight": torch.zeros(1)})
        )
    last = list(state)[-1]  # a bad shape at the end: nothing before it may have been copied
    with pytest.raises(ValueError, match="shape"):
        own_engine.update_weights(
            WeightUpdate(version=1, state_dict={**_perturbed(state, 0.5), last: torch.zeros(3)})
        )
    with pytest.raises(ValueError, match="neither"):
        own_engine.update_weights(WeightUpdate(version=1))
    assert _answer(own_engine.urls[0]) == before and own_engine.policy_version == 0


def test_update_during_generation_lands_between_steps(own_engine: EmbeddedEngine) -> None:
    """Requests in flight while weights change all complete; none fails or hangs."""
    url = own_engine.urls[0]
    original = {k: v.clone() for k, v in own_engine.model.state_dict().items()}
    results: list[int] = []

    def ask() -> None:
        body = {**BODY, "max_tokens": 40, "temperature": 1.0, "seed": 1}
        results.append(httpx.post(url + "/v1/completions", json=body, timeout=120).status_code)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for version in range(1, 6):
        own_engine.update_weights(
            WeightUpdate(version=version, state_dict=_perturbed(original, 0.01 * version))
        )
    for thread in threads:
        thread.join(timeout=120)
    assert results == [200] * 8
