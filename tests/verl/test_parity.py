"""The verl backend against the torch backend on the same batch, at world size 1 and 2 (gloo on the
CPU, verl's real FSDP2 workers in a local Ray): log-probs, one update (loss, grad norm, every
metric, the new weights), rollout-mean invariance, and checkpoints that resume exactly."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends import TorchBackend
from agl_trainer.backends.verl import VerlBackend, VerlBackendConfig
from agl_trainer.batch import RolloutResult, TrainingBatch

from tests.algorithms.tiny import random_batch, sample, training_config, two_call_rollout
from tests.support.waiting import wait_until

# every update is off-policy in some way: stale tokens (importance weights), two mini-batches
# (the second sees weights the first moved), an entropy bonus with a gradient
ALGORITHM = AlgorithmConfig(entropy_coef=0.01, importance_cap=1.5)
# AdamW moves an element by about lr whatever its gradient; eps 1e-4 (not 1e-8) keeps elements whose
# gradient is at rounding level (k_proj.bias: exactly 0 in theory) from being moved by rounding noise
# log-softmax in chunks of 4 positions (backends/chunked_logprobs.py): the workers' chunked path too
OPTIONS = {"num_mini_batches": 2, "micro_batch_tokens": 64, "max_grad_norm": 0.5, "eps": 1e-4, "logit_chunk_tokens": 4}
LR = 1e-2


def parity_batch() -> TrainingBatch:
    return random_batch(num_tasks=3, per_task=3, seed=11, max_calls=3, version=0)


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def pair(request, local_ray, tiny_model, tmp_path_factory):
    """(verl backend, fresh torch backend factory, checkpoint of the verl backend's initial state)."""
    config = training_config(tiny_model, algorithm=ALGORITHM, lr=LR, **OPTIONS)
    backend = VerlBackend(VerlBackendConfig(training=config, n_gpus_per_node=request.param))
    initial = backend.save_checkpoint(tmp_path_factory.mktemp("ckpt") / "initial")
    yield backend, (lambda: TorchBackend(config)), initial
    backend.close()


def test_old_logprobs_equal_the_torch_backend(pair):
    verl, make_torch, initial = pair
    verl.load_checkpoint(initial)
    batch = parity_batch()
    got, want = verl.compute_logprobs(batch), make_torch().compute_logprobs(batch)
    assert got.shape == want.shape == batch.loss_mask.shape
    assert bool((got[batch.loss_mask == 0] == 0).all())
    trained = batch.loss_mask != 0
    assert float(want[trained].abs().min()) > 0  # real log-probs to compare, not zeros
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_one_update_equals_the_torch_backend(pair):
    verl, make_torch, initial = pair
    verl.load_checkpoint(initial)
    torch_backend = make_torch()
    initial_weights = torch_backend.state_dict_for_engine()
    batch = parity_batch()
    want = torch_backend.train_step(batch, policy_version=1)
    got = verl.train_step(batch, policy_version=1)
    assert want["importance/stale_token_frac"] == 1.0 and want["perf/optimizer_steps"] == 2
    assert abs(want["loss/total"]) > 1e-3 and want["actor/clip_frac"] > 0  # a real, clipped update
    new_torch = _assert_same_update(verl, got, torch_backend, want)
    assert got["policy_version"] == want["policy_version"] == 2 and verl.step == torch_backend.step == 2
    assert verl.packed and want["perf/micro_batches"] >= 4  # two mini-batches of packed rows, cut by budget
    if verl.dp_size == 1:  # the same micro-batches (tests/verl/test_payload.py): as many, as padded
        assert got["perf/micro_batches"] == want["perf/micro_batches"]
        assert got["perf/padding_frac"] == pytest.approx(want["perf/padding_frac"])
    moved = max(float((new_torch[n] - initial_weights[n]).abs().max()) for n in new_torch)
    assert moved > 0.5 * LR


def test_agreement_and_missing_logprobs_equal_the_torch_backend(pair):
    """Lag-0, stale and keep-switch tokens, some without an engine logprob (re-scored at lag 0,
    excluded when stale): the verl workers measure and train exactly as the torch backend does."""
    verl, make_torch, initial = pair
    verl.load_checkpoint(initial)
    torch_backend = make_torch()
    batch = parity_batch()
    trained = batch.loss_mask.bool()
    versions = torch.where(trained, 1, -1)
    versions[::3] = torch.where(trained[::3], 0, -1)  # every third sample is stale
    known = torch.ones_like(trained)
    known[:, ::4] = False  # a quarter of the columns lost their logprobs
    switched = torch.zeros_like(trained)
    switched[1::3, 6:] = trained[1::3, 6:]  # sampled after a keep switch
    batch = dataclasses.replace(batch, policy_versions=versions, logprob_known=known, after_switch=switched)
    want = torch_backend.train_step(batch, policy_version=1)
    got = verl.train_step(batch, policy_version=1)
    assert want["agreement/logprobs_missing_rescored"] > 0 and want["agreement/logprobs_missing_excluded"] > 0
    assert want["agreement/lag0/tokens"] > 0 and want["agreement/stale/tokens"] > 0
    assert want["agreement/keep_kv/tokens"] > 0
    _assert_same_update(verl, got, torch_backend, want)


def _assert_same_update(verl, got, torch_backend, want) -> dict[str, torch.Tensor]:
    """Every metric but perf/* and every new weight agree; returns the torch backend's weights."""
    assert set(want) - set(got) == set()
    for key, value in want.items():
        if not key.startswith("perf/"):
            assert got[key] == pytest.approx(value, abs=1e-5), key
    new_verl, new_torch = verl.state_dict_for_engine(), torch_backend.state_dict_for_engine()
    assert set(new_verl) == set(new_torch)
    for name, tensor in new_torch.items():
        torch.testing.assert_close(new_verl[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    return new_torch


def _merged_or_split(split: bool) -> TrainingBatch:
    prompt = [3, 4, 5, 6]
    others = [
        RolloutResult("b", "t", 0.0, [sample("b", "t", prompt, [30, 31])]),
        RolloutResult("c", "t", 0.5, [sample("c", "t", prompt, [40, 41, 42, 43, 44])]),
        RolloutResult("d", "u", 1.0, [sample("d", "u", [7, 8], [50, 51, 52])]),
        RolloutResult("e", "u", 0.0, [sample("e", "u", [7, 8], [53])]),
    ]
    return TrainingBatch.from_rollouts([two_call_rollout(split), *others])


def test_merged_or_split_rollout_gives_the_same_update(pair):
    """Rollout-mean invariance through verl's DP split and micro-batching, checked on the weights."""
    verl, _, initial = pair
    outcomes = []
    for split in (False, True):
        verl.load_checkpoint(initial)
        metrics = verl.train_step(_merged_or_split(split), policy_version=1)
        outcomes.append((metrics, verl.state_dict_for_engine()))
    (merged, w_merged), (split, w_split) = outcomes
    assert merged["loss/total"] == pytest.approx(split["loss/total"], abs=1e-6)
    assert (
        merged["actor/grad_norm"] == pytest.approx(split["actor/grad_norm"], rel=1e-5)
        and merged["actor/grad_norm"] > 0
    )
    for name, tensor in w_merged.items():
        torch.testing.assert_close(w_split[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    # the update is real (an invariance between two no-ops would prove nothing)
    verl.load_checkpoint(initial)
    before = verl.state_dict_for_engine()
    moved = max(float((w_split[n] - before[n]).abs().max()) for n in before)
    assert moved > 1e-4


def test_one_rollout_of_one_sample_trains_like_the_torch_backend(pair):
    """A batch smaller than the DP group: at world size 2 the second rank runs only a zero-weight
    padding row (whose forward must still join FSDP's collectives; gloo once aborted in
    Pair::prepareRead here), and the update equals the torch backend's."""
    verl, make_torch, initial = pair
    verl.load_checkpoint(initial)
    torch_backend = make_torch()
    only = sample("only", "t", [3, 4, 5, 6, 7], [20, 21, 22, 23], 0, logprob=-4.0)
    batch = TrainingBatch.from_rollouts([RolloutResult("only", "t", 1.0, [only])])
    want = torch_backend.train_step(batch, policy_version=1)
    got = verl.train_step(batch, policy_version=1)
    assert want["actor/grad_norm"] > 0
    _assert_same_update(verl, got, torch_backend, want)


def test_checkpoint_resumes_exactly(pair, tmp_path):
    verl, _, initial = pair
    verl.load_checkpoint(initial)
    batch = parity_batch()
    verl.train_step(batch, 0)
    middle = verl.save_checkpoint(tmp_path / "middle")
    after_two = verl.train_step(batch, 1)
    weights_two = verl.state_dict_for_engine()
    verl.load_checkpoint(middle)
    assert verl.step == 2  # the policy version is the loop's, restored from the loop's checkpoint
    again = verl.train_step(batch, 1)
    assert again["loss/total"] == after_two["loss/total"]
    assert again["actor/grad_norm"] == after_two["actor/grad_norm"]
    assert again["actor/lr"] == after_two["actor/lr"]
    for name, tensor in verl.state_dict_for_engine().items():
        assert torch.equal(tensor, weights_two[name]), name
    assert not math.isnan(again["actor/entropy"])


def assert_save_hf_serves_the_policy(verl, out: Path) -> Path:  # type: ignore[no-untyped-def]
    """After one step, `save_hf` writes a model transformers loads whose log-probs are the backend's."""
    from transformers import AutoModelForCausalLM

    batch = parity_batch()
    verl.train_step(batch, 0)
    out = verl.save_hf(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = torch.zeros_like(batch.loss_mask, dtype=torch.float32)
    expected[:, 1:] = (
        torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    )
    expected = expected * (batch.loss_mask != 0)
    torch.testing.assert_close(verl.compute_logprobs(batch), expected, atol=1e-5, rtol=0)
    return out


def test_save_hf_loads_in_transformers(pair, tmp_path):
    verl, _, initial = pair
    verl.load_checkpoint(initial)
    out = assert_save_hf_serves_the_policy(verl, tmp_path / "hf")
    assert (out / "tokenizer.json").is_file()


def _free_cpus() -> float:
    import ray

    return ray.available_resources().get("CPU", 0.0)


def test_kl_to_the_reference_model_equals_the_torch_backend(local_ray, tiny_model):
    """kl_coef > 0: a frozen copy of the initial model in each worker; two epochs, so the second
    update is away from the reference and the KL term has a value and a gradient."""
    algorithm = AlgorithmConfig(kl_coef=0.5, kl_estimator="k3", entropy_coef=0.0)
    config = training_config(tiny_model, algorithm=algorithm, lr=LR, ppo_epochs=2, eps=1e-4)
    batch = parity_batch()
    want = TorchBackend(config).train_step(batch, policy_version=1)
    free_before = _free_cpus()
    backend = VerlBackend(VerlBackendConfig(training=config, n_gpus_per_node=2))
    try:
        assert _free_cpus() == free_before - 2
        got = backend.train_step(batch, policy_version=1)
    finally:
        backend.close()
    # close() gives the placement groups' CPUs back to the shared Ray
    wait_until(lambda: _free_cpus() == free_before, "the workers' CPUs back in Ray", timeout=10)
    assert want["actor/ref_kl"] > 1e-6 and want["loss/kl"] > 0
    for key in ("loss/total", "loss/kl", "actor/ref_kl", "actor/grad_norm", "actor/grad_norm_max", "loss/pg"):
        assert got[key] == pytest.approx(want[key], abs=1e-5), key


def test_sample_unit_trains_as_in_the_torch_backend(local_ray, tiny_model):
    """advantage_unit sample (each sample its own rollout, the step plan's): the verl workers get the
    same advantages and weights and make the same update as the torch backend."""
    algorithm = AlgorithmConfig(
        advantage_unit="sample", loss_agg_mode="seq-mean-token-mean", entropy_coef=0.01
    )
    config = training_config(tiny_model, algorithm=algorithm, lr=LR, **OPTIONS)
    torch_backend = TorchBackend(config)
    backend = VerlBackend(VerlBackendConfig(training=config, n_gpus_per_node=1))
    try:
        batch = parity_batch()
        assert batch.num_samples > batch.num_rollouts  # rollouts of several samples: the units differ
        want = torch_backend.train_step(batch, policy_version=1)
        got = backend.train_step(batch, policy_version=1)
        assert abs(want["loss/total"]) > 1e-3
        _assert_same_update(backend, got, torch_backend, want)
    finally:
        backend.close()


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_loss_temperature_trains_as_in_the_torch_backend(local_ray, tiny_model, mini_batches):
    """loss_temperature 0.6, with the KL term and stale tokens: verl's workers score the policy, the
    reference and (two mini-batches) PPO's old log-probs at T (verl's forward divides by the
    micro-batch's temperature, agl's trained positions too) and keep the model's own for agreement and
    importance weights (one update: from the same forward): every metric and weight as the torch
    backend's, which differ from a step at T = 1."""
    algorithm = AlgorithmConfig(loss_temperature=0.6, kl_coef=0.5, entropy_coef=0.01, importance_cap=1.5)
    options = {**OPTIONS, "num_mini_batches": mini_batches}
    config = training_config(tiny_model, algorithm=algorithm, lr=LR, **options)
    torch_backend = TorchBackend(config)
    backend = VerlBackend(VerlBackendConfig(training=config, n_gpus_per_node=1))
    try:
        batch = parity_batch()
        torch.testing.assert_close(
            backend.compute_logprobs(batch, temperature=0.6), torch_backend.compute_logprobs(batch, temperature=0.6),
            atol=1e-5, rtol=0,
        )  # fmt: skip
        want = torch_backend.train_step(batch, policy_version=1)
        got = backend.train_step(batch, policy_version=1)
        _assert_same_update(backend, got, torch_backend, want)
    finally:
        backend.close()
    own = training_config(tiny_model, algorithm=AlgorithmConfig(kl_coef=0.5, entropy_coef=0.01, importance_cap=1.5),
                          lr=LR, **options)  # fmt: skip
    at_one = TorchBackend(own).train_step(batch, policy_version=1)
    assert abs(at_one["actor/entropy"] - want["actor/entropy"]) > 1e-3  # the step at T is another step


def test_a_batch_with_no_signal_is_left_out_as_in_the_torch_backend(local_ray, tiny_model):
    """After a real step, a batch whose groups all tied (advantages 0, no entropy or KL term): the
    verl workers measure it and leave the weights and AdamW's state alone, as the torch backend
    does; the next real step then equals the torch backend's (the momentum was not spent)."""
    config = training_config(tiny_model, algorithm=AlgorithmConfig(), lr=LR, weight_decay=0.1, eps=1e-4)
    torch_backend = TorchBackend(config)
    backend = VerlBackend(VerlBackendConfig(training=config, n_gpus_per_node=1))
    try:
        batch = parity_batch()
        tied = dataclasses.replace(batch, rollout_rewards=torch.zeros_like(batch.rollout_rewards))
        for version, trained in enumerate([batch, tied, batch]):
            if version == 1:
                before = backend.state_dict_for_engine()
            want = torch_backend.train_step(trained, policy_version=version)
            got = backend.train_step(trained, policy_version=version)
            assert want["actor/zero_signal_updates"] == (1.0 if version == 1 else 0.0)
            _assert_same_update(backend, got, torch_backend, want)
            if version == 1:
                assert got["actor/grad_norm"] == 0.0 and got["actor/entropy"] > 0
                for name, tensor in backend.state_dict_for_engine().items():
                    assert torch.equal(tensor, before[name]), name
    finally:
        backend.close()


def test_bf16_weights_for_the_engine_equal_the_torch_backends(pair):
    """The export casts each shard before gathering it (a rank's half of the bytes; none gathered at
    world size 1) and moves the weights through Ray as buffers: the torch backend's bf16 tensors,
    bit for bit, each with storage of its own."""
    verl, make_torch, initial = pair
    verl.load_checkpoint(initial)
    got, want = verl.state_dict_for_engine(torch.bfloat16), make_torch().state_dict_for_engine(torch.bfloat16)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], tensor), name
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == len(got)
