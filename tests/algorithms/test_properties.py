"""Properties of rollout-level normalization (hypothesis).

A rollout's model calls can reach the trainer as one merged sample (each prompt extends the last
sequence) or as separate samples (one per call). Under rollout-mean, neither the loss nor its
gradient may depend on which, nor on the order of samples and rollouts, nor on how the batch is cut
into micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from agl_trainer.algorithms import (
    AlgorithmConfig,
    broadcast_to_tokens,
    compute_rollout_advantages,
    rl_objective,
    token_weights,
)
from hypothesis import given, settings
from hypothesis import strategies as st

ROLLOUT_MODES = ["rollout-mean", "rollout-mean-token-sum-norm"]

calls = st.lists(
    st.tuples(st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=4
)  # (prompt, completion)
rollouts = st.lists(st.tuples(st.integers(0, 2), calls), min_size=1, max_size=7)  # (task, calls)


@dataclass
class Layout:
    rows: torch.Tensor  # [K] row of each trained token
    cols: torch.Tensor  # [K] column of each trained token
    rollout_index: torch.Tensor  # [N]
    shape: tuple[int, int]

    def place(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[K] per trained token -> [N, L] (differentiable)."""
        out = torch.full(self.shape, fill, dtype=values.dtype)
        return out.index_put((self.rows, self.cols), values)

    @property
    def mask(self) -> torch.Tensor:
        return self.place(torch.ones(len(self.rows)))


def build_layout(spec, merged: bool, sample_order=None) -> Layout:
    """Trained tokens are numbered rollout by rollout, call by call, so both layouts share numbering."""
    samples: list[tuple[int, list[tuple[int, int]]]] = []  # (rollout, [(column, token number)])
    token = 0
    for r, (_, rollout_calls) in enumerate(spec):
        merged_columns, cursor = [], 0
        for prompt, completion in rollout_calls:
            cursor += prompt  # new prompt tokens (tool output, template) are never trained
            placed = [(cursor + i, token + i) for i in range(completion)]
            cursor += completion
            token += completion
            if merged:
                merged_columns += placed
            else:
                samples.append((r, placed))  # the earlier calls sit, untrained, in this sample's prompt
        if merged:
            samples.append((r, merged_columns))
    order = sample_order(len(samples)) if sample_order else range(len(samples))
    samples = [samples[i] for i in order]
    rows, cols, numbers = [], [], []
    for row, (_, placed) in enumerate(samples):
        for column, number in placed:
            rows.append(row)
            cols.append(column)
            numbers.append(number)
    perm = torch.argsort(torch.tensor(numbers))  # trained token k -> its (row, col)
    width = 1 + max(c for c in cols)
    return Layout(
        torch.tensor(rows)[perm],
        torch.tensor(cols)[perm],
        torch.tensor([r for r, _ in samples]),
        (len(samples), width),
    )


def token_values(spec, seed: int):
    num_tokens = sum(c for _, cs in spec for _, c in cs)
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(num_tokens, generator=generator) * 4
    new = old + torch.randn(num_tokens, generator=generator) * 0.5
    ref = old + torch.randn(num_tokens, generator=generator) * 0.3
    entropy = torch.rand(num_tokens, generator=generator) * 3
    rewards = torch.rand(len(spec), generator=generator)
    return new, old, ref, entropy, rewards


def batch_loss(spec, layout: Layout, values, config: AlgorithmConfig, rollout_perm=None):
    new, old, ref, entropy, rewards = values
    leaf = new.clone().requires_grad_()
    entropy_leaf = entropy.clone().requires_grad_()
    groups = torch.tensor([task for task, _ in spec])
    rollout_index = layout.rollout_index
    if rollout_perm is not None:  # relabel rollouts: rollout r is stored at position rollout_perm[r]
        rewards = torch.empty_like(rewards).index_put((rollout_perm,), rewards)
        groups = torch.empty_like(groups).index_put((rollout_perm,), groups)
        rollout_index = rollout_perm[rollout_index]
    mask = layout.mask
    advantages = compute_rollout_advantages(rewards, groups, config.advantage_estimator)
    weights = token_weights(mask, rollout_index, config.loss_agg_mode, config.loss_norm_constant)
    out = rl_objective(
        config,
        log_prob=layout.place(leaf),
        old_log_prob=layout.place(old),
        advantages=broadcast_to_tokens(advantages.values, rollout_index, mask),
        weights=weights,
        ref_log_prob=layout.place(ref),
        entropy=layout.place(entropy_leaf),
    )
    out.loss.backward()
    return out.loss.detach(), leaf.grad, entropy_leaf.grad, weights, rollout_index


def config_for(mode: str, estimator: str) -> AlgorithmConfig:
    return AlgorithmConfig(
        advantage_estimator=estimator,
        loss_agg_mode=mode,
        loss_norm_constant=8.0,
        kl_coef=0.1,
        entropy_coef=0.01,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )


@settings(max_examples=60, deadline=None)
@given(
    spec=rollouts,
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(ROLLOUT_MODES),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
)
def test_loss_and_gradient_same_merged_or_split(spec, seed, mode, estimator):
    values, config = token_values(spec, seed), config_for(mode, estimator)
    loss_m, grad_m, egrad_m, _, _ = batch_loss(spec, build_layout(spec, merged=True), values, config)
    loss_s, grad_s, egrad_s, _, _ = batch_loss(spec, build_layout(spec, merged=False), values, config)
    torch.testing.assert_close(loss_m, loss_s, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad_m, grad_s, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(egrad_m, egrad_s, atol=1e-7, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(spec=rollouts, merged=st.booleans())
def test_each_rollout_weighs_one_over_batch_size_whatever_its_sample_count(spec, merged):
    layout = build_layout(spec, merged=merged)
    weights = token_weights(layout.mask, layout.rollout_index, "rollout-mean")
    per_rollout = torch.zeros(len(spec)).index_add_(0, layout.rollout_index, weights.sum(-1))
    torch.testing.assert_close(per_rollout, torch.full((len(spec),), 1.0 / len(spec)))
    # the constant-normalized variant weighs a rollout by its tokens, never by its samples
    constant = token_weights(layout.mask, layout.rollout_index, "rollout-mean-token-sum-norm", 8.0)
    tokens = torch.tensor([sum(c for _, c in cs) for _, cs in spec], dtype=torch.float32)
    per_rollout = torch.zeros(len(spec)).index_add_(0, layout.rollout_index, constant.sum(-1))
    torch.testing.assert_close(per_rollout, tokens / (8.0 * len(spec)))


def test_sample_modes_do_depend_on_sample_count():
    # the contrast that makes the property above meaningful: seq-mean weighs a split rollout more
    spec = [(0, [(1, 3), (1, 3), (1, 3)]), (0, [(1, 3)])]
    shares = {}
    for merged in (True, False):
        layout = build_layout(spec, merged=merged)
        weights = token_weights(layout.mask, layout.rollout_index, "seq-mean-token-mean")
        shares[merged] = float(weights[layout.rollout_index == 0].sum())
    assert shares[True] == pytest.approx(0.5) and shares[False] == pytest.approx(0.75)


@settings(max_examples=50, deadline=None)
@given(
    spec=rollouts,
    seed=st.integers(0, 2**16),
    merged=st.booleans(),
    mode=st.sampled_from(ROLLOUT_MODES),
    shuffle_seed=st.integers(0, 2**16),
)
def test_permuting_samples_and_rollouts_changes_nothing(spec, seed, merged, mode, shuffle_seed):
    values, config = token_values(spec, seed), config_for(mode, "grpo")
    generator = torch.Generator().manual_seed(shuffle_seed)
    loss, grad, egrad, _, _ = batch_loss(spec, build_layout(spec, merged), values, config)
    shuffled = build_layout(
        spec, merged, sample_order=lambda n: torch.randperm(n, generator=generator).tolist()
    )
    rollout_perm = torch.randperm(len(spec), generator=generator)
    loss_p, grad_p, egrad_p, _, _ = batch_loss(spec, shuffled, values, config, rollout_perm=rollout_perm)
    torch.testing.assert_close(loss, loss_p, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, grad_p, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(egrad, egrad_p, atol=1e-7, rtol=1e-5)


@settings(max_examples=50, deadline=None)
@given(
    spec=rollouts,
    seed=st.integers(0, 2**16),
    merged=st.booleans(),
    mode=st.sampled_from(ROLLOUT_MODES + ["token-mean", "seq-mean-token-mean"]),
    cuts=st.integers(1, 4),
)
def test_micro_batches_sum_to_the_batch_loss(spec, seed, merged, mode, cuts):
    """Global weights make gradient accumulation exact: the sum of per-micro-batch objectives is the loss."""
    values, config = token_values(spec, seed), config_for(mode, "rloo")
    layout = build_layout(spec, merged)
    new, old, ref, entropy, rewards = values
    mask = layout.mask
    advantages = compute_rollout_advantages(rewards, torch.tensor([t for t, _ in spec]), "rloo")
    weights = token_weights(mask, layout.rollout_index, mode, 8.0)
    full = {
        "log_prob": layout.place(new),
        "old_log_prob": layout.place(old),
        "ref_log_prob": layout.place(ref),
        "entropy": layout.place(entropy),
        "weights": weights,
        "advantages": broadcast_to_tokens(advantages.values, layout.rollout_index, mask),
    }
    whole = rl_objective(config, **full).loss
    rows = torch.arange(layout.shape[0])
    parts = sum(
        rl_objective(config, **{k: v[chunk] for k, v in full.items()}).loss
        for chunk in torch.tensor_split(rows, min(cuts, len(rows)))
    )
    torch.testing.assert_close(parts, whole, atol=1e-6, rtol=1e-5)
