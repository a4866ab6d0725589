"""Advantage estimators: one scalar per rollout, computed within its task group, then broadcast
to every trained token of every sample of that rollout.

Working per rollout (not per sample) keeps a rollout that made ten model calls from counting ten
times in its group's baseline. Groups smaller than `min_group_size` have no baseline; the policy
for them is explicit ("zero": advantage 0, still in the loss; "drop": out of the loss) and never
the raw reward, which is what verl's GRPO gives a singleton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from agl_trainer.algorithms.registry import Registry

SmallGroupPolicy = Literal["zero", "drop"]
SMALL_GROUP_POLICIES: tuple[str, ...] = ("zero", "drop")
# What one advantage belongs to: a rollout (agl's default), or each sample (model call) on its own, as
# Agent Lightning does: a sample is a row of its task's group with its rollout's reward, so a rollout
# that made ten calls counts ten times in the baseline (a study of the two: bench/normalization.py).
ADVANTAGE_UNITS: tuple[str, ...] = ("rollout", "sample")

# (rewards [R], group_index [R], epsilon) -> advantages [R]; groups of one may hold anything.
AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


@dataclass(frozen=True)
class GroupStats:
    """Per-rollout statistics of its group: size, mean and unbiased std of rewards."""

    size: torch.Tensor  # [R] float
    mean: torch.Tensor  # [R]
    std: torch.Tensor  # [R], 0 for groups of one


def group_stats(rewards: torch.Tensor, group_index: torch.Tensor) -> GroupStats:
    rewards = rewards.double()  # exact sums whatever the group size; cast back by the callers
    num_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    size = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group_index, torch.ones_like(rewards))
    total = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group_index, rewards)
    mean = (total / size.clamp(min=1))[group_index]
    squares = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group_index, (rewards - mean) ** 2)
    std = (squares / (size - 1).clamp(min=1)).sqrt()[group_index]
    return GroupStats(size=size[group_index], mean=mean, std=std)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """(r - mean) / (std + eps) within the group (GRPO, unbiased std like torch.std)."""
    stats = group_stats(rewards, group_index)
    return ((rewards.double() - stats.mean) / (stats.std + epsilon)).to(rewards.dtype)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, epsilon: float = 1e-6
) -> torch.Tensor:
    """r - mean within the group (Dr.GRPO: no std scaling, which over-weights easy/hard tasks)."""
    stats = group_stats(rewards, group_index)
    return (rewards.double() - stats.mean).to(rewards.dtype)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """r minus the mean of the *other* rollouts of the group: n/(n-1) * (r - mean)."""
    stats = group_stats(rewards, group_index)
    scale = stats.size / (stats.size - 1).clamp(min=1)
    return (scale * (rewards.double() - stats.mean)).to(rewards.dtype)


@dataclass(frozen=True)
class RolloutAdvantages:
    values: torch.Tensor  # [R] advantage per rollout (0 for small groups)
    trained: torch.Tensor  # [R] bool: False for rollouts the small-group policy drops from the loss
    num_small_groups: int
    num_small_group_rollouts: int
    # Groups with a baseline whose rewards are all equal (all pass, all fail): every advantage is 0, so
    # they train nothing; a step of mostly flat groups is a step of little signal (batch or task mix).
    num_flat_groups: int
    num_groups: int


def compute_rollout_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    estimator: str = "grpo",
    *,
    min_group_size: int = 2,
    small_group_policy: SmallGroupPolicy = "zero",
    epsilon: float = 1e-6,
) -> RolloutAdvantages:
    """Advantages per rollout with the small-group policy applied (see the module docstring)."""
    if rewards.ndim != 1 or rewards.shape != group_index.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} must be [R]"
        )
    if small_group_policy not in SMALL_GROUP_POLICIES:
        raise ValueError(f"small_group_policy {small_group_policy!r}: choose one of {SMALL_GROUP_POLICIES}")
    if min_group_size < 2:
        raise ValueError(f"min_group_size {min_group_size}: a baseline needs at least 2 rollouts per group")
    if not torch.isfinite(rewards).all():
        raise ValueError(
            "rewards contain NaN or infinity; fix the grader (every rollout needs a finite reward)"
        )
    rewards = rewards.float()
    values = ADVANTAGE_ESTIMATORS.get(estimator)(rewards, group_index, epsilon)
    stats = group_stats(rewards, group_index)
    small = stats.size < min_group_size
    values = torch.where(small, torch.zeros_like(values), values)
    trained = ~small if small_group_policy == "drop" else torch.ones_like(small)
    # std is exactly 0 iff a group's rewards are equal: float rewards summed in double give an exact mean
    flat = (stats.std == 0) & ~small
    return RolloutAdvantages(
        values=values,
        trained=trained,
        num_small_groups=int(torch.unique(group_index[small]).numel()),
        num_small_group_rollouts=int(small.sum()),
        num_flat_groups=int(torch.unique(group_index[flat]).numel()),
        num_groups=int(torch.unique(group_index).numel()),
    )


def broadcast_to_tokens(
    rollout_values: torch.Tensor, rollout_index: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """[R] per rollout -> [N, L] on the trained tokens of each rollout's samples (0 elsewhere)."""
    return rollout_values[rollout_index].unsqueeze(-1).to(loss_mask.dtype) * loss_mask
