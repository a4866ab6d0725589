"""Unit behaviour of the algorithm functions that verl has no counterpart for."""

from __future__ import annotations

import math

import pytest
import torch
from agl_trainer.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AlgorithmConfig,
    AlgorithmConfigError,
    compute_rollout_advantages,
    token_entropy,
    token_logprobs,
    token_weights,
)
from agl_trainer.backends.schedule import lr_multiplier


def test_small_group_policies():
    rewards = torch.tensor([1.0, 0.0, 5.0, 0.5, 0.25])
    groups = torch.tensor([0, 0, 1, 2, 2])
    zero = compute_rollout_advantages(rewards, groups, "grpo")
    assert zero.values[2] == 0 and bool(zero.trained.all())
    assert (zero.num_small_groups, zero.num_small_group_rollouts) == (1, 1)
    assert (zero.num_flat_groups, zero.num_groups) == (0, 3)  # a singleton is small, not flat
    drop = compute_rollout_advantages(rewards, groups, "grpo", small_group_policy="drop")
    assert drop.trained.tolist() == [True, True, False, True, True]
    # an expected group size of 3 makes both 2-groups incomplete, too
    strict = compute_rollout_advantages(rewards, groups, "rloo", min_group_size=3)
    assert torch.all(strict.values == 0) and strict.num_small_groups == 3


def test_flat_groups_are_those_with_one_reward_for_all():
    # flat: group 4 (0.1 three times), 0 (all 1.0), 5 (all 0.0); group 2 has signal; 9 is a singleton
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 7.0])
    groups = torch.tensor([4, 4, 4, 0, 0, 2, 2, 5, 5, 9])  # ids need not be contiguous
    got = compute_rollout_advantages(rewards, groups, "grpo")
    assert (got.num_flat_groups, got.num_groups, got.num_small_groups) == (3, 5, 1)
    assert torch.all(got.values[[0, 1, 2, 3, 4, 7, 8]] == 0) and torch.all(got.values[[5, 6]] != 0)
    nearly = torch.full((7,), 0.1)
    nearly[-1] = torch.nextafter(nearly[0], torch.tensor(1.0))  # one reward a float32 step apart
    assert nearly[-1] != nearly[0] and compute_rollout_advantages(nearly, torch.zeros(7, dtype=torch.long)).num_flat_groups == 0
    none = compute_rollout_advantages(torch.tensor([]), torch.tensor([], dtype=torch.long), "grpo")
    assert (none.num_flat_groups, none.num_groups) == (0, 0)


def test_estimators_by_hand():
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0]), torch.tensor([0, 0, 0, 1, 1])
    mean0, std0 = 1 / 3, math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    grpo = compute_rollout_advantages(rewards, groups, "grpo", epsilon=0.0).values
    assert grpo[0].item() == pytest.approx((1 - mean0) / std0, rel=1e-5)
    dr = compute_rollout_advantages(rewards, groups, "dr_grpo").values
    assert dr.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -0.5, 0.5], abs=1e-6)
    rloo = compute_rollout_advantages(rewards, groups, "rloo").values
    assert rloo.tolist() == pytest.approx([1.0, -0.5, -0.5, -1.0, 1.0], abs=1e-6)
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo"}


def test_equal_rewards_give_zero_advantage_not_nan():
    values = compute_rollout_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), "grpo").values
    assert torch.all(values == 0)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'.*grpo"):
        compute_rollout_advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), "gae")
    with pytest.raises(ValueError, match="NaN or infinity"):
        compute_rollout_advantages(torch.tensor([1.0, math.nan]), torch.zeros(2, dtype=torch.long))
    with pytest.raises(AlgorithmConfigError, match="algorithm.loss_agg_mode: 'mean' is not one of"):
        AlgorithmConfig(loss_agg_mode="mean")
    with pytest.raises(AlgorithmConfigError, match=r"advantage_unit: 'call' is not one of \['rollout', 'sample'\]"):
        AlgorithmConfig(advantage_unit="call")
    with pytest.raises(AlgorithmConfigError, match="algorithm.loss_norm_constant"):
        AlgorithmConfig(loss_agg_mode="rollout-mean-token-sum-norm")
    with pytest.raises(AlgorithmConfigError, match="algorithm.dual_clip_c"):
        AlgorithmConfig(dual_clip_c=0.5)
    with pytest.raises(AlgorithmConfigError, match=r"unknown keys \['clip'\]"):
        AlgorithmConfig.from_dict({"clip": 0.2})


def test_rollout_mean_ignores_rollouts_without_trained_tokens():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    weights = token_weights(mask, torch.tensor([0, 1, 2]), "rollout-mean")
    assert weights.tolist() == [[0.0, 0.25, 0.25], [0.0, 0.0, 0.0], [0.0, 0.5, 0.0]]


def test_logprobs_and_entropy_from_logits():
    logits = torch.randn(3, 5, 11)
    ids = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, ids), expected)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(token_entropy(logits), -(probs * probs.log()).sum(-1))


def test_lr_schedule():
    kwargs = {"warmup_steps": 2, "total_steps": 12, "min_lr_ratio": 0.1}
    assert [lr_multiplier(s, schedule="constant", **kwargs) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_multiplier(2, schedule="cosine", **kwargs) == pytest.approx(1.0)
    assert lr_multiplier(7, schedule="cosine", **kwargs) == pytest.approx(0.55)
    assert lr_multiplier(12, schedule="linear", **kwargs) == pytest.approx(0.1)
    assert lr_multiplier(50, schedule="linear", **kwargs) == pytest.approx(0.1)
