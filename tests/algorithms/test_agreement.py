"""Engine/trainer agreement per token (backends/agreement.py) through the torch backend: each test
puts a known gap (or a missing logprob) into a batch and checks the step measures or handles it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from agl_trainer.algorithms import AlgorithmConfig, AlgorithmConfigError
from agl_trainer.backends import TorchBackend
from agl_trainer.batch import RolloutResult, TrainingBatch

from tests.algorithms.tiny import make_tiny_model, sample, training_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def backend_for(model_dir: Path, **algo) -> TorchBackend:
    return TorchBackend(training_config(model_dir, lr=1e-2, algorithm=AlgorithmConfig(**algo)))


def batch_at(version: int) -> TrainingBatch:
    rollouts = []
    for task, prompt in enumerate([[3, 4, 5], [6, 7], [8, 9, 10, 11]]):
        for rid, reward, completion in ((f"g{task}", 1.0, [20, 21, 22, 23]), (f"b{task}", 0.0, [30, 31, 32])):
            rollouts.append(RolloutResult(rid, f"t{task}", reward, [sample(rid, f"t{task}", prompt, completion, version)]))
    return TrainingBatch.from_rollouts(rollouts)


def exact(backend: TorchBackend, batch: TrainingBatch) -> TrainingBatch:
    """`batch` with the trainer's own logprobs as the engine's: what a faithful engine returns."""
    trainer = backend.compute_logprobs(batch)
    return dataclasses.replace(batch, engine_logprobs=torch.where(batch.loss_mask.bool(), trainer, 0.0))


def weights_after(model_dir: Path, batch: TrainingBatch, version: int, **algo) -> torch.Tensor:
    backend = backend_for(model_dir, **algo)
    backend.train_step(batch, version)
    return torch.cat([p.detach().flatten() for p in backend.model.parameters()])


def test_lag0_agreement_measures_the_gap(model_dir):
    backend = backend_for(model_dir)
    batch = exact(backend, batch_at(0))
    metrics = backend.train_step(batch, 0)
    assert metrics["agreement/lag0/tokens"] == float(batch.loss_mask.sum())
    assert metrics["agreement/lag0/mean_abs_delta"] < 1e-4  # fp32 engine and trainer: the same numbers
    assert metrics["agreement/lag0/frac_over"] == 0.0
    assert "agreement/stale/tokens" not in metrics and "agreement/keep_kv/tokens" not in metrics

    other = backend_for(model_dir)
    shifted = dataclasses.replace(batch, engine_logprobs=batch.engine_logprobs - 0.3 * batch.loss_mask)
    metrics = other.train_step(shifted, 0)  # an engine 0.3 nats off on every token
    assert metrics["agreement/lag0/mean_abs_delta"] == pytest.approx(0.3, abs=1e-4)
    assert metrics["agreement/lag0/max_abs_delta"] == pytest.approx(0.3, abs=1e-4)
    assert metrics["agreement/lag0/frac_over"] == 1.0  # over the default threshold 0.1
    k3 = torch.tensor(0.3).exp() - 0.3 - 1  # KL(engine || trainer) with log(trainer / engine) = 0.3
    assert metrics["agreement/lag0/k3"] == pytest.approx(float(k3), rel=1e-3)


def test_stale_and_keep_kv_tokens_are_reported_apart(model_dir):
    backend = backend_for(model_dir)
    base = exact(backend, batch_at(0))
    switched = torch.zeros_like(base.loss_mask, dtype=torch.bool)
    switched[0] = base.loss_mask[0].bool()  # the first sample's tokens came after a keep switch
    stale_rows = base.policy_versions.clone()
    stale_rows[1] = torch.where(base.loss_mask[1].bool(), 0, -1)
    versions = torch.where(base.loss_mask.bool(), 1, -1)
    versions[1] = stale_rows[1]  # the second sample: version 0, trained at version 1
    engine = base.engine_logprobs - 0.5 * switched.float()  # the switched tokens differ (old KV)
    batch = dataclasses.replace(base, policy_versions=versions, engine_logprobs=engine, after_switch=switched)
    metrics = backend.train_step(batch, 1)
    assert metrics["agreement/keep_kv/tokens"] == float(base.loss_mask[0].sum())
    assert metrics["agreement/keep_kv/mean_abs_delta"] == pytest.approx(0.5, abs=1e-4)
    assert metrics["agreement/stale/tokens"] == float(base.loss_mask[1].sum())
    lag0 = base.loss_mask.sum() - base.loss_mask[0].sum() - base.loss_mask[1].sum()
    assert metrics["agreement/lag0/tokens"] == float(lag0)
    assert metrics["agreement/lag0/mean_abs_delta"] < 1e-4  # the gap stayed out of lag 0


def test_missing_logprobs_are_rescored_at_lag0_and_never_weighed_as_zero(model_dir):
    """importance_scope all weighs every token with exp(old - engine): a missing logprob taken as
    0.0 would give its token the wrong weight; re-scored, the step equals the faithful engine's."""
    faithful = exact(backend_for(model_dir), batch_at(0))
    missing = faithful.loss_mask.bool().clone()
    missing[:, :5] = False  # some tokens of each sample lost their logprobs
    nan = dataclasses.replace(faithful, engine_logprobs=faithful.engine_logprobs.masked_fill(missing, float("nan")))
    nan = TrainingBatch.from_rollouts(_rollouts_of(nan))  # as assembly hands it over: NaN -> unknown
    assert not bool(nan.known_logprobs()[missing].any())
    zero = dataclasses.replace(faithful, engine_logprobs=faithful.engine_logprobs.masked_fill(missing, 0.0))

    want = weights_after(model_dir, faithful, 0, importance_scope="all")
    backend = backend_for(model_dir, importance_scope="all")
    metrics = backend.train_step(nan, 0)
    got = torch.cat([p.detach().flatten() for p in backend.model.parameters()])
    wrong = weights_after(model_dir, zero, 0, importance_scope="all")
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(wrong, want, atol=1e-4)  # what 0.0 as a logprob would have done
    assert metrics["agreement/logprobs_missing_tokens"] == float(missing.sum())
    assert metrics["agreement/logprobs_missing_rescored"] == float(missing.sum())
    assert metrics["agreement/logprobs_missing_excluded"] == 0.0


def test_missing_stale_logprobs_leave_the_loss(model_dir):
    """Tokens of version 0 trained at version 1: the trainer no longer has the weights that sampled
    them, so they are not trained; the step equals one without them in the loss mask."""
    base = exact(backend_for(model_dir), batch_at(0))
    missing = torch.zeros_like(base.loss_mask, dtype=torch.bool)
    missing[0] = base.loss_mask[0].bool()
    missing[2, :6] = base.loss_mask[2, :6].bool()
    nan = dataclasses.replace(base, logprob_known=~missing)
    without = dataclasses.replace(base, loss_mask=base.loss_mask * ~missing)
    backend = backend_for(model_dir)
    metrics = backend.train_step(nan, 1)
    got = torch.cat([p.detach().flatten() for p in backend.model.parameters()])
    assert torch.allclose(got, weights_after(model_dir, without, 1), atol=1e-6)
    assert metrics["agreement/logprobs_missing_excluded"] == float(missing.sum())
    assert metrics["agreement/logprobs_missing_rescored"] == 0.0
    assert metrics["agreement/stale/tokens"] == float((base.loss_mask.bool() & ~missing).sum())


@pytest.mark.parametrize("options", [{"num_mini_batches": 2}, {"ppo_epochs": 2}])
def test_agreement_uses_the_weights_before_the_update(model_dir, options):
    """With several optimizer steps a step, later mini-batches (and epochs) see moved weights: lag-0
    agreement still compares against the pre-update pass, once per token."""
    backend = TorchBackend(training_config(model_dir, lr=1e-1, algorithm=AlgorithmConfig(), **options))
    batch = exact(backend, batch_at(0))
    metrics = backend.train_step(batch, 0)
    assert metrics["perf/optimizer_steps"] == 2
    assert metrics["agreement/lag0/tokens"] == float(batch.loss_mask.sum())  # each token once
    assert metrics["agreement/lag0/mean_abs_delta"] < 1e-4


def test_bypass_mode_rescores_missing_logprobs_before_the_update(model_dir):
    """bypass_old_logprobs uses the engine's logprobs as PPO's old ones: a missing one is the
    trainer's pre-update logprob, also when the step takes several optimizer steps."""
    faithful = exact(backend_for(model_dir), batch_at(0))
    missing = faithful.loss_mask.bool().clone()
    missing[:, :5] = False
    unknown = dataclasses.replace(faithful, logprob_known=~missing)

    def weights(batch: TrainingBatch) -> torch.Tensor:
        algo = AlgorithmConfig(bypass_old_logprobs=True)
        backend = TorchBackend(training_config(model_dir, lr=1e-2, algorithm=algo, num_mini_batches=2))
        metrics = backend.train_step(batch, 0)
        assert metrics["agreement/lag0/mean_abs_delta"] < 1e-4
        return torch.cat([p.detach().flatten() for p in backend.model.parameters()])

    assert torch.allclose(weights(unknown), weights(faithful), atol=1e-6)


def test_threshold_is_validated():
    with pytest.raises(AlgorithmConfigError, match="agreement_threshold"):
        AlgorithmConfig(agreement_threshold=0)
    with pytest.raises(AlgorithmConfigError, match="agreement_threshold"):
        AlgorithmConfig.from_dict({"agreement_threshold": float("nan")})


def _rollouts_of(batch: TrainingBatch) -> list[RolloutResult]:
    """The batch's rows back as samples (one rollout per row), keeping per-token values as given."""
    from agl_trainer.batch import Sample

    out = []
    for row in range(batch.num_samples):
        n = int(batch.attention_mask[row].sum())
        rollout = batch.rollout_ids[int(batch.rollout_index[row])]
        task = batch.task_ids[int(batch.rollout_index[row])]
        reward = float(batch.rollout_rewards[int(batch.rollout_index[row])])
        s = Sample(
            rollout, task, batch.input_ids[row, :n].tolist(), batch.loss_mask[row, :n].int().tolist(),
            batch.engine_logprobs[row, :n].tolist(), batch.policy_versions[row, :n].tolist(),
        )
        out.append(RolloutResult(rollout, task, reward, [s]))
    return out
