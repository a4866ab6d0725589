"""engine.options.weight_sync (vLLM): which path carries new weights into vLLM, chosen and checked before any
server starts. The GPU paths (vLLM's NCCL / CUDA-IPC weight transfer) run in the `gpu` tests
(tests/vllm/test_vllm_weight_transfer_gpu.py); here, their selection, server flags and refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agl_trainer.config import ConfigError, validate
from agl_trainer.engines.vllm.config import VLLMConfig, VLLMOptions
from agl_trainer.engines.vllm.engine import VLLMEngine
from agl_trainer.engines.vllm.transfer import GpuWeightTransfer, WeightTransferError, unique_tensors


def engine(replicas: int = 1, model: str | None = "model-dir", **options: Any) -> VLLMEngine:
    return VLLMEngine(VLLMConfig(model=model, replicas=replicas, options=VLLMOptions(**options)))  # starts nothing


@pytest.mark.parametrize("sync", ["nccl", "cuda_ipc"])
def test_gpu_transfer_on_a_cpu_engine_is_refused(sync: str) -> None:
    with pytest.raises(ValueError, match=f"weight_sync: {sync} is vLLM's GPU weight transfer, but the engine runs on the CPU"):
        engine(device="cpu", weight_sync=sync)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"device": "cpu", "weight_sync": "auto"}, "in_place"),
        ({"device": "cpu"}, "in_place"),  # today's path stays the default
        ({"device": "cuda"}, "in_place"),
        ({"device": "cuda", "weight_sync": "auto"}, "cuda_ipc"),
        ({"device": "cuda", "weight_sync": "auto", "replicas": 2}, "nccl"),
        ({"device": "cuda", "weight_sync": "nccl"}, "nccl"),
    ],
)
def test_selection(settings: dict, expected: str) -> None:
    chosen = engine(**settings)
    assert chosen.weight_sync == expected
    command, env = chosen.command(8000), chosen.environment()
    if expected == "in_place":
        assert "--weight-transfer-config" not in command
    else:
        flag = command.index("--weight-transfer-config")
        backend = {"nccl": "nccl", "cuda_ipc": "ipc"}[expected]
        assert command[flag + 1] == '{"backend": "%s"}' % backend
    assert (env.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == "1") == (expected == "cuda_ipc")


def test_cuda_ipc_needs_one_local_server() -> None:
    with pytest.raises(ValueError, match="cuda_ipc shares this process's GPU memory with one server; with 2 replicas use nccl"):
        engine(device="cuda", weight_sync="cuda_ipc", replicas=2)
    with pytest.raises(ValueError, match="cuda_ipc needs the server on this machine"):
        engine(model=None, urls=["http://10.0.0.7:8000"], device="cuda", weight_sync="cuda_ipc")
    assert engine(model=None, urls=["http://127.0.0.1:8000"], device="cuda", weight_sync="cuda_ipc").weight_sync == "cuda_ipc"


def test_nccl_group_counts_every_worker_of_a_server() -> None:
    chosen = engine(device="cuda", weight_sync="nccl", extra_args=["--tensor-parallel-size", "2", "-pp=2"])
    assert chosen._transfer is not None and chosen._transfer.workers_per_server == 4


def test_unknown_weight_sync_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="engine.options.weight_sync: invalid enum value 'rdma' .fix: one of auto, "):
        validate({"engine": {"name": "vllm", "options": {"device": "cuda", "weight_sync": "rdma"}}})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_sending_without_cuda_says_so() -> None:
    with pytest.raises(WeightTransferError, match="no CUDA device to send from; use weight_sync: in_place"):
        GpuWeightTransfer("nccl").send(["http://127.0.0.1:1"], {"w": torch.zeros(2)}, version=1)


def test_tied_tensors_are_sent_once() -> None:
    embedding = torch.randn(4, 3)
    weights = {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding, "norm.weight": torch.ones(3)}
    assert list(unique_tensors(weights)) == ["model.embed_tokens.weight", "norm.weight"]
