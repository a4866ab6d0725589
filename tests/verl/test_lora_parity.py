"""LoRA in the verl backend against the torch backend's, at world size 1 and 2 (gloo on the CPU, verl's
real FSDP2 workers in a local Ray): the same initial adapter, one update (loss, grad norm, every
metric, the adapter, the merged weights) with the KL reference being the base with the adapter off,
and checkpoints that hold the adapter and resume exactly. Mirrors test_parity.py, whose tolerances
these are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends import TorchBackend, lora
from agl_trainer.backends.torch_config import BackendConfigError, LoraConfig
from agl_trainer.backends.verl import VerlBackend, VerlBackendConfig
from agl_trainer.weights.peft_files import read_adapter, write_adapter
from agl_trainer.weights.update import AdapterState
from transformers import AutoModelForCausalLM

from tests.algorithms.tiny import training_config
from tests.verl.test_parity import (
    _assert_same_update,
    assert_save_hf_serves_the_policy,
    parity_batch,
)

ADAPTER = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj"))
# test_parity's off-policy update (stale tokens, two mini-batches, an entropy bonus) plus a KL term:
# the second mini-batch sees an adapter the first moved, so the policy is away from the base
ALGORITHM = AlgorithmConfig(entropy_coef=0.01, importance_cap=1.5, kl_coef=0.5, kl_estimator="k3")
OPTIONS = {"num_mini_batches": 2, "micro_batch_tokens": 64, "max_grad_norm": 0.5, "eps": 1e-4}
LR = 1e-2


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def pair(request, local_ray, tiny_model, tmp_path_factory):
    """(verl backend, fresh torch backend factory, checkpoint of the verl backend's initial state)."""
    config = training_config(tiny_model, algorithm=ALGORITHM, lr=LR, lora=ADAPTER, **OPTIONS)
    backend = VerlBackend(VerlBackendConfig(training=config, n_gpus_per_node=request.param))
    initial = backend.save_checkpoint(tmp_path_factory.mktemp("lora-ckpt") / "initial")
    yield backend, (lambda: TorchBackend(config)), initial
    backend.close()


def _assert_same_adapter(got: AdapterState, want: AdapterState, exact: bool = False) -> None:
    assert got.config == want.config
    assert set(got.weights) == set(want.weights) and want.weights
    for name, tensor in want.weights.items():
        assert got.weights[name].dtype == tensor.dtype == torch.float32, name
        if exact:
            assert torch.equal(got.weights[name], tensor), name
        else:
            torch.testing.assert_close(got.weights[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


def test_both_backends_start_from_the_same_adapter(pair):
    """The adapter's A is drawn from the run's seed, not from the RNG's state after model loading (which
    differs between the backends): the start is the same, B = 0, the merged weights are the base's."""
    verl, make_torch, initial = pair
    verl.load_checkpoint(initial)
    torch_backend = make_torch()
    assert verl.uses_lora and torch_backend.uses_lora
    got, want = verl.adapter_for_engine(), torch_backend.adapter_for_engine()
    _assert_same_adapter(got, want, exact=True)
    assert all(bool((t == 0).all()) for n, t in got.weights.items() if "lora_B" in n)
    assert all(float(t.abs().max()) > 0 for n, t in got.weights.items() if "lora_A" in n)
    base = AutoModelForCausalLM.from_pretrained(torch_backend.config.model_path).state_dict()
    merged = verl.state_dict_for_engine()
    assert set(merged) == set(base) - {"lm_head.weight"}  # tied: once, as save_pretrained writes it
    for name, tensor in merged.items():
        assert torch.equal(tensor, base[name]), name


def test_one_lora_update_equals_the_torch_backend(pair):
    verl, make_torch, initial = pair
    verl.load_checkpoint(initial)
    torch_backend = make_torch()
    base = torch_backend.state_dict_for_engine()  # B = 0: the merged weights are the base's
    batch = parity_batch()
    want = torch_backend.train_step(batch, policy_version=1)
    got = verl.train_step(batch, policy_version=1)
    assert want["importance/stale_token_frac"] == 1.0 and want["perf/optimizer_steps"] == 2
    assert abs(want["loss/total"]) > 1e-3 and want["actor/grad_norm"] > 0
    assert want["actor/ref_kl"] > 1e-7 and want["loss/kl"] > 0  # the reference (adapter off) moved away
    new_torch = _assert_same_update(verl, got, torch_backend, want)  # every metric, the merged weights
    assert got["policy_version"] == want["policy_version"] == 2 and verl.step == torch_backend.step == 2
    adapter = verl.adapter_for_engine()
    _assert_same_adapter(adapter, torch_backend.adapter_for_engine())
    assert any(float(t.abs().max()) > 0.5 * LR for n, t in adapter.weights.items() if "lora_B" in n)
    # only adapted layers moved: the rest of the merged weights is the base, bit for bit
    adapted = {n for n in base if any(f"{m}.weight" in n for m in ADAPTER.target_modules)}
    assert adapted and all(torch.equal(new_torch[n], base[n]) for n in base if n not in adapted)
    assert max(float((new_torch[n] - base[n]).abs().max()) for n in adapted) > 1e-4


def test_checkpoint_holds_the_adapter_and_resumes_exactly(pair, tmp_path):
    verl, _, initial = pair
    verl.load_checkpoint(initial)
    batch = parity_batch()
    verl.train_step(batch, 0)
    middle = verl.save_checkpoint(tmp_path / "middle")
    saved = read_adapter(middle / "adapter")  # peft's format, as the torch backend writes it
    _assert_same_adapter(saved, verl.adapter_for_engine(), exact=True)
    after_two = verl.train_step(batch, 1)
    weights_two, adapter_two = verl.state_dict_for_engine(), verl.adapter_for_engine()
    verl.load_checkpoint(middle)
    assert verl.step == 2
    _assert_same_adapter(verl.adapter_for_engine(), saved, exact=True)
    again = verl.train_step(batch, 1)  # AdamW's moments, the schedule and the RNG came back too
    for key in ("loss/total", "actor/grad_norm", "actor/lr", "loss/kl"):
        assert again[key] == after_two[key], key
    _assert_same_adapter(verl.adapter_for_engine(), adapter_two, exact=True)
    for name, tensor in verl.state_dict_for_engine().items():
        assert torch.equal(tensor, weights_two[name]), name
    # the verl shards hold the adapter, not the frozen base (megabytes, not the model)
    shards = sorted((middle / "verl").glob("model_world_size_*_rank_*.pt"))
    model_bytes = sum(f.stat().st_size for f in Path(_model_path(verl)).glob("*.safetensors"))
    assert shards and sum(f.stat().st_size for f in shards) < model_bytes / 10


def test_a_checkpoint_of_other_settings_is_refused(pair, tmp_path):
    """A full-weights checkpoint, or an adapter of another rank: refused before verl loads anything."""
    verl, _, initial = pair
    other = tmp_path / "other"
    (other / "verl").mkdir(parents=True)
    (other / "agl_state.json").write_text((initial / "agl_state.json").read_text())
    with pytest.raises(ValueError, match="holds full weights but this backend trains an adapter"):
        verl.load_checkpoint(other)
    state = read_adapter(initial / "adapter")
    write_adapter(AdapterState(state.weights, {**state.config, "r": 8}), other / "adapter")
    with pytest.raises(ValueError, match="r 8 .now 4."):
        verl.load_checkpoint(other)


def test_save_hf_holds_the_merged_weights(pair, tmp_path):
    verl, _, initial = pair
    verl.load_checkpoint(initial)
    assert_save_hf_serves_the_policy(verl, tmp_path / "hf")  # base + adapter, merged


def test_lora_with_a_full_weight_gpu_transfer_is_refused(tiny_model):
    config = training_config(tiny_model, lora=ADAPTER)
    with pytest.raises(BackendConfigError, match=r"backend\.verl\.weight_sync: 'nccl' moves full weights"):
        VerlBackendConfig(training=config, weight_sync="nccl")


def _model_path(verl: VerlBackend) -> Path:
    return Path(verl.training.model_path)


@pytest.mark.parametrize("world", [1, 2])
def test_an_adapter_on_the_tied_output_head_equals_the_torch_backend(local_ray, tiny_model, tmp_path, world):
    """lm_head adapted on the tied model (its output alone, backends/lora.py): the same start and update
    as the torch backend, merged weights with the head as a weight of its own (the embedding the base's),
    and save_hf untied, so transformers serves the policy."""
    import json

    head = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "lm_head"))
    config = training_config(tiny_model, algorithm=ALGORITHM, lr=LR, lora=head, **OPTIONS)
    verl = VerlBackend(VerlBackendConfig(training=config, n_gpus_per_node=world))
    try:
        torch_backend = TorchBackend(config)
        _assert_same_adapter(verl.adapter_for_engine(), torch_backend.adapter_for_engine(), exact=True)
        base, embedding = torch_backend.state_dict_for_engine(), "model.embed_tokens.weight"
        assert torch.equal(base["lm_head.weight"], base[embedding])  # B = 0: a head of its own, the base's
        batch = parity_batch()
        want = torch_backend.train_step(batch, policy_version=1)
        got = verl.train_step(batch, policy_version=1)
        merged = _assert_same_update(verl, got, torch_backend, want)
        _assert_same_adapter(verl.adapter_for_engine(), torch_backend.adapter_for_engine())
        assert torch.equal(merged[embedding], base[embedding])
        assert float((merged["lm_head.weight"] - base[embedding]).abs().max()) > 1e-4
        out = assert_save_hf_serves_the_policy(verl, tmp_path / "hf")
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    finally:
        verl.close()
