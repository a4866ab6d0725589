"""Real vLLM (CPU build, marker `vllm`): the merged model `agl export` writes from a LoRA checkpoint is
served by vLLM with the log-probs of base + adapter (transformers on the exported directory, which
tests/export/test_export.py checks against peft's forward). The adapter covers the tied output head
too: the export unties it, and vLLM must load that head, not the embedding."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
import torch
from agl_trainer.backends import TorchBackend
from agl_trainer.backends.torch_config import LoraConfig
from agl_trainer.cli import main
from agl_trainer.loop.checkpoint import Checkpoints, LoopState
from transformers import AutoModelForCausalLM

from tests.algorithms.tiny import random_batch, training_config
from tests.vllm.conftest import SERVED_NAME, VLLM_PYTHON, hf_token_logprobs, start_engine

pytestmark = pytest.mark.vllm

PROMPT = [random.Random(2).randrange(3, 380) for _ in range(40)]
ATOL = 2e-4  # float32 on both sides, as tests/vllm/test_vllm_weight_sync.py


def test_vllm_serves_the_merged_export(tmp_path: Path) -> None:
    from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model

    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `bash scripts/setup_vllm_venv.sh` (or `make test-vllm`)")
    spec = TinyModelSpec(hidden=128, heads=2, kv_heads=2, layers=2, tie_embeddings=True, seed=0)
    base = build_bpe_model(tmp_path / "base", spec=spec)
    targets = (*LoraConfig().target_modules, "lm_head")  # the tied head too: exported untied
    backend = TorchBackend(training_config(base, lr=3e-2, lora=LoraConfig(rank=8, target_modules=targets)))
    for version in range(3):
        backend.train_step(random_batch(2, 2, seed=version), version)
    Checkpoints(tmp_path / "run" / "checkpoints").save(LoopState(step=3, policy_version=3), backend)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--merged"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False

    engine = start_engine(tmp_path / "out", str(VLLM_PYTHON), tmp_path / "logs")
    try:
        body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
                "logprobs": 0, "return_token_ids": True}  # fmt: skip
        response = httpx.post(f"{engine.urls[0]}/v1/completions", json=body, timeout=300.0)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
    finally:
        engine.stop()
    tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    want = hf_token_logprobs(merged, PROMPT, tokens)
    assert served == pytest.approx(want, abs=ATOL)
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert hf_token_logprobs(original, PROMPT, tokens) != pytest.approx(want, abs=10 * ATOL)  # adapted
