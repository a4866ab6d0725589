"""Per-token KL estimators between the policy and a reference (http://joschu.net/blog/kl-approx.html)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from agl_trainer.algorithms.registry import Registry

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (log_prob, ref_log_prob) -> [N, L]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """log p - log q: unbiased for KL(p||q), high variance, can be negative."""
    return log_prob - ref_log_prob


@KL_ESTIMATORS.register("k2")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """(log p - log q)^2 / 2: biased, low variance, its gradient is the KL's."""
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """q/p - 1 - log(q/p): unbiased, non-negative, low variance. The log-ratio is clamped to
    [-20, 20] and the value to [-10, 10] because exp() of a large ratio overflows (verl does the same)."""
    log_ratio = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)
