"""Every engine implements what `InferenceEngine` declares (the loop calls these directly, no getattr),
with the protocol's parameters; the embedded engine declines to sleep."""

from __future__ import annotations

import inspect

import pytest

from agl_trainer.engines.base import InferenceEngine
from agl_trainer.engines.embedded.engine import EmbeddedEngine
from agl_trainer.engines.vllm.engine import VLLMEngine

DECLARED = [name for name, _ in inspect.getmembers(InferenceEngine) if not name.startswith("_")]


def test_the_protocol_declares_what_the_loop_calls() -> None:
    assert {"urls", "start", "stop", "update_weights", "freeze", "thaw", "sleep"} <= set(DECLARED)


def test_the_embedded_engine_declines_to_sleep(tmp_path) -> None:
    from agl_trainer.engines.embedded.engine import EmbeddedEngineConfig

    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=str(tmp_path)))  # never started: nothing loaded
    assert engine.sleep() is False  # its model shares the process's memory with the trainer: nothing to free


@pytest.mark.parametrize("engine", [EmbeddedEngine, VLLMEngine], ids=lambda e: e.__name__)
def test_engine_implements_the_protocol(engine: type) -> None:
    for name in DECLARED:
        declared = getattr(InferenceEngine, name)
        implemented = getattr(engine, name, None)
        assert implemented is not None, f"{engine.__name__} lacks {name}"
        if isinstance(declared, property):
            assert isinstance(implemented, property), f"{engine.__name__}.{name} is not a property"
            continue
        want = list(inspect.signature(declared).parameters)
        got = list(inspect.signature(implemented).parameters)
        assert got[: len(want)] == want, f"{engine.__name__}.{name}{got} does not take {want}"
    for name in InferenceEngine.__annotations__:  # attributes, as `accepts_adapters`
        assert hasattr(engine, name), f"{engine.__name__} lacks {name}"


def test_an_engine_that_takes_no_adapter_refuses_one_clearly() -> None:
    from agl_trainer.weights.update import AdapterState, WeightUpdate

    assert EmbeddedEngine.accepts_adapters and not VLLMEngine.accepts_adapters
    engine = VLLMEngine.__new__(VLLMEngine)  # the check comes before anything the engine holds
    with pytest.raises(ValueError, match="adapter-only update"):
        engine.update_weights(WeightUpdate(1, adapter=AdapterState({}, {})))



def test_an_engine_says_whether_a_frozen_call_keeps_the_old_kv_and_the_loop_buckets_by_it(tmp_path) -> None:
    """switch_kv: recompute (vLLM's default) recomputes a frozen call's prefix with the new weights: the
    tokens after the switch are the new policy's own, so the loop drops their keep_kv mark."""
    import sys

    from agl_trainer.batch import RolloutResult, Sample
    from agl_trainer.engines.vllm.config import VLLMConfig, VLLMOptions
    from agl_trainer.loop.live import forget_switches

    def vllm(switch_kv: str) -> VLLMEngine:
        options = VLLMOptions(switch_kv=switch_kv, weights_dir=str(tmp_path / switch_kv), python=sys.executable,
                              device="cpu")  # fmt: skip
        return VLLMEngine(VLLMConfig(model="m", options=options))

    assert EmbeddedEngine.keeps_kv_at_switch and vllm("keep").keeps_kv_at_switch
    assert not vllm("recompute").keeps_kv_at_switch
    sample = Sample("r", "t", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 3, 4], after_switch=[0, 0, 1])
    forget_switches([RolloutResult("r", "t", 1.0, [sample])])
    assert sample.after_switch is None and sample.policy_versions.tolist() == [-1, 3, 4]  # bucketed by lag alone
