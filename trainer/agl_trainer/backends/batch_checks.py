"""Reject a batch the algorithms would silently mis-train on, with a message that names the problem."""

from __future__ import annotations

import torch

from agl_trainer.batch import TrainingBatch


def validate_batch(batch: TrainingBatch, vocab_size: int) -> torch.Tensor:
    """Reject a batch the algorithms would silently mis-train on; returns per-sample lengths."""
    n, width = batch.input_ids.shape
    for name in ("attention_mask", "position_ids", "loss_mask", "engine_logprobs", "policy_versions"):
        shape = tuple(getattr(batch, name).shape)
        if shape != (n, width):
            raise ValueError(f"TrainingBatch.{name} has shape {shape}, expected {(n, width)} like input_ids")
    if tuple(batch.rollout_index.shape) != (n,):
        raise ValueError(
            f"TrainingBatch.rollout_index has shape {tuple(batch.rollout_index.shape)}, expected ({n},)"
        )
    r = batch.num_rollouts
    if batch.rollout_rewards.shape != (r,) or batch.rollout_group_index.shape != (r,):
        raise ValueError(f"rollout_rewards and rollout_group_index must have one entry per rollout ({r})")
    if n and (int(batch.rollout_index.min()) < 0 or int(batch.rollout_index.max()) >= r):
        raise ValueError(f"rollout_index holds values outside [0, {r})")
    lengths = batch.attention_mask.sum(-1)
    positions = torch.arange(width).unsqueeze(0)
    if not torch.equal(batch.attention_mask.bool(), positions < lengths.unsqueeze(-1)):
        raise ValueError(
            "TrainingBatch must be right-padded: attention_mask must be ones then zeros in every row"
        )
    if bool((batch.loss_mask[:, :1] != 0).any()):
        raise ValueError(
            "loss_mask is 1 on a sample's first token, which nothing predicts; a sample must start "
            "with at least one prompt token"
        )
    if bool(((batch.loss_mask != 0) & ~batch.attention_mask.bool()).any()):
        raise ValueError("loss_mask is 1 on padding (attention_mask 0)")
    for name in ("logprob_known", "after_switch"):  # a NaN engine logprob is unknown (agreement.py)
        value = getattr(batch, name)
        if value is not None and tuple(value.shape) != (n, width):
            raise ValueError(f"TrainingBatch.{name} has shape {tuple(value.shape)}, expected {(n, width)}")
    real = batch.input_ids[batch.attention_mask.bool()]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab_size):
        raise ValueError(
            f"token ids outside the model's vocabulary [0, {vocab_size}): was the batch built with "
            "another model's tokenizer?"
        )
    return lengths
