"""The torch backend on a tiny random Qwen2 built in the test (CPU), plus one bf16 step on CUDA."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends import BackendConfigError, TorchBackend, TorchBackendConfig
from agl_trainer.batch import RolloutResult, TrainingBatch

from tests.algorithms.tiny import (
    TINY_DIMS,
    VOCAB,
    make_tiny_model,
    random_batch,
    sample,
    training_config,
    two_call_rollout,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def backend_for(model_dir: Path, **overrides) -> TorchBackend:
    return TorchBackend(training_config(model_dir, **{"lr": 1e-3, **overrides}))


def good_and_bad_batch(version: int = 0) -> TrainingBatch:
    """Per task: a rewarded rollout (two calls, separate samples) and an unrewarded one."""
    rollouts = []
    for task, prompt in enumerate([[3, 4, 5], [6, 7], [8, 9, 10, 11]]):
        good = [
            sample(f"g{task}", f"t{task}", prompt, [20, 21, 22], version),
            sample(f"g{task}", f"t{task}", prompt + [20, 21, 22, 12], [23, 24], version),
        ]
        bad = [sample(f"b{task}", f"t{task}", prompt, [30, 31, 32, 33], version)]
        rollouts += [
            RolloutResult(f"g{task}", f"t{task}", 1.0, good),
            RolloutResult(f"b{task}", f"t{task}", 0.0, bad),
        ]
    return TrainingBatch.from_rollouts(rollouts)


def mean_logprob(backend: TorchBackend, batch: TrainingBatch, rollout_ids: set[str]) -> float:
    logprobs = backend.compute_logprobs(batch)
    rows = torch.tensor([batch.rollout_ids[r] in rollout_ids for r in batch.rollout_index.tolist()])
    mask = batch.loss_mask.bool() & rows.unsqueeze(-1)
    return float(logprobs[mask].mean())


def test_steps_raise_logprob_of_rewarded_tokens(model_dir):
    backend = backend_for(model_dir, lr=3e-3)
    assert backend.packed and backend._selects_hidden  # probed: Qwen2 keeps packed samples apart
    batch = good_and_bad_batch()
    good, bad = {"g0", "g1", "g2"}, {"b0", "b1", "b2"}
    before = (mean_logprob(backend, batch, good), mean_logprob(backend, batch, bad))
    for version in range(4):
        metrics = backend.train_step(batch, version)
    after = (mean_logprob(backend, batch, good), mean_logprob(backend, batch, bad))
    assert after[0] > before[0] + 0.5
    assert after[1] < before[1] - 0.5
    assert not any(key.startswith("reward/") for key in metrics)  # the loop reports rewards, once
    assert metrics["advantage/small_groups"] == 0
    assert (metrics["advantage/groups"], metrics["advantage/flat_groups"]) == (3, 0)  # each task: a 1.0 and a 0.0
    assert metrics["perf/tokens_per_s"] > 0 and metrics["actor/grad_norm"] > 0
    assert metrics["policy_version"] == 4 and backend.step == 4  # the version the last update produced


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_compute_logprobs_matches_a_plain_forward(model_dir, packing):
    backend = backend_for(model_dir, packing=packing, micro_batch_tokens=48)
    batch = random_batch(num_tasks=2, per_task=3, seed=5)
    got = backend.compute_logprobs(batch)
    with torch.no_grad():
        logits = backend.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected = torch.zeros_like(got)
    expected[:, 1:] = (
        torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    )
    trained = batch.loss_mask.bool()
    torch.testing.assert_close(got[trained], expected[trained], atol=1e-5, rtol=1e-5)
    assert torch.all(got[~trained] == 0)


def other_architecture(name: str, directory: Path) -> Path:
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, OPTConfig

    configs = {
        # GPT-2 and OPT ship with dropout 0.1; OPT's learned positions do not restart with position_ids
        "gpt2": GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=1
        ),
        "llama": LlamaConfig(vocab_size=VOCAB, **TINY_DIMS),
        "opt": OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            word_embed_proj_dim=64,
        ),
    }
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(configs[name]).save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("architecture", "packs"), [("gpt2", True), ("llama", True), ("opt", False)])
def test_other_architectures_score_each_sample_as_if_alone(tmp_path, architecture, packs):
    backend = backend_for(other_architecture(architecture, tmp_path / architecture), micro_batch_tokens=48)
    assert backend.packed is packs  # probed at load: OPT would mix packed samples, so it is not packed
    batch = random_batch(num_tasks=2, per_task=3, seed=5)
    got = backend.compute_logprobs(batch)
    expected = torch.zeros_like(got)
    lengths = batch.attention_mask.sum(-1)
    with torch.no_grad():
        for row, n in enumerate(lengths.tolist()):
            ids = batch.input_ids[row : row + 1, :n]
            logits = backend.model(input_ids=ids).logits[0, :-1]
            expected[row, 1:n] = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    trained = batch.loss_mask.bool()
    torch.testing.assert_close(got[trained], expected[trained], atol=1e-5, rtol=1e-5)
    metrics = backend.train_step(batch, 0)
    assert metrics["actor/ratio_max"] == pytest.approx(1.0)  # dropout is off: old and new agree exactly
    assert not torch.equal(backend.compute_logprobs(batch), got)


def test_micro_batching_and_packing_do_not_change_the_update(model_dir):
    batch = random_batch(num_tasks=3, per_task=3, seed=1)
    results = []
    for overrides in (
        {"micro_batch_tokens": 100_000, "packing": "padded"},
        {"micro_batch_tokens": 40, "packing": "packed", "gradient_checkpointing": True},
        {"micro_batch_tokens": 64, "packing": "padded"},
    ):
        backend = backend_for(model_dir, **overrides)
        metrics = backend.train_step(batch, 0)
        grads = torch.cat([p.grad.flatten() for p in backend.model.parameters()])
        results.append((metrics, grads))
    (whole, g0), (packed, g1), (padded, g2) = results
    assert (
        packed["perf/micro_batches"] > 1
        and padded["perf/micro_batches"] > 1
        and whole["perf/micro_batches"] == 1
    )
    for metrics, grads in ((packed, g1), (padded, g2)):
        torch.testing.assert_close(grads, g0, atol=2e-6, rtol=1e-4)
        assert metrics["loss/total"] == pytest.approx(whole["loss/total"], abs=1e-6)
        assert metrics["actor/entropy"] == pytest.approx(whole["actor/entropy"], rel=1e-5)
    assert packed["perf/padding_frac"] < padded["perf/padding_frac"] < whole["perf/padding_frac"]


def test_merged_or_split_rollout_gives_the_same_gradient(model_dir):
    """One two-call rollout as one merged sample, or as two samples: same loss, same gradient."""
    other = [
        RolloutResult("b", "t", 0.0, [sample("b", "t", [3, 4, 5, 6], [30, 31])]),
        RolloutResult("c", "t", 0.5, [sample("c", "t", [3, 4, 5, 6], [40, 41, 42, 43, 44])]),
    ]
    outcomes = []
    for split in (False, True):
        backend = backend_for(model_dir, algorithm=AlgorithmConfig(kl_coef=0.0, entropy_coef=0.01))
        batch = TrainingBatch.from_rollouts([two_call_rollout(split), *other])
        metrics = backend.train_step(batch, 0)
        outcomes.append(
            (metrics["loss/total"], torch.cat([p.grad.flatten() for p in backend.model.parameters()]))
        )
    assert outcomes[0][0] == pytest.approx(outcomes[1][0], abs=1e-6)
    torch.testing.assert_close(outcomes[0][1], outcomes[1][1], atol=1e-6, rtol=1e-4)


def test_sample_unit_trains_each_sample_as_its_own_rollout(model_dir):
    """advantage_unit sample: the update of the batch whose samples were made rollouts by hand (Agent
    Lightning's unit: a row of its task's group with its rollout's reward), not the per-rollout one."""
    calls = {  # rollout -> (task, reward, its samples' (prompt, response))
        "g": ("t", 1.0, [([3, 4, 5], [20, 21, 22]), ([3, 4], [23, 24])]),
        "b": ("t", 0.0, [([3, 4, 5], [30, 31, 32, 33])]),
        "h": ("u", 0.5, [([6, 7], [40, 41])]),
        "i": ("u", 0.0, [([6, 7], [42]), ([6], [43, 44, 45])]),
    }
    rollouts = [
        RolloutResult(rid, task, reward, [sample(rid, task, prompt, response) for prompt, response in rows])
        for rid, (task, reward, rows) in calls.items()
    ]
    by_hand = [
        RolloutResult(f"{r.rollout_id}/{k}", r.task_id, r.reward, [one])
        for r in rollouts
        for k, one in enumerate(r.samples)
    ]
    outcomes = {}
    for name, unit, results in [("sample", "sample", rollouts), ("by hand", "rollout", by_hand),
                                ("rollout", "rollout", rollouts)]:  # fmt: skip
        algorithm = AlgorithmConfig(advantage_unit=unit, loss_agg_mode="seq-mean-token-mean")
        backend = backend_for(model_dir, algorithm=algorithm)
        metrics = backend.train_step(TrainingBatch.from_rollouts(results), 0)
        gradient = torch.cat([p.grad.flatten() for p in backend.model.parameters()])
        outcomes[name] = (metrics["loss/total"], gradient)
    assert outcomes["sample"][0] == pytest.approx(outcomes["by hand"][0], abs=1e-6)
    torch.testing.assert_close(outcomes["sample"][1], outcomes["by hand"][1], atol=1e-6, rtol=1e-4)
    # per rollout, task t's advantages are +-0.707 over 2 rollouts; per sample, over 3 rows (1, 1, 0)
    assert not torch.allclose(outcomes["sample"][1], outcomes["rollout"][1], atol=1e-5)


def tied(batch: TrainingBatch) -> TrainingBatch:
    """The same batch with every rollout's reward 0: every group tied, every advantage 0."""
    return dataclasses.replace(batch, rollout_rewards=torch.zeros_like(batch.rollout_rewards))


@pytest.mark.parametrize(
    ("algorithm", "applied"),
    [
        (AlgorithmConfig(), False),  # no signal: the update is left out
        (AlgorithmConfig(skip_zero_signal_updates=False), True),  # stepped anyway: momentum moves it
        (AlgorithmConfig(entropy_coef=0.01), True),  # the entropy bonus has a gradient whatever the rewards
    ],
    ids=["skipped", "not-skipped", "entropy-bonus"],
)
def test_a_batch_with_no_signal_leaves_weights_and_optimizer_alone(model_dir, algorithm, applied):
    """After a real step (AdamW holds momentum), a batch whose groups all tied has advantages 0 and a
    gradient of exactly 0; stepping on it would still move the weights (momentum, weight decay)."""
    backend = backend_for(model_dir, algorithm=algorithm, weight_decay=0.1)
    backend.train_step(good_and_bad_batch(), 0)
    weights = {name: tensor.clone() for name, tensor in backend.state_dict_for_engine().items()}
    moments = [state["exp_avg"].clone() for state in backend.optimizer.state.values()]
    metrics = backend.train_step(tied(good_and_bad_batch(1)), 1)
    after = backend.state_dict_for_engine()
    moved = max(float((after[name] - tensor).abs().max()) for name, tensor in weights.items())
    states = list(backend.optimizer.state.values())
    still = all(torch.equal(state["exp_avg"], m) for state, m in zip(states, moments, strict=True))
    assert metrics["advantage/std"] == 0.0 and metrics["advantage/max"] == 0.0
    assert metrics["policy_version"] == 2 and backend.step == 2  # the step counts either way
    assert metrics["actor/entropy"] > 0 and metrics["agreement/lag0/tokens"] > 0  # measured either way
    assert metrics["actor/zero_signal_updates"] == (0.0 if applied else 1.0)
    if applied:
        assert moved > 1e-4 and not still
    else:
        assert moved == 0.0 and still and metrics["actor/grad_norm"] == 0.0
        assert backend.model.lm_head.weight.grad is None  # no backward ran
    if algorithm.entropy_coef == 0:
        assert metrics["actor/grad_norm"] == 0.0  # advantages 0: the policy loss has no gradient


def test_a_first_update_left_out_warns_nothing(model_dir):
    """The schedule counts a step left out before any optimizer step; torch's order warning is not
    for that case and is not shown."""
    backend = backend_for(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics = backend.train_step(tied(good_and_bad_batch()), 0)
    assert metrics["actor/zero_signal_updates"] == 1.0 and backend.step == 1


def test_checkpoint_resume_gives_identical_next_step(model_dir, tmp_path):
    config = {"lr": 2e-3, "warmup_steps": 2, "lr_schedule": "cosine", "total_steps": 10, "weight_decay": 0.01}
    batches = [random_batch(2, 3, seed=s) for s in range(3)]
    first = backend_for(model_dir, **config)
    first.train_step(batches[0], 0)
    first.train_step(batches[1], 1)
    first.save_checkpoint(tmp_path / "ckpt")
    expected = first.train_step(batches[2], 2)
    # the backend keeps no policy version; a checkpoint from before (one in trainer_state.pt) still loads
    state_path = tmp_path / "ckpt" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=False)
    assert "policy_version" not in state
    torch.save({**state, "policy_version": 2}, state_path)

    resumed = backend_for(model_dir, **config)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 2  # the policy version is the loop's: it comes back from the loop's checkpoint
    got = resumed.train_step(batches[2], 2)
    for name, value in expected.items():
        if not name.startswith("perf/"):
            assert got[name] == value, name
    for (name, a), b in zip(
        first.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    # and a backend that did not resume differs, so the comparison above can fail
    fresh = backend_for(model_dir, **config)
    assert fresh.train_step(batches[2], 2)["actor/lr"] != expected["actor/lr"]


def test_weights_for_the_engine(model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = backend_for(model_dir)
    backend.train_step(good_and_bad_batch(), 0)
    weights = backend.state_dict_for_engine()
    saved_dir = backend.save_hf(tmp_path / "v1")
    saved = load_file(saved_dir / "model.safetensors")
    assert set(weights) == set(saved)
    assert "lm_head.weight" not in weights  # tied: shipped once, as save_pretrained does
    for name, tensor in weights.items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, saved[name]), name
    # copies, not views of the live parameters
    weights["model.norm.weight"].add_(1.0)
    assert not torch.equal(weights["model.norm.weight"], backend.model.state_dict()["model.norm.weight"])
    reloaded = AutoModelForCausalLM.from_pretrained(saved_dir)
    ids = torch.tensor([[3, 4, 5, 20, 21]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, backend.model(ids).logits)
    assert AutoTokenizer.from_pretrained(saved_dir).convert_tokens_to_ids("w5") == 5
    half = backend.save_hf(tmp_path / "v1-bf16", dtype=torch.bfloat16)
    assert load_file(half / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    backend.train_step(good_and_bad_batch(), 1)
    backend.save_hf(saved_dir)  # replaces the previous version in place
    assert torch.equal(
        load_file(saved_dir / "model.safetensors")["model.norm.weight"],
        backend.model.state_dict()["model.norm.weight"],
    )
    assert {p.name for p in tmp_path.iterdir()} == {"v1", "v1-bf16"}  # no temporary leftovers


def test_stale_tokens_are_importance_weighted(model_dir):
    batch = random_batch(2, 3, seed=2, version=0)
    backend = backend_for(model_dir, algorithm=AlgorithmConfig(importance_cap=1.5))
    current = backend.train_step(batch, policy_version=0)
    assert current["importance/stale_token_frac"] == 0.0
    stale = backend.train_step(batch, policy_version=3)
    assert stale["importance/stale_token_frac"] == 1.0
    assert 0 < stale["importance/capped_frac"] < 1 and stale["importance/max"] == pytest.approx(1.5)
    assert stale["policy_version"] == 4  # the version this update produced, from the one it was given


def test_bypass_mode_uses_engine_logprobs_as_old(model_dir):
    batch = random_batch(2, 3, seed=3)
    batch.engine_logprobs = torch.where(
        batch.loss_mask.bool(), torch.full_like(batch.engine_logprobs, -9.0), 0.0
    )
    bypass = backend_for(model_dir, algorithm=AlgorithmConfig(bypass_old_logprobs=True)).train_step(batch, 0)
    assert bypass["actor/ratio_max"] > 1.2 and bypass["actor/clip_frac"] > 0.1  # pi / pi_engine is far from 1
    assert bypass["importance/stale_token_frac"] == 0.0
    on_policy = backend_for(model_dir).train_step(batch, 0)
    assert on_policy["actor/clip_frac"] == 0.0 and on_policy["actor/ratio_max"] == pytest.approx(1.0)


def test_several_updates_per_step_and_kl_to_reference(model_dir):
    batch = random_batch(3, 2, seed=4)
    algorithm = AlgorithmConfig(kl_coef=0.05, kl_estimator="k3", clip_ratio_low=0.01, clip_ratio_high=0.01)
    backend = backend_for(model_dir, lr=1e-2, num_mini_batches=2, ppo_epochs=2, algorithm=algorithm)
    metrics = backend.train_step(batch, 0)
    assert metrics["perf/optimizer_steps"] == 4 and backend.step == 4 and metrics["policy_version"] == 1
    assert metrics["actor/clip_frac"] > 0 and metrics["actor/approx_kl"] > 0  # later updates are off-policy
    assert metrics["actor/ref_kl"] > 0 and "loss/kl" in metrics
    first = backend_for(model_dir, algorithm=algorithm).train_step(batch, 0)
    assert first["actor/ref_kl"] == pytest.approx(0.0, abs=1e-7)  # the reference is the initial policy


def test_drop_policy_leaves_singletons_out_of_the_loss(model_dir):
    rollouts = [
        RolloutResult("solo", "alone", 1.0, [sample("solo", "alone", [3, 4], [20, 21])]),
        RolloutResult("a", "t", 1.0, [sample("a", "t", [3, 4], [30, 31, 32])]),
        RolloutResult("b", "t", 0.0, [sample("b", "t", [3, 4], [40])]),
    ]
    batch = TrainingBatch.from_rollouts(rollouts)
    dropped = backend_for(model_dir, algorithm=AlgorithmConfig(small_group_policy="drop")).train_step(batch, 0)
    kept = backend_for(model_dir).train_step(batch, 0)
    assert dropped["advantage/small_group_rollouts"] == kept["advantage/small_group_rollouts"] == 1
    assert dropped["perf/trained_tokens"] == 4 and kept["perf/trained_tokens"] == 6


def test_bad_config_and_batch_are_named(model_dir, tmp_path):
    with pytest.raises(BackendConfigError, match="backend.model_path: .* is not a directory"):
        TorchBackendConfig(model_path=tmp_path / "nope")
    with pytest.raises(BackendConfigError, match="backend.total_steps"):
        TorchBackendConfig(model_path=model_dir, lr_schedule="cosine")
    with pytest.raises(BackendConfigError, match="backend.packing"):
        TorchBackendConfig(model_path=model_dir, packing="tight")
    backend = backend_for(model_dir)
    batch = random_batch(1, 2)
    out_of_vocab = dataclasses.replace(
        batch, input_ids=batch.input_ids.masked_fill(batch.attention_mask.bool(), VOCAB)
    )
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        backend.train_step(out_of_vocab, 0)
    first_token = batch.loss_mask.clone()
    first_token[0, 0] = 1
    with pytest.raises(ValueError, match="first token"):
        backend.train_step(dataclasses.replace(batch, loss_mask=first_token), 0)
    with pytest.raises(ValueError, match="rollout_index"):
        backend.train_step(dataclasses.replace(batch, rollout_index=batch.rollout_index + 5), 0)
    # a NaN engine logprob is no error but an unknown one: tests/algorithms/test_agreement.py
    with pytest.raises(FileNotFoundError, match="not an agl checkpoint"):
        backend.load_checkpoint(tmp_path)
    assert backend.step == 0  # nothing above trained


def test_bf16_autocast_path_on_cpu(model_dir):
    """The mixed-precision path the GPU takes (float32 master weights, bfloat16 compute), on the CPU."""
    full = backend_for(model_dir)
    mixed = backend_for(model_dir, compute_dtype="bfloat16")
    assert mixed.autocast_dtype == torch.bfloat16 and full.autocast_dtype is None
    batch = good_and_bad_batch()
    torch.testing.assert_close(
        mixed.compute_logprobs(batch), full.compute_logprobs(batch), atol=0.1, rtol=0.05
    )
    metrics = mixed.train_step(batch, 0)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert next(mixed.model.parameters()).dtype == torch.float32


@pytest.mark.gpu
def test_bf16_step_on_cuda(model_dir, tmp_path):
    backend = TorchBackend(TorchBackendConfig(model_path=model_dir, device="cuda", lr=1e-3))
    assert backend.autocast_dtype == torch.bfloat16 and next(backend.model.parameters()).is_cuda
    batch = good_and_bad_batch()
    before = mean_logprob(backend, batch, {"g0", "g1", "g2"})
    for version in range(3):
        metrics = backend.train_step(batch, version)
    assert torch.isfinite(torch.tensor(list(metrics.values()))).all()
    assert mean_logprob(backend, batch, {"g0", "g1", "g2"}) > before
    weights = backend.state_dict_for_engine(dtype=torch.bfloat16)
    assert all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in weights.values())
    backend.save_checkpoint(tmp_path / "ckpt")
    resumed = TorchBackend(TorchBackendConfig(model_path=model_dir, device="cuda", lr=1e-3))
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 3
