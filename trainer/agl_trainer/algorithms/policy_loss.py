"""Per-token policy-gradient losses, selected by name. Each returns the unaggregated loss [N, L]
plus boolean maps for metrics; aggregation (algorithms.aggregation) turns it into a scalar."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agl_trainer.algorithms.registry import Registry


@dataclass(frozen=True)
class ClipConfig:
    """PPO clip range [1 - low, 1 + high] (asymmetric when low != high: DAPO's clip-higher) and the
    dual-clip bound c (> 1) capping the loss of negative-advantage tokens; None disables dual clip."""

    low: float = 0.2
    high: float = 0.2
    dual_clip_c: float | None = 3.0


@dataclass(frozen=True)
class PolicyLossTerms:
    loss: torch.Tensor  # [N, L] per-token loss, before aggregation
    ratio: torch.Tensor  # [N, L] pi / pi_old (detached)
    clipped: torch.Tensor  # [N, L] bool: the clipped branch was taken (no gradient through ratio)
    dual_clipped: torch.Tensor  # [N, L] bool: the dual-clip bound was taken (negative advantages)


PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ClipConfig], PolicyLossTerms]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")


@POLICY_LOSSES.register("ppo")
def ppo_clip_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip: ClipConfig
) -> PolicyLossTerms:
    """max(-A r, -A clip(r, 1-low, 1+high)), and for A < 0 at most -A c (dual clip)."""
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if clip.dual_clip_c is not None:
        bound = -advantages * clip.dual_clip_c
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return PolicyLossTerms(
        loss=loss, ratio=ratio.detach(), clipped=clipped > unclipped, dual_clipped=dual_clipped
    )


@POLICY_LOSSES.register("reinforce")
def reinforce_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip: ClipConfig
) -> PolicyLossTerms:
    """-A log pi: the plain policy gradient (no ratio, no clipping); importance weights still apply."""
    ratio = (log_prob - old_log_prob).detach().clamp(-20.0, 20.0).exp()
    never = torch.zeros_like(log_prob, dtype=torch.bool)
    return PolicyLossTerms(loss=-advantages * log_prob, ratio=ratio, clipped=never, dual_clipped=never)
