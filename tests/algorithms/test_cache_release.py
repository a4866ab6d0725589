"""On a GPU the torch backend hands its caching allocator's blocks back to CUDA after exporting the
policy and before the engine wakes (a collocated vLLM takes that memory: examples/swe/config-lora-1gpu.yaml
gives it 0.7 of the GPU). Checked on the CPU: after its step the backend is told its device is CUDA
(the export never touches that device itself), torch.cuda.empty_cache is a recorder, and a stand-in engine wakes
in update_weights as VLLMEngine does; the sync runs as the loop's does (policy_update, update_weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from agl_trainer.backends import TorchBackend
from agl_trainer.backends.torch_config import LoraConfig
from agl_trainer.engines.base import policy_update
from agl_trainer.weights.update import WeightUpdate

from tests.algorithms.tiny import make_tiny_model, random_batch, training_config


class WakingEngine:
    """Collocated: asleep while the trainer trains; update_weights wakes it first (VLLMEngine's order)."""

    def __init__(self, events: list[str], accepts_adapters: bool) -> None:
        self.events, self.accepts_adapters, self.sleeping = events, accepts_adapters, False
        self.updates: list[WeightUpdate] = []

    def sleep(self) -> bool:
        self.events.append("sleep")
        self.sleeping = True
        return True

    def update_weights(self, update: WeightUpdate) -> float:
        if self.sleeping:
            self.events.append("wake")
            self.sleeping = False
        self.updates.append(update)
        return 0.0


@pytest.mark.parametrize("rank", [0, 4], ids=["full", "lora"])
def test_cached_memory_goes_back_before_the_engine_wakes(tmp_path: Path, monkeypatch, rank: int):
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    lora = LoraConfig(rank=rank, alpha=8) if rank else LoraConfig()
    backend = TorchBackend(training_config(make_tiny_model(tmp_path / "model"), lora=lora))
    engine = WakingEngine(events, accepts_adapters=bool(rank))
    engine.sleep()
    backend.train_step(random_batch(num_tasks=1, per_task=2, seed=1), policy_version=0)
    events.append("trained")
    backend.device = torch.device("cuda")  # what the backend now believes; its tensors stay on the CPU
    engine.update_weights(policy_update(backend, engine, 1))  # the loop's _sync_weights
    assert events == ["sleep", "trained", "empty_cache", "wake"]
    (update,) = engine.updates
    assert (update.adapter is not None) == bool(rank)  # the LoRA config syncs the adapter alone


def test_on_the_cpu_nothing_is_emptied(tmp_path: Path, monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    backend = TorchBackend(training_config(make_tiny_model(tmp_path / "model")))
    backend.state_dict_for_engine()
    assert events == []
