"""Engine/trainer agreement, token by token, for both backends.

For a trained token, the engine's logprob (from its span) and the trainer's logprob under the
weights that sampled it must agree up to numerics. The trainer has those weights only for tokens of
the version being trained (lag 0): its old-logprob pass before the update is exactly them. So:

- lag0: tokens sampled by the current version, not after a keep switch. A gap here is an error
  (weights that did not land, a stale prefix cache, a dtype mismatch).
- stale: tokens of older versions (lag >= 1); the gap is staleness, what importance weights correct.
- keep_kv: tokens sampled after a drain-free switch in their call over the old weights' KV of their
  prefix (loop.switch: keep with switch_kv: keep), whatever their lag: expected to differ, never a
  failure. With switch_kv: recompute the prefix was recomputed by the new weights: such tokens are
  not marked (loop/live.py) and are bucketed by their lag. The buckets are algorithms/token_age.py's.

A token whose engine logprob is unknown (missing, NaN) is never weighed with a placeholder: at lag 0
it is re-scored (the trainer's pre-update logprob stands in for the engine's, so its importance
weight is 1), otherwise it leaves the loss. `plan_missing` decides, `resolve_logprobs` applies the
re-score inside a micro-batch, `agreement_stats` measures; `agreement_metrics` names the results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agl_trainer.algorithms.kl import kl_k3
from agl_trainer.algorithms.token_age import BUCKETS, agreement_buckets

PREFIX = "agree_"  # micro-batch statistic keys; a backend counts them in its first epoch only


@dataclass(frozen=True)
class MissingPlan:
    known: torch.Tensor  # [N, L] bool: the engine's logprob is usable
    excluded: torch.Tensor  # [N, L] bool: trained tokens whose unknown logprob takes them out of the loss
    counts: dict[str, float]  # agreement/logprobs_missing_tokens, _rescored, _excluded


def plan_missing(
    known: torch.Tensor, loss_mask: torch.Tensor, versions: torch.Tensor, current_version: int | None
) -> MissingPlan:
    """Trained tokens without an engine logprob: re-scored at lag 0, excluded otherwise (an unknown
    version, or older weights the trainer no longer has)."""
    trained = loss_mask > 0
    missing = trained & ~known
    lag0 = versions == current_version if current_version is not None else torch.zeros_like(missing)
    excluded = missing & ~lag0
    counts = {
        "agreement/logprobs_missing_tokens": float(missing.sum()),
        "agreement/logprobs_missing_rescored": float((missing & lag0).sum()),
        "agreement/logprobs_missing_excluded": float(excluded.sum()),
    }
    return MissingPlan(known=known, excluded=excluded, counts=counts)


def resolve_logprobs(
    current: torch.Tensor,
    engine: torch.Tensor,
    known: torch.Tensor,
    *,
    old: torch.Tensor | None = None,
    before: torch.Tensor | None = None,
    bypass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a micro-batch's kept tokens: (PPO's old logprobs, the engine's logprobs with unknown ones
    re-scored, the trainer's logprobs before the update). `current` is this forward's (detached);
    `old` the pre-update pass when computed up front; `before` the pre-update logprobs when neither
    `old` nor `current` is (bypass mode with several updates)."""
    if before is None:
        before = old if old is not None else current
    engine = torch.where(known, engine, before.to(engine.dtype))
    if bypass:
        old = engine
    elif old is None:
        old = current
    return old, engine, before


def agreement_stats(
    trainer: torch.Tensor,
    engine: torch.Tensor,
    known: torch.Tensor,
    versions: torch.Tensor,
    switched: torch.Tensor,
    current_version: int,
    threshold: float,
) -> tuple[dict[str, float], dict[str, float]]:
    """Sums and maxima (keys ending _max) of |trainer - engine| per bucket, over the kept tokens."""
    trainer, engine = trainer.detach().float(), engine.detach().float()
    versions = versions.to(trainer.device)
    known, switched = known.to(trainer.device).bool(), switched.to(trainer.device).bool()
    buckets = agreement_buckets(known, versions, switched, current_version)
    delta = (trainer - engine).abs()
    k3 = kl_k3(engine.double(), trainer.double())  # samples from the engine: KL(engine || trainer); float64:
    # exp(r) - r - 1 of a float32 r near 0 rounds below 0
    sums: dict[str, float] = {}
    maxima: dict[str, float] = {}
    for name, where in buckets.items():
        if not bool(where.any()):
            continue
        d = delta[where]
        sums[f"{PREFIX}{name}_tokens"] = float(where.sum())
        sums[f"{PREFIX}{name}_abs"] = float(d.sum())
        sums[f"{PREFIX}{name}_k3"] = float(k3[where].sum())
        sums[f"{PREFIX}{name}_over"] = float((d > threshold).sum())
        maxima[f"{PREFIX}{name}_max"] = float(d.max())
    return sums, maxima


def agreement_metrics(sums: dict[str, float], maxima: dict[str, float]) -> dict[str, float]:
    """agreement/<bucket>/{tokens, mean_abs_delta, k3, max_abs_delta, frac_over} from the step's sums."""
    out: dict[str, float] = {}
    for name in BUCKETS:
        tokens = sums.get(f"{PREFIX}{name}_tokens", 0.0)
        if tokens <= 0:
            continue
        out[f"agreement/{name}/tokens"] = tokens
        out[f"agreement/{name}/mean_abs_delta"] = sums[f"{PREFIX}{name}_abs"] / tokens
        out[f"agreement/{name}/k3"] = sums[f"{PREFIX}{name}_k3"] / tokens
        out[f"agreement/{name}/max_abs_delta"] = maxima.get(f"{PREFIX}{name}_max", 0.0)
        out[f"agreement/{name}/frac_over"] = sums[f"{PREFIX}{name}_over"] / tokens
    return out
