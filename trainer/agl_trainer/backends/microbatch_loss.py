"""The loss of one micro-batch, the same for both backends.

A backend runs its own forward (the torch backend on packed rows, verl's worker inside its FSDP
engine) and gathers the kept tokens' per-token inputs; from there the math is this one function:
unknown engine logprobs re-scored (`resolve_logprobs`), engine/trainer agreement measured, importance
weights and their statistics (algorithms/token_age.py), then `rl_objective`. The caller runs backward (verl's worker
scales the loss by its data-parallel size first) and adds the statistics to its step's sums.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from agl_trainer.algorithms import AlgorithmConfig, importance_weights, rl_objective
from agl_trainer.algorithms.token_age import importance_sums
from agl_trainer.backends.agreement import agreement_stats, resolve_logprobs


@dataclass(frozen=True)
class KeptTokens:
    """A micro-batch's kept tokens (weight != 0), 1-D, on the loss's device."""

    weights: torch.Tensor  # the global per-token loss weights
    advantages: torch.Tensor
    engine_logprobs: torch.Tensor  # the engine's (any value where unknown)
    known: torch.Tensor  # where the engine's logprob is usable (bool or 0/1)
    versions: torch.Tensor  # the policy version that sampled each token (-1: unknown)
    switched: torch.Tensor  # sampled after a keep switch (bool or 0/1)
    old_logprobs: torch.Tensor | None = None  # PPO's old log-probs, when computed before the update
    before_logprobs: torch.Tensor | None = None  # pre-update log-probs, when neither `old` nor the forward gives them
    ref_logprobs: torch.Tensor | None = None  # the reference model's, for the KL penalty


@dataclass(frozen=True)
class MicroBatchLoss:
    loss: torch.Tensor  # to backward
    sums: dict[str, float]  # statistics summed over the step's micro-batches
    maxima: dict[str, float]  # statistics maxed over them (keys end with _max)
    before: torch.Tensor  # the trainer's pre-update log-probs of the kept tokens


def micro_batch_loss(
    algo: AlgorithmConfig,
    log_prob: torch.Tensor,
    entropy: torch.Tensor | None,
    tokens: KeptTokens,
    current_version: int,
    own_log_prob: torch.Tensor | None = None,
) -> MicroBatchLoss:
    """`log_prob` (with its graph) and `entropy` of the kept tokens from this forward, at the loss's
    temperature (algo.temperature); `current_version` the policy version being trained (the loop's).
    At a temperature other than 1, the tokens' `old_logprobs` (PPO's) are at the loss's temperature and
    their `before_logprobs` at 1, and `own_log_prob` is this forward's log-prob at temperature 1 (the
    model's own, as the engine reports it; needed only where no `before_logprobs` came): agreement,
    re-scoring and importance weights compare the model's own log-probs with the engine's; the policy
    ratio, the KL and the entropy are at T."""
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    measuring = time.perf_counter()
    if algo.temperature == 1.0:
        own, old_own, ppo_old = log_prob.detach(), tokens.old_logprobs, None
    else:
        old_own = tokens.before_logprobs  # from a pre-update pass (several updates), else this forward's
        if old_own is None and own_log_prob is None:
            raise ValueError(f"the loss trains at temperature {algo.temperature}: pass own_log_prob")
        own = old_own if own_log_prob is None else own_log_prob.detach()
        # PPO's old log-probs at T: the pre-update pass's, or (one update) this forward's
        ppo_old = tokens.old_logprobs if tokens.old_logprobs is not None else log_prob.detach()
    old, engine, before = resolve_logprobs(
        own,
        tokens.engine_logprobs,
        tokens.known.bool(),
        old=old_own,
        before=tokens.before_logprobs,
        bypass=algo.bypass_old_logprobs,
    )
    agree_sums, agree_maxima = agreement_stats(
        before, engine, tokens.known, tokens.versions, tokens.switched, current_version, algo.agreement_threshold
    )
    sums.update(agree_sums)
    maxima.update(agree_maxima)
    sums["agreement_s"] = time.perf_counter() - measuring
    importance = None
    if not algo.bypass_old_logprobs and algo.importance_scope != "off":
        iw = importance_weights(
            old,
            engine,
            tokens.weights,
            tokens.versions,
            current_version,
            cap=algo.importance_cap,
            scope=algo.importance_scope,  # type: ignore[arg-type]
            rule=algo.importance_rule,  # type: ignore[arg-type]
            floor=algo.importance_floor,
        )
        importance = iw.weights
        is_sums, is_maxima = importance_sums(iw)
        sums.update(is_sums)
        maxima.update(is_maxima)
    out = rl_objective(
        algo,
        log_prob=log_prob,
        old_log_prob=old if ppo_old is None else ppo_old,
        advantages=tokens.advantages,
        weights=tokens.weights,
        importance_weights=importance,
        ref_log_prob=tokens.ref_logprobs,
        entropy=entropy,
    )
    for key, value in out.sums.items():
        (maxima if key.endswith("_max") else sums)[key] = float(value)
    sums["loss"] = float(out.loss.detach())
    return MicroBatchLoss(loss=out.loss, sums=sums, maxima=maxima, before=before)
