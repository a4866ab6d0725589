"""The RL objective on one micro-batch: policy loss (with importance weights), KL to a reference,
entropy bonus, aggregated with precomputed global token weights. Pure: tensors in, tensors out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agl_trainer.algorithms.aggregation import aggregate
from agl_trainer.algorithms.config import AlgorithmConfig
from agl_trainer.algorithms.kl import KL_ESTIMATORS
from agl_trainer.algorithms.policy_loss import POLICY_LOSSES


@dataclass(frozen=True)
class ObjectiveOutput:
    loss: torch.Tensor  # scalar, differentiable: this micro-batch's share of the batch loss
    sums: dict[str, torch.Tensor]  # detached sums over trained tokens, added up across micro-batches


def rl_objective(
    config: AlgorithmConfig,
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    importance_weights: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """All tensors share a shape (any, e.g. [N, L] or packed [T]); `weights` is zero off the loss."""
    trained = weights != 0
    terms = POLICY_LOSSES.get(config.policy_loss)(log_prob, old_log_prob, advantages, config.clip)
    token_loss = terms.loss if importance_weights is None else terms.loss * importance_weights
    pg_loss = aggregate(token_loss, weights)
    loss = pg_loss
    mask = trained.float()
    zero = torch.zeros((), device=log_prob.device)
    sums = {
        "tokens": mask.sum(),
        "clipped": (terms.clipped & trained).float().sum(),
        "dual_clipped": (terms.dual_clipped & trained).float().sum(),
        # KL(old || new), estimated on tokens sampled from old: k1 = log(old/new), k3 = r - 1 - log r (r = new/old)
        "approx_kl_k1": torch.where(trained, old_log_prob - log_prob.detach(), zero).sum(),
        "approx_kl_k3": torch.where(
            trained, KL_ESTIMATORS.get("k3")(old_log_prob, log_prob.detach()), zero
        ).sum(),
        "ratio_max": torch.where(trained, terms.ratio, zero).max() if trained.any() else zero,
        "pg_loss": pg_loss.detach(),
    }
    if ref_log_prob is not None:
        kl = KL_ESTIMATORS.get(config.kl_estimator)(log_prob, ref_log_prob)
        kl_loss = aggregate(kl, weights)
        loss = loss + config.kl_coef * kl_loss
        sums["ref_kl"] = torch.where(trained, kl.detach(), zero).sum()
        sums["kl_loss"] = kl_loss.detach()
    if entropy is not None:
        sums["entropy"] = torch.where(trained, entropy.detach(), zero).sum()
        if config.entropy_coef > 0:
            entropy_term = aggregate(entropy, weights)
            loss = loss - config.entropy_coef * entropy_term
            sums["entropy_loss"] = entropy_term.detach()
    return ObjectiveOutput(loss=loss, sums=sums)
