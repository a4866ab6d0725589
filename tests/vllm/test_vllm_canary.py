"""The canary (loop/canary.py) against real vLLM (CPU build): a weight update that leaves the prefix
cache as it was is named a stale cache (the cached prefix disagrees, a fresh one agrees); with the
reset agl sends after every update, engine and trainer agree."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends import TorchBackend, TorchBackendConfig
from agl_trainer.engines.probes import HttpProbeEngine
from agl_trainer.loop.canary import Canary, CanarySettings
from agl_trainer.weights.update import WeightUpdate

pytestmark = pytest.mark.vllm

# 300-token probes fill whole KV blocks, so vLLM's prefix cache holds the cached probe's prefix
SETTINGS = CanarySettings(tolerance=1e-3, probes=2, tokens=300, generate=8)


def _move(backend: TorchBackend, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in backend.model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def test_canary_names_a_stale_prefix_cache(vllm_engine, tiny_model_dir: Path) -> None:
    backend = TorchBackend(TorchBackendConfig(model_path=tiny_model_dir, device="cpu", algorithm=AlgorithmConfig()))
    original = backend.state_dict_for_engine()
    vllm_engine.update_weights(WeightUpdate(version=0, state_dict=original))  # the trainer's weights
    probes = HttpProbeEngine(vllm_engine.urls[0])
    canary = Canary(SETTINGS, engines=[probes], vocab_size=380, backend=backend)
    config = vllm_engine.config
    try:
        start = canary.check(0)  # also puts the cached probe's prefix into vLLM's prefix cache
        assert start.verdict == "agree", start.message
        assert start.fixed < 1e-4 and start.cached is not None and start.cached < 1e-4

        faulty = msgspec.structs.replace(config.options, fault_skip_prefix_cache_reset=True)
        vllm_engine.config = msgspec.structs.replace(config, options=faulty)
        _move(backend, 1)
        vllm_engine.update_weights(WeightUpdate(version=1, state_dict=backend.state_dict_for_engine()))
        stale = canary.check(1)
        assert stale.verdict == "stale_cache", stale.message
        assert stale.cached > 1e-3 > stale.fresh and stale.fixed < 1e-3
        assert "prefix cache" in stale.message and "Fix:" in stale.message

        vllm_engine.config = config  # agl's update: weights, then POST /reset_prefix_cache
        _move(backend, 2)
        vllm_engine.update_weights(WeightUpdate(version=2, state_dict=backend.state_dict_for_engine()))
        fixed = canary.check(2)
        assert fixed.verdict == "agree", fixed.message
        assert fixed.cached < 1e-4 and fixed.previous is not None and fixed.previous > 1e-3
        for name, result in (("start", start), ("no reset", stale), ("reset", fixed)):  # docs/results.md
            print(f"canary {name}: {result.verdict} fixed {result.fixed:.2g} cached {result.cached:.2g} "
                  f"fresh {result.fresh:.2g} previous {result.previous} in {result.seconds * 1000:.0f} ms")
    finally:
        vllm_engine.config = config
        probes.close()
        vllm_engine.update_weights(WeightUpdate(version=3, state_dict=original))
