"""The verl backend on a CUDA GPU (`gpu` marker; scripts/gpu_check.sh runs these): bf16 mixed
precision, and the trainer's own offload around training (parameters and optimizer state on the
CPU between steps, for an engine collocated on the same GPU) giving the same update as no offload."""

from __future__ import annotations

import pytest
import torch
from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends import TorchBackend, TorchBackendConfig
from agl_trainer.backends.verl import VerlBackend, VerlBackendConfig

from tests.algorithms.tiny import random_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def cuda_config(model, **options) -> TorchBackendConfig:
    return TorchBackendConfig(
        model_path=model, device="cuda", lr=1e-3, algorithm=AlgorithmConfig(entropy_coef=0.0), **options
    )


def test_bf16_step_matches_the_torch_backend_on_cuda(tiny_model):
    """bf16 on CUDA; packed rows: verl's worker runs the torch backend's micro-batches (same count,
    same padding)."""
    config = cuda_config(tiny_model, micro_batch_tokens=64)
    batch = random_batch(num_tasks=3, per_task=3, seed=2, version=0)
    backend = VerlBackend(VerlBackendConfig(training=config, n_gpus_per_node=1))
    try:
        torch_backend = TorchBackend(config)
        want = torch_backend.compute_logprobs(batch)
        got = backend.compute_logprobs(batch)
        torch.testing.assert_close(got, want, atol=5e-2, rtol=0)  # both bf16 autocast over fp32 weights
        metrics = backend.train_step(batch, policy_version=1)
        assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"])) and metrics["actor/grad_norm"] > 0
        reference = torch_backend.train_step(batch, policy_version=1)
        assert backend.packed and reference["perf/micro_batches"] > 1
        assert metrics["perf/micro_batches"] == reference["perf/micro_batches"]
        assert metrics["perf/padding_frac"] == pytest.approx(reference["perf/padding_frac"])
        assert metrics["loss/total"] == pytest.approx(reference["loss/total"], abs=5e-2)
        weights = backend.state_dict_for_engine(torch.bfloat16)
        assert all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in weights.values())
    finally:
        backend.close()


def test_offload_around_training_gives_the_same_update(tiny_model):
    batch = random_batch(num_tasks=3, per_task=3, seed=3, version=0)
    outcomes = []
    for offload in (False, True):
        backend = VerlBackend(
            VerlBackendConfig(
                training=cuda_config(tiny_model, compute_dtype="float32"),
                n_gpus_per_node=1,
                param_offload=offload,
                optimizer_offload=offload,
            )
        )
        try:
            metrics = [backend.train_step(batch, policy_version=1) for _ in range(2)]
            outcomes.append((metrics, backend.state_dict_for_engine()))
        finally:
            backend.close()
    (plain, w_plain), (offloaded, w_offloaded) = outcomes
    for a, b in zip(plain, offloaded, strict=True):
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-4)
    for name, tensor in w_plain.items():
        torch.testing.assert_close(w_offloaded[name], tensor, atol=1e-5, rtol=1e-4, msg=name)

