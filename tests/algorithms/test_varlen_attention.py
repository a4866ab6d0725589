"""`attn_implementation: agl_varlen` (backends/varlen_attention.py): packed rows cut into their samples
by position_ids, each attending to itself only; the same logits and the same training step as sdpa's
block-diagonal mask (on the CPU through the per-sample reference kernel; on CUDA PyTorch's varlen
flash attention, `gpu` marker)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from agl_trainer.backends import TorchBackend
from agl_trainer.backends.varlen_attention import NAME, register, sample_bounds

from tests.algorithms.tiny import make_tiny_model, random_batch, training_config


def test_samples_start_at_each_row_and_wherever_positions_restart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 0, 0, 0]])
    bounds, longest = sample_bounds(positions)
    assert bounds.tolist() == [0, 3, 5, 8, 13, 14, 15, 16] and bounds.dtype == torch.int32
    assert longest == 5
    # a row that continues past a restart at a position other than 0 is cut there too
    assert sample_bounds(torch.tensor([[4, 5, 6, 2, 3]]))[0].tolist() == [0, 3, 5]


def tiny_model(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    register()
    return AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m"), attn_implementation="sdpa").eval()


def test_logits_equal_sdpa_over_packed_rows(tmp_path: Path):
    model = tiny_model(tmp_path)
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor(
        [list(range(7)) + list(range(13)),  # two samples
         list(range(12)) + list(range(8)),  # a sample, then the torch backend's padding (from 0)
         list(range(15)) + [0] * 5],  # a sample, then verl's padded layout (all 0)
    )  # fmt: skip
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        model.set_attn_implementation(NAME)
        got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    real = torch.ones(3, 20, dtype=torch.bool)
    real[2, 15:] = False  # verl's padding: positions all 0, nothing reads them
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=0)
    # and sdpa really kept the samples apart (a plain causal row would differ after the restart)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        plain = model(input_ids=ids[:1], use_cache=False).logits
    assert float((plain[0, 7:] - want[0, 7:]).abs().max()) > 1e-3


def test_a_forward_it_cannot_do_is_refused(tmp_path: Path):
    model = tiny_model(tmp_path)
    model.set_attn_implementation(NAME)
    with pytest.raises(ValueError, match=f"attn_implementation {NAME}: for training forwards over packed rows"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)


def test_the_torch_backends_step_equals_sdpas(tmp_path: Path):
    model = make_tiny_model(tmp_path / "model")
    batch = random_batch(num_tasks=3, per_task=3, seed=4, max_calls=3, max_len=30)
    outcomes = []
    for attention in ("sdpa", NAME):
        # eps 1e-4: AdamW would move weights whose gradient is at rounding level by lr (tests/verl/test_parity.py)
        config = training_config(model, attn_implementation=attention, micro_batch_tokens=64, eps=1e-4)
        backend = TorchBackend(config)
        assert backend.packed and backend.compute_model.dense_attention == (attention == "sdpa")
        logprobs = backend.compute_logprobs(batch)
        outcomes.append((logprobs, backend.train_step(batch, policy_version=0), backend.state_dict_for_engine()))
    (want_lp, want, want_w), (got_lp, got, got_w) = outcomes
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=0)
    assert want["loss/total"] != 0
    for key in ("loss/total", "actor/grad_norm", "actor/entropy"):
        assert got[key] == pytest.approx(want[key], abs=1e-5), key
    for name, tensor in want_w.items():
        torch.testing.assert_close(got_w[name], tensor, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_varlen_kernel_matches_sdpa(tmp_path: Path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    register()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda()
    lengths = [300, 17, 1200, 1, 530]
    ids = torch.randint(0, 512, (1, sum(lengths)), device="cuda")
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()
    outs = []
    for attention in ("sdpa", NAME):
        model.set_attn_implementation(attention)
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
        logits.logsumexp(-1).mean().backward()
        outs.append((logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    (want, want_grad), (got, got_grad) = outs
    torch.testing.assert_close(got, want, atol=5e-2, rtol=0)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-3, rtol=5e-2)
