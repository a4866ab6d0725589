"""Parity with verl's core_algos on identical inputs, for what both implement.

Our estimators work per rollout; verl's per sample. With one sample per rollout (reward on its last
token) the two must agree wherever verl's semantics are ours (groups of two or more rollouts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is a trainer dependency")

from agl_trainer.algorithms import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ClipConfig,
    agg_loss,
    broadcast_to_tokens,
    compute_rollout_advantages,
)


def _outcome_inputs(seed: int, groups: list[int], width: int = 12):
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.rand(sum(groups), generator=generator) * 4 - 1
    group_index = torch.tensor([g for g, size in enumerate(groups) for _ in range(size)])
    lengths = torch.randint(2, width + 1, (len(rewards),), generator=generator)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).float()
    token_rewards = torch.zeros(len(rewards), width)
    token_rewards[torch.arange(len(rewards)), lengths - 1] = rewards
    return rewards, group_index, mask, token_rewards


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    ("ours", "theirs", "kwargs"),
    [
        ("grpo", "compute_grpo_outcome_advantage", {"norm_adv_by_std_in_grpo": True}),
        ("dr_grpo", "compute_grpo_outcome_advantage", {"norm_adv_by_std_in_grpo": False}),
        ("grpo", "compute_grpo_vectorized_outcome_advantage", {}),
        ("rloo", "compute_rloo_outcome_advantage", {}),
        ("rloo", "compute_rloo_vectorized_outcome_advantage", {}),
    ],
)
def test_advantages_match_verl_for_groups_of_two_or_more(seed, ours, theirs, kwargs):
    rewards, group_index, mask, token_rewards = _outcome_inputs(seed, groups=[2, 3, 5, 8, 4])
    expected, _ = getattr(core_algos, theirs)(token_rewards, mask, group_index.numpy(), **kwargs)
    got = compute_rollout_advantages(rewards, group_index, ours)
    tokens = broadcast_to_tokens(got.values, torch.arange(len(rewards)), mask)
    torch.testing.assert_close(tokens, expected, atol=1e-5, rtol=1e-5)
    assert got.num_small_groups == 0


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_singletons_get_zero_not_verls_raw_reward(estimator):
    rewards, group_index, mask, token_rewards = _outcome_inputs(0, groups=[3, 1, 2, 1])
    theirs = {
        "grpo": core_algos.compute_grpo_outcome_advantage,
        "rloo": core_algos.compute_rloo_outcome_advantage,
    }
    expected, _ = theirs[estimator](token_rewards, mask, group_index.numpy())
    got = compute_rollout_advantages(rewards, group_index, estimator)
    singleton = torch.tensor([False, False, False, True, False, False, True])
    # verl: a singleton's advantage is its raw reward (mean 0, std 1); ours is exactly zero, and counted
    torch.testing.assert_close(expected[singleton][:, 0], rewards[singleton], atol=1e-5, rtol=0)
    assert torch.all(got.values[singleton] == 0)
    assert got.num_small_groups == 2 and got.num_small_group_rollouts == 2
    torch.testing.assert_close(
        broadcast_to_tokens(got.values, torch.arange(7), mask)[~singleton],
        expected[~singleton],
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_loss_aggregation_matches_verl(seed, mode):
    generator = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(6, 10, generator=generator)
    mask = (torch.rand(6, 10, generator=generator) > 0.4).float()
    mask[2] = 0  # a fully masked sequence is excluded by both
    constant = 17 if mode.endswith("-norm") else None
    expected = core_algos.agg_loss(loss_mat, mask, mode, loss_scale_factor=constant)
    torch.testing.assert_close(
        agg_loss(loss_mat, mask, mode, constant=constant), expected, atol=1e-6, rtol=1e-6
    )


def _actor_config(low: float, high: float, c: float):
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=low,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=c,
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("low", "high", "c"), [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5)])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_vanilla_ppo_loss_and_gradient_match_verl(seed, low, high, c, mode):
    generator = torch.Generator().manual_seed(seed)
    shape = (5, 9)
    old = -torch.rand(shape, generator=generator) * 3
    # log-ratios large enough to hit both clip bounds and the dual clip
    new = old + torch.randn(shape, generator=generator) * 0.8
    advantages = torch.randn(shape, generator=generator)
    mask = (torch.rand(shape, generator=generator) > 0.3).float()
    new_theirs, new_ours = new.clone().requires_grad_(), new.clone().requires_grad_()

    expected, metrics = core_algos.compute_policy_loss_vanilla(
        old, new_theirs, advantages, mask, loss_agg_mode=mode, config=_actor_config(low, high, c)
    )
    expected.backward()
    terms = POLICY_LOSSES.get("ppo")(new_ours, old, advantages, ClipConfig(low=low, high=high, dual_clip_c=c))
    got = agg_loss(terms.loss, mask, mode)
    got.backward()

    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new_ours.grad, new_theirs.grad, atol=1e-6, rtol=1e-6)
    clip_frac = float((terms.clipped.float() * mask).sum() / mask.sum())
    assert clip_frac == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)
    dual_frac = float((terms.dual_clipped.float() * mask).sum() / mask.sum())
    assert dual_frac == pytest.approx(metrics["actor/pg_clipfrac_lower"], abs=1e-6)
    assert clip_frac > 0  # the inputs exercise clipping, so the comparison means something


@pytest.mark.parametrize(("ours", "theirs"), [("k1", "k1"), ("k2", "k2"), ("k3", "low_var_kl")])
def test_kl_estimators_match_verl(ours, theirs):
    generator = torch.Generator().manual_seed(3)
    log_prob = -torch.rand(4, 7, generator=generator) * 5
    ref = log_prob + torch.randn(4, 7, generator=generator)
    torch.testing.assert_close(
        KL_ESTIMATORS.get(ours)(log_prob, ref), core_algos.kl_penalty(log_prob, ref, theirs)
    )


def test_verl_index_as_numpy_is_what_we_pass():
    # guard for the parity tests above: verl groups by equal index values, like our group_index
    _, group_index, mask, token_rewards = _outcome_inputs(1, groups=[2, 2])
    shuffled = np.array([1, 1, 0, 0])
    a, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, group_index.numpy())
    b, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, shuffled)
    torch.testing.assert_close(a, b)
