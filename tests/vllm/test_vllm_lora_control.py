"""VLLMEngine's LoRA sync on the wire, on any machine: the engine's real command line starts the stdlib
stand-in of tests/vllm/fake_vllm (as test_engine_control.py), which records every control call.
The same on real vLLM: test_vllm_lora.py (marker `vllm`)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from agl_trainer.engines.vllm.config import LOAD_METHOD
from agl_trainer.engines.vllm.engine import VLLMEngine, VLLMError
from agl_trainer.weights.update import AdapterState, WeightUpdate

from tests.vllm.test_engine_control import fake_config, read_events

PREFIX = "base_model.model.model.layers.0.self_attn.q_proj"


def adapter(scale: float = 1.0) -> AdapterState:
    weights = {f"{PREFIX}.lora_A.weight": scale * torch.ones(4, 8),
               f"{PREFIX}.lora_B.weight": torch.zeros(8, 4)}  # fmt: skip
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"]}
    return AdapterState(weights, config)


def calls(tmp_path: Path) -> list[dict]:
    return [e for e in read_events(tmp_path / "events.jsonl") if not e["path"].startswith("<")]


def forget_calls(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").unlink(missing_ok=True)


def model_config(tmp_path: Path) -> None:
    """The model directory's config.json: it sizes the base-only adapter (nothing else is read here)."""
    (tmp_path / "model").mkdir(exist_ok=True)
    config = {"hidden_size": 8, "num_attention_heads": 1, "head_dim": 8}
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[VLLMEngine]:
    model_config(tmp_path)
    config = fake_config(tmp_path, served_model_name="tiny", lora_rank=4, weights_dir=str(tmp_path / "w"))
    engine = VLLMEngine(config)
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()


def test_start_serves_the_adapter_under_the_model_name_and_learns_its_id(tmp_path: Path, engine: VLLMEngine) -> None:
    (start,) = [e for e in read_events(tmp_path / "events.jsonl") if e["path"] == "<start>"]
    argv = start["argv"]
    assert argv[argv.index("--served-model-name") + 1] == "tiny-base" and "--enable-lora" in argv
    current = tmp_path / "w" / "lora" / "current"
    assert json.loads(argv[argv.index("--lora-modules") + 1])["path"] == str(current)
    assert current.resolve().name == "v0-empty"  # version 0 is the base: the empty adapter
    # its id, and the LoRA head patched for prompt_logprobs (vLLM 0.32 dies on them otherwise)
    methods = [c["body"]["method"] for c in calls(tmp_path)]
    assert methods == ["agl_adapter_ids", "agl_patch_lora_logits"]
    assert engine._adapter_ids == {engine.urls[0]: 1}


def test_an_adapter_sync_loads_the_adapter_alone_in_the_weights_recipe(tmp_path: Path, engine: VLLMEngine) -> None:
    forget_calls(tmp_path)
    first = adapter()
    seconds = engine.update_weights(WeightUpdate(version=1, adapter=first))
    root = tmp_path / "w" / "lora"
    sent = calls(tmp_path)
    assert [c["path"] for c in sent] == [
        "/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume",
    ]  # fmt: skip
    assert sent[0]["query"] == {"mode": "wait"}
    assert sent[1]["body"] == {"method": "agl_load_adapter", "args": [str(root / "v1"), 1]}
    assert sent[3]["body"] == {"new_version": "1"}
    assert (root / "v1" / "adapter_config.json").is_file() and (root / "current").resolve().name == "v1"
    report = engine.last_sync
    assert report is not None and report.adapter and report.version == 1 and report.seconds == seconds
    assert report.nbytes == engine.last_update_bytes == first.nbytes == 2 * 32 * 4  # 2 fp32 tensors of 32
    assert report.worker_results[0]["lora_int_id"] == 1 and report.write_seconds > 0

    engine.update_weights(WeightUpdate(version=2, adapter=adapter(2.0)))
    assert sorted(p.name for p in root.iterdir()) == ["current", "v0-empty", "v2"]  # v1 removed once loaded
    assert calls(tmp_path)[-4]["body"]["args"] == [str(root / "v2"), 1]


def test_a_keep_switch_loads_the_adapter_while_the_calls_are_frozen(tmp_path: Path, engine: VLLMEngine) -> None:
    forget_calls(tmp_path)
    engine.freeze()
    engine.update_weights(WeightUpdate(version=1, adapter=adapter()))
    engine.thaw()
    assert [(c["path"], (c["body"] or {}).get("method")) for c in calls(tmp_path)] == [
        ("/pause", None), ("/collective_rpc", "agl_request_progress"),  # freeze
        ("/collective_rpc", "agl_load_adapter"), ("/reset_prefix_cache", None),
        ("/update_weight_version", None),  # the sync: no pause of its own
        ("/reset_prefix_cache", None), ("/resume", None),  # thaw (switch_kv=recompute)
    ]  # fmt: skip


def test_full_weights_on_a_lora_engine_are_the_new_base_with_no_adapter(tmp_path: Path, engine: VLLMEngine) -> None:
    engine.update_weights(WeightUpdate(version=1, adapter=adapter()))
    forget_calls(tmp_path)
    state = {"model.norm.weight": torch.ones(8)}
    engine.update_weights(WeightUpdate(version=2, state_dict=state))
    root = tmp_path / "w" / "lora"
    rpcs = [c["body"] for c in calls(tmp_path) if c["path"] == "/collective_rpc"]
    # in one pause: vLLM's reload drops the workers' adapter; the empty one is loaded in its place
    assert [r["method"] for r in rpcs] == [LOAD_METHOD, "agl_load_adapter"]
    assert rpcs[1]["args"] == [str(root / "v0-empty"), 1]
    assert (root / "current").resolve().name == "v0-empty" and not (root / "v1").exists()
    assert engine.last_sync is not None and not engine.last_sync.adapter and engine.last_update_bytes == 32


def test_a_restarted_server_gets_the_latest_adapter(tmp_path: Path, engine: VLLMEngine) -> None:
    engine.update_weights(WeightUpdate(version=3, adapter=adapter()))
    process = engine._servers[0].process
    assert process is not None
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    forget_calls(tmp_path)

    assert engine.ensure_alive() == engine.urls
    root = tmp_path / "w" / "lora"
    sent = calls(tmp_path)
    assert [c["body"].get("method") for c in sent if c["path"] == "/collective_rpc"] == [
        "agl_adapter_ids", "agl_patch_lora_logits", "agl_load_adapter",
    ]  # fmt: skip
    assert next(c for c in sent if c["path"] == "/update_weight_version")["body"] == {"new_version": "3"}
    assert (root / "current").resolve().name == "v3"  # what the new server registered at its start


def test_a_server_that_does_not_serve_the_adapter_is_refused_with_the_flags(tmp_path: Path) -> None:
    plain = VLLMEngine(fake_config(tmp_path, served_model_name="tiny"))
    with plain:
        model_config(tmp_path)
        config = fake_config(tmp_path, urls=plain.urls, served_model_name="tiny", lora_rank=8)
        attached = VLLMEngine(config)
        refused = "does not serve the LoRA adapter 'tiny'.*--enable-lora.*--lora-modules"
        with pytest.raises(VLLMError, match=refused):
            attached.start()
        attached.stop()


def test_an_engine_without_lora_refuses_an_adapter_with_the_fix(tmp_path: Path) -> None:
    engine = VLLMEngine(fake_config(tmp_path))
    with pytest.raises(ValueError, match="engine.options.lora_rank > 0"):
        engine.update_weights(WeightUpdate(version=1, adapter=adapter()))
