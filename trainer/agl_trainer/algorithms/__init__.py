"""RL algorithms as pure functions over tensors, selected by name from registries.

- advantages: per-rollout estimators (`grpo`, `dr_grpo`, `rloo`) grouped by task, broadcast to tokens
- aggregation: per-token weights for `rollout-mean` (default) and verl's modes; exact under any
  micro-batch split because the weights are computed once over the whole batch
- policy_loss: `ppo` (asymmetric clip, dual clip) and `reinforce`
- kl: `k1`, `k2`, `k3` estimators
- token_age: how old a trained token may be, its importance weight (truncated, or a ratio mask),
  the agreement buckets and the staleness metrics
- objective: the composition the backends call per micro-batch
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agl_trainer.algorithms.advantages import (
        ADVANTAGE_ESTIMATORS,
        RolloutAdvantages,
        broadcast_to_tokens,
        compute_rollout_advantages,
    )
    from agl_trainer.algorithms.aggregation import LOSS_AGGREGATIONS, agg_loss, aggregate, token_weights
    from agl_trainer.algorithms.config import AlgorithmConfig, AlgorithmConfigError
    from agl_trainer.algorithms.kl import KL_ESTIMATORS
    from agl_trainer.algorithms.logits import token_entropy, token_logprobs
    from agl_trainer.algorithms.objective import ObjectiveOutput, rl_objective
    from agl_trainer.algorithms.policy_loss import POLICY_LOSSES, ClipConfig, PolicyLossTerms
    from agl_trainer.algorithms.token_age import ImportanceWeights, importance_weights

# Each name's module, imported on first use: `agl_trainer.algorithms.settings` (the config's
# `backend.algorithm` section) is read with the config, which imports no torch.
_MODULES = {
    "advantages": ("ADVANTAGE_ESTIMATORS", "RolloutAdvantages", "broadcast_to_tokens", "compute_rollout_advantages"),
    "aggregation": ("LOSS_AGGREGATIONS", "agg_loss", "aggregate", "token_weights"),
    "config": ("AlgorithmConfig", "AlgorithmConfigError"),
    "kl": ("KL_ESTIMATORS",),
    "logits": ("token_entropy", "token_logprobs"),
    "objective": ("ObjectiveOutput", "rl_objective"),
    "policy_loss": ("POLICY_LOSSES", "ClipConfig", "PolicyLossTerms"),
    "token_age": ("ImportanceWeights", "importance_weights"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "AlgorithmConfig",
    "AlgorithmConfigError",
    "ClipConfig",
    "ImportanceWeights",
    "ObjectiveOutput",
    "PolicyLossTerms",
    "RolloutAdvantages",
    "agg_loss",
    "aggregate",
    "broadcast_to_tokens",
    "compute_rollout_advantages",
    "importance_weights",
    "rl_objective",
    "token_entropy",
    "token_logprobs",
    "token_weights",
]
