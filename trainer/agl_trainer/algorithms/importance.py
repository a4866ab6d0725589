"""Truncated importance sampling for tokens the engine generated with older weights.

In asynchronous RL a rollout may have been served by policy version v < current. The PPO ratio is
taken against the trainer's old log-probs (current weights before this update); the token was
sampled from the engine's older policy, so it gets the weight min(exp(old - engine), cap) (TIS).
With `scope="all"` every token is corrected, which also absorbs engine/trainer numeric mismatch.
Bypass mode skips all of this: the engine's log-probs become the old log-probs, so the clipped PPO
ratio itself is the (bounded) correction and no extra forward pass is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

ImportanceScope = Literal["stale", "all", "off"]
IMPORTANCE_SCOPES: tuple[str, ...] = ("stale", "all", "off")


@dataclass(frozen=True)
class ImportanceWeights:
    weights: torch.Tensor  # [N, L] detached; 1 where no correction applies
    applied: torch.Tensor  # [N, L] bool: trained tokens that got a correction
    capped: torch.Tensor  # [N, L] bool: corrected tokens whose raw weight exceeded the cap


def truncated_importance_weights(
    old_log_prob: torch.Tensor,
    engine_log_prob: torch.Tensor,
    loss_mask: torch.Tensor,
    policy_versions: torch.Tensor,
    current_version: int,
    *,
    cap: float = 2.0,
    scope: ImportanceScope = "stale",
) -> ImportanceWeights:
    if cap <= 0:
        raise ValueError(f"importance-weight cap {cap} must be positive")
    if scope not in IMPORTANCE_SCOPES:
        raise ValueError(f"importance scope {scope!r}: choose one of {IMPORTANCE_SCOPES}")
    trained = loss_mask > 0
    if scope == "off":
        applied = torch.zeros_like(trained)
    elif scope == "all":
        applied = trained
    else:
        applied = trained & (policy_versions >= 0) & (policy_versions < current_version)
    log_ratio = (old_log_prob.detach() - engine_log_prob).clamp(-20.0, 20.0)
    raw = log_ratio.exp()
    weights = torch.where(applied, raw.clamp(max=cap), torch.ones_like(raw))
    return ImportanceWeights(weights=weights, applied=applied, capped=applied & (raw > cap))
