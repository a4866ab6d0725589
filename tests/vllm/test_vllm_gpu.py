"""vLLM on a CUDA GPU, collocated with training: sleep frees the GPU, wake and sync restore it.

Marker `gpu` only (not run in CI, nor by `make test-vllm`): `pytest -m gpu tests/vllm` on a machine
with a GPU and the GPU build of vLLM in the interpreter named by $AGL_VLLM_PYTHON.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch
from agl_trainer.weights.update import WeightUpdate

from tests.vllm.conftest import SERVED_NAME, hf_token_logprobs, start_engine

pytestmark = pytest.mark.gpu

PROMPT = list(range(10, 40))


def free_gpu_bytes() -> int:
    free, _total = torch.cuda.mem_get_info()
    return free


def test_collocated_sleep_wake_and_sync_on_gpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert torch.cuda.is_available(), "this test needs a CUDA GPU"
    python = os.environ.get("AGL_VLLM_PYTHON")
    assert python, "set AGL_VLLM_PYTHON to an interpreter with the GPU build of vllm"
    from transformers import AutoModelForCausalLM

    engine = start_engine(
        tiny_model_dir, python, tmp_path / "logs", device="cuda", collocated=True, dtype="float32",
        gpu_memory_utilization=0.3, sleep_level=1,
    )  # fmt: skip
    try:
        (url,) = engine.urls
        assert "--enable-sleep-mode" in engine.command(1)
        awake = free_gpu_bytes()
        assert engine.sleep() is True
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
        assert free_gpu_bytes() > awake + 1024**3  # the KV cache (30% of the GPU) was released
        assert engine.wake_up() is True
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}

        updated = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for parameter in updated.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
        engine.update_weights(WeightUpdate(version=1, state_dict=updated.state_dict()))
        body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 0,
                "return_token_ids": True}  # fmt: skip
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        expected = hf_token_logprobs(updated, PROMPT, choice["token_ids"])
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-3)
    finally:
        engine.stop()
