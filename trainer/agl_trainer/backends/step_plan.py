"""What every backend does around its forward/backward passes: check the batch, compute the rollouts'
advantages and the trained tokens, then cut the batch into mini-batches (one optimizer step each)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from agl_trainer.algorithms import (
    AlgorithmConfig,
    RolloutAdvantages,
    broadcast_to_tokens,
    compute_rollout_advantages,
    token_weights,
)
from agl_trainer.algorithms.token_age import staleness_metrics
from agl_trainer.backends.agreement import MissingPlan, plan_missing
from agl_trainer.backends.batch_checks import validate_batch
from agl_trainer.backends.packing import split_rollouts
from agl_trainer.batch import TrainingBatch


@dataclass(frozen=True)
class StepPlan:
    lengths: torch.Tensor  # per sample, from validate_batch
    advantages: RolloutAdvantages
    loss_mask: torch.Tensor  # [N, T] the batch's, less rollouts the advantage estimator leaves out
    token_advantages: torch.Tensor  # [N, T]
    missing: MissingPlan  # engine logprobs unknown: re-scored at lag 0, else out of loss_mask
    switched: torch.Tensor  # [N, T] bool: sampled after a keep switch over the old weights' KV
    staleness: dict[str, float]  # staleness/* of the tokens in loss_mask (algorithms/token_age.py)


@dataclass(frozen=True)
class MiniBatch:
    samples: list[int]  # rows of the batch
    weights: torch.Tensor  # [N, T] each trained token's share of the mini-batch's loss
    update: bool  # False: no signal, measured but left out (AlgorithmConfig.skip_zero_signal_updates)


def algorithm_batch(batch: TrainingBatch, algo: AlgorithmConfig) -> TrainingBatch:
    """`batch` with the rollouts the algorithm works on: as assembled (`advantage_unit: rollout`), or
    every sample its own (`sample`). Rows are unchanged, so per-row results (logprobs) keep their order."""
    return batch.samples_as_rollouts() if algo.advantage_unit == "sample" else batch


def plan_step(
    batch: TrainingBatch, algo: AlgorithmConfig, vocab_size: int, policy_version: int | None = None
) -> StepPlan:
    """Validate `batch` and compute what the step trains on (raises ValueError on a bad batch).
    `policy_version`: the version being trained; a token without an engine logprob is re-scored
    when that version sampled it, else left out of the loss."""
    lengths = validate_batch(batch, vocab_size)
    advantages = compute_rollout_advantages(
        batch.rollout_rewards,
        batch.rollout_group_index,
        algo.advantage_estimator,
        min_group_size=algo.min_group_size,
        small_group_policy=algo.small_group_policy,  # type: ignore[arg-type]
        epsilon=algo.advantage_epsilon,
    )
    loss_mask = batch.loss_mask.float() * advantages.trained[batch.rollout_index].unsqueeze(-1)
    missing = plan_missing(batch.known_logprobs(), loss_mask, batch.policy_versions, policy_version)
    loss_mask = loss_mask * ~missing.excluded
    token_advantages = broadcast_to_tokens(advantages.values, batch.rollout_index, loss_mask)
    staleness = staleness_metrics(loss_mask, batch.policy_versions, policy_version) if policy_version is not None else {}
    return StepPlan(lengths, advantages, loss_mask, token_advantages, missing, batch.switched(), staleness)


def mini_batches(
    batch: TrainingBatch, plan: StepPlan, algo: AlgorithmConfig, num_mini_batches: int
) -> Iterator[MiniBatch]:
    """The batch's rollouts in `num_mini_batches` parts of similar trained-token counts."""
    rollout_tokens = torch.zeros(batch.num_rollouts).index_add_(0, batch.rollout_index, plan.loss_mask.sum(-1))
    for rollouts in split_rollouts(rollout_tokens.tolist(), num_mini_batches):
        in_mini = torch.zeros(batch.num_rollouts, dtype=torch.bool)
        in_mini[rollouts] = True
        mini_mask = plan.loss_mask * in_mini[batch.rollout_index].unsqueeze(-1)
        weights = token_weights(mini_mask, batch.rollout_index, algo.loss_agg_mode, algo.loss_norm_constant)
        samples = torch.nonzero(in_mini[batch.rollout_index]).flatten().tolist()
        update = has_signal(weights, plan.token_advantages, algo) or not algo.skip_zero_signal_updates
        yield MiniBatch(samples, weights, update)


def has_signal(weights: torch.Tensor, token_advantages: torch.Tensor, algo: AlgorithmConfig) -> bool:
    """Whether a mini-batch's loss can have a nonzero gradient: some trained token with a nonzero
    advantage, or a KL or entropy term (those pull on every trained token whatever its advantage)."""
    if algo.kl_coef > 0 or algo.entropy_coef > 0:
        return True
    return bool(((weights != 0) & (token_advantages != 0)).any())
