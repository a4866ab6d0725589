"""vLLM's GPU weight transfer (weight_sync nccl / cuda_ipc) on a CUDA GPU: new weights reach the
server without files, and its log-probs are the updated model's.

Marker `gpu` (scripts/gpu_check.sh runs it): needs a CUDA GPU, the GPU build of vLLM in the
interpreter named by $AGL_VLLM_PYTHON, and vllm importable here too (the trainer side of the
transfer runs in this process: the `gpu` extra).
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


@pytest.mark.parametrize("sync", ["nccl", "cuda_ipc"])
def test_gpu_weight_transfer_updates_the_served_model(tiny_model_dir: Path, tmp_path: Path, sync: str) -> None:
    assert torch.cuda.is_available(), "this test needs a CUDA GPU"
    python = os.environ.get("AGL_VLLM_PYTHON")
    assert python, "set AGL_VLLM_PYTHON to an interpreter with the GPU build of vllm"
    from transformers import AutoModelForCausalLM

    engine = start_engine(
        tiny_model_dir, python, tmp_path / "logs", device="cuda", dtype="float32",
        gpu_memory_utilization=0.2, weight_sync=sync,
    )  # fmt: skip
    try:
        (url,) = engine.urls
        assert engine.weight_sync == sync
        assert "--weight-transfer-config" in engine.command(1)
        updated = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for parameter in updated.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
        for version in (1, 2):  # the second round reuses the transfer group / IPC engine
            engine.update_weights(WeightUpdate(version=version, state_dict=updated.state_dict()))
            assert engine.last_sync is not None and engine.last_sync.worker_results == [{"method": sync}]
        assert not any(Path("/dev/shm").glob("agl-weights-*/v2"))  # no files on this path
        body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 0,
                "return_token_ids": True}  # fmt: skip
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        expected = hf_token_logprobs(updated, PROMPT, choice["token_ids"])
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-3)
    finally:
        engine.stop()


def test_nccl_transfer_to_two_replicas(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert torch.cuda.is_available(), "this test needs a CUDA GPU"
    python = os.environ.get("AGL_VLLM_PYTHON")
    assert python, "set AGL_VLLM_PYTHON to an interpreter with the GPU build of vllm"
    from transformers import AutoModelForCausalLM

    engine = start_engine(
        tiny_model_dir, python, tmp_path / "logs", device="cuda", dtype="float32", replicas=2,
        gpu_memory_utilization=0.15, weight_sync="auto",
    )  # fmt: skip
    try:
        assert engine.weight_sync == "nccl"
        updated = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            for parameter in updated.parameters():
                parameter.mul_(1.1)
        engine.update_weights(WeightUpdate(version=1, state_dict=updated.state_dict()))
        body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "logprobs": 0,
                "return_token_ids": True}  # fmt: skip
        for url in engine.urls:
            choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
            expected = hf_token_logprobs(updated, PROMPT, choice["token_ids"])
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-3)
    finally:
        engine.stop()
