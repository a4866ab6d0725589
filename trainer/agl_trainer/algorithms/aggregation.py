"""Loss aggregation: how per-token losses become one scalar, expressed as per-token weights.

Every mode is a weight tensor w [N, L] computed once over the whole (mini-)batch, and the loss is
sum(w * loss_mat). Because the weights are global, a micro-batch's contribution is just its slice
of that sum: gradient accumulation over any split into micro-batches is exact by construction.

Modes (B: rollouts with a trained token, T_r: rollout r's trained tokens over all its samples):
  rollout-mean (default)          (1/|B|) sum_r (1/T_r) sum_{t in r} l_t
  rollout-mean-token-sum-norm     (1/|B|) sum_r (1/C)   sum_{t in r} l_t   (Dr.GRPO: C constant)
  token-mean                      (1/sum_r T_r) sum_t l_t
  seq-mean-token-mean             mean over samples of each sample's token mean
  seq-mean-token-sum              mean over samples of each sample's token sum
  seq-mean-token-sum-norm         seq-mean-token-sum / C
The seq-* and token-mean modes match verl's agg_loss; they weigh a rollout by how many samples
or tokens it has, which is what the rollout modes exist to avoid.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from agl_trainer.algorithms.registry import Registry

# (loss_mask [N, L], rollout_index [N], constant) -> weights [N, L]
TokenWeightFn = Callable[[torch.Tensor, torch.Tensor, float | None], torch.Tensor]
LOSS_AGGREGATIONS: Registry[TokenWeightFn] = Registry("loss aggregation mode")
NEEDS_CONSTANT: frozenset[str] = frozenset({"rollout-mean-token-sum-norm", "seq-mean-token-sum-norm"})


def _rollout_token_counts(mask: torch.Tensor, rollout_index: torch.Tensor) -> torch.Tensor:
    """[N] trained tokens of the rollout each sample belongs to."""
    per_sample = mask.sum(dim=-1)
    num_rollouts = int(rollout_index.max()) + 1 if rollout_index.numel() else 0
    per_rollout = torch.zeros(num_rollouts, dtype=per_sample.dtype, device=mask.device)
    per_rollout.index_add_(0, rollout_index, per_sample)
    return per_rollout[rollout_index]


def _num_nonempty_rollouts(mask: torch.Tensor, rollout_index: torch.Tensor) -> int:
    return int(torch.unique(rollout_index[mask.sum(dim=-1) > 0]).numel())


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, 1.0 / x.clamp(min=1e-30), torch.zeros_like(x))


@LOSS_AGGREGATIONS.register("rollout-mean")
def rollout_mean_weights(mask: torch.Tensor, rollout_index: torch.Tensor, constant: float | None = None):
    count = _rollout_token_counts(mask, rollout_index)
    rollouts = max(_num_nonempty_rollouts(mask, rollout_index), 1)
    return mask * (_safe_reciprocal(count) / rollouts).unsqueeze(-1)


@LOSS_AGGREGATIONS.register("rollout-mean-token-sum-norm")
def rollout_constant_weights(mask: torch.Tensor, rollout_index: torch.Tensor, constant: float | None = None):
    rollouts = max(_num_nonempty_rollouts(mask, rollout_index), 1)
    return mask / (rollouts * _require_constant(constant, "rollout-mean-token-sum-norm"))


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean_weights(mask: torch.Tensor, rollout_index: torch.Tensor, constant: float | None = None):
    return mask / mask.sum().clamp(min=1)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean_weights(
    mask: torch.Tensor, rollout_index: torch.Tensor, constant: float | None = None
):
    per_sample = mask.sum(dim=-1)
    samples = (per_sample > 0).sum().clamp(min=1)
    return mask * (_safe_reciprocal(per_sample) / samples).unsqueeze(-1)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum_weights(
    mask: torch.Tensor, rollout_index: torch.Tensor, constant: float | None = None
):
    samples = (mask.sum(dim=-1) > 0).sum().clamp(min=1)
    return mask / samples


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm_weights(
    mask: torch.Tensor, rollout_index: torch.Tensor, constant: float | None = None
):
    return seq_mean_token_sum_weights(mask, rollout_index) / _require_constant(
        constant, "seq-mean-token-sum-norm"
    )


def _require_constant(constant: float | None, mode: str) -> float:
    if constant is None or constant <= 0:
        raise ValueError(
            f"loss aggregation {mode!r} needs a positive loss_norm_constant (e.g. the most tokens a "
            f"rollout may generate); got {constant!r}"
        )
    return float(constant)


def token_weights(
    loss_mask: torch.Tensor,
    rollout_index: torch.Tensor,
    mode: str = "rollout-mean",
    constant: float | None = None,
) -> torch.Tensor:
    """Per-token weights [N, L] of aggregation `mode`; zero wherever loss_mask is zero."""
    mask = loss_mask.to(torch.float32)
    if mask.ndim != 2 or rollout_index.shape != mask.shape[:1]:
        raise ValueError(
            f"loss_mask {tuple(mask.shape)} must be [N, L] and rollout_index {tuple(rollout_index.shape)} [N]"
        )
    return LOSS_AGGREGATIONS.get(mode)(mask, rollout_index, constant)


def aggregate(loss_mat: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(weights * loss_mat), ignoring whatever loss_mat holds where the weight is zero (NaN included)."""
    return torch.where(weights != 0, loss_mat * weights, torch.zeros_like(loss_mat)).sum()


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "rollout-mean",
    rollout_index: torch.Tensor | None = None,
    constant: float | None = None,
) -> torch.Tensor:
    """One-shot aggregation of a whole batch; without rollout_index every sample is its own rollout."""
    if rollout_index is None:
        rollout_index = torch.arange(loss_mat.shape[0], device=loss_mat.device)
    return aggregate(loss_mat, token_weights(loss_mask, rollout_index, mode, constant))
