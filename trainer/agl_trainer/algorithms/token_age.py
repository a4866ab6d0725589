"""How old a trained token may be, what it weighs, and how it is counted: the one home of the rule.

A token's age (its lag) is the policy version being trained minus the version that sampled it (-1:
unknown). Everything that depends on it lives here, as pure functions (verl's rollout_corr_helper is
the model), for both rollout sources (live and --from-store) and both backends:

- bound: `loop.staleness` (one knob; -1: no bound; unset: 1 for live rollouts, no bound for a store's,
  whose weights move on from the version that collected them). A token older than
  `current - bound`, or of unknown age, never trains (`too_old`, numpy, on the loop's side); a
  store's rollout whose oldest call is past the bound is dropped whole (`rollout_too_old`).
- weight: a stale token was sampled by older weights, so its loss is reweighted by the ratio
  r = exp(old - engine) of the trainer's pre-update logprob to the engine's (`importance_weights`):
  `truncate` (TIS) gives min(r, cap); `ratio_mask` (in the spirit of IcePop/M2PO) gives r where
  floor <= r <= cap and takes the token out of the gradient (weight 0) otherwise, so a token the
  policies disagree on much is not trained at all rather than trained at the cap.
- agreement buckets: where a gap between the engine's and the trainer's logprob is an error (lag0),
  staleness (stale) or expected from the KV the token was sampled over (keep_kv: after a drain-free
  switch whose frozen prefix kept the old weights' KV; with switch_kv: recompute it did not, and
  the token is bucketed by its lag like any other).
- metrics: `staleness/*` (tokens in the loss by lag) and `importance/*` (weighted, capped, masked),
  counts that add up to the tokens in the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

ImportanceScope = Literal["stale", "all", "off"]
IMPORTANCE_SCOPES: tuple[str, ...] = ("stale", "all", "off")
ImportanceRule = Literal["truncate", "ratio_mask"]
IMPORTANCE_RULES: tuple[str, ...] = ("truncate", "ratio_mask")
BUCKETS = ("lag0", "stale", "keep_kv")
LIVE_STALENESS = 1  # loop.staleness unset, live rollouts: train calls at most one version old
LAG_BUCKETS = 4  # staleness/tokens_lag{0..3}; older ones add up in staleness/tokens_lag4plus


# --- the bound ---------------------------------------------------------------------------------


def staleness_bound(staleness: int | None, *, live: bool) -> int:
    """loop.staleness as a number of versions (-1: no bound); unset: 1 live, no bound from a store."""
    if staleness is None:
        return LIVE_STALENESS if live else -1
    if staleness < -1:
        raise ValueError(f"loop.staleness {staleness}: use a number of versions >= 0, or -1 for no bound")
    return staleness


def too_old(versions: np.ndarray, loss_mask: np.ndarray, current: int, bound: int) -> np.ndarray:
    """Per token, True where a trained token may not train: sampled more than `bound` versions
    before `current`, or by an unknown version (its age cannot be bounded). `bound` -1: none is."""
    trained = np.asarray(loss_mask) > 0
    if bound < 0:
        return np.zeros(trained.shape, bool)
    return trained & (np.asarray(versions) < current - bound)


def rollout_too_old(oldest_version: int, current: int, bound: int) -> bool:
    """A stored rollout whose oldest call lags more than `bound` versions behind `current`."""
    return bound >= 0 and current - oldest_version > bound


# --- the weight --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportanceWeights:
    weights: torch.Tensor  # detached; 1 where no correction applies, 0 where the ratio mask drops a token
    applied: torch.Tensor  # bool: trained tokens that got a correction
    capped: torch.Tensor  # bool: corrected tokens whose ratio exceeded the cap (truncated, or masked)
    masked: torch.Tensor  # bool: corrected tokens the ratio mask took out (ratio outside [floor, cap])


def importance_weights(
    old_log_prob: torch.Tensor,
    engine_log_prob: torch.Tensor,
    loss_mask: torch.Tensor,
    policy_versions: torch.Tensor,
    current_version: int,
    *,
    cap: float = 2.0,
    scope: ImportanceScope = "stale",
    rule: ImportanceRule = "truncate",
    floor: float = 0.5,
) -> ImportanceWeights:
    """Per token, the weight of its loss: r = exp(old - engine) for the tokens `scope` corrects
    (stale: sampled by an older known version; all: every trained token, which also absorbs
    engine/trainer numerics; off: none), truncated at `cap` or, with `ratio_mask`, kept only
    inside [floor, cap]."""
    if cap <= 0:
        raise ValueError(f"importance-weight cap {cap} must be positive")
    if scope not in IMPORTANCE_SCOPES:
        raise ValueError(f"importance scope {scope!r}: choose one of {IMPORTANCE_SCOPES}")
    if rule not in IMPORTANCE_RULES:
        raise ValueError(f"importance rule {rule!r}: choose one of {IMPORTANCE_RULES}")
    if rule == "ratio_mask" and not 0 <= floor < cap:
        raise ValueError(f"importance floor {floor} must be in [0, cap={cap})")
    trained = loss_mask > 0
    if scope == "off":
        applied = torch.zeros_like(trained)
    elif scope == "all":
        applied = trained
    else:
        applied = trained & (policy_versions >= 0) & (policy_versions < current_version)
    raw = (old_log_prob.detach() - engine_log_prob).clamp(-20.0, 20.0).exp()
    capped = applied & (raw > cap)
    if rule == "truncate":
        masked = torch.zeros_like(applied)
        corrected = raw.clamp(max=cap)
    else:
        masked = applied & ((raw > cap) | (raw < floor))
        corrected = torch.where(masked, torch.zeros_like(raw), raw)
    weights = torch.where(applied, corrected, torch.ones_like(raw))
    return ImportanceWeights(weights=weights, applied=applied, capped=capped, masked=masked)


def importance_sums(iw: ImportanceWeights) -> tuple[dict[str, float], dict[str, float]]:
    """A micro-batch's importance statistics, summed (and maxed: keys ending _max) over the step."""
    kept = iw.applied & ~iw.masked
    weighted = torch.where(kept, iw.weights, torch.zeros_like(iw.weights))
    sums = {
        "is_applied": float(iw.applied.sum()),
        "is_capped": float(iw.capped.sum()),
        "is_masked": float(iw.masked.sum()),
        "is_weight_sum": float(weighted.sum()),
    }
    maxima = {"is_weight_max": float(weighted.max())} if bool(kept.any()) else {}
    return sums, maxima


def importance_metrics(sums: dict[str, float], maxima: dict[str, float]) -> dict[str, float]:
    """importance/*: counts of the kept tokens (sums["tokens"]) corrected, capped and ratio-masked;
    the mean and max weight over those corrected and kept."""
    tokens = max(sums.get("tokens", 0.0), 1.0)
    applied, masked = sums.get("is_applied", 0.0), sums.get("is_masked", 0.0)
    weighted = applied - masked
    return {
        "importance/applied_tokens": applied,
        "importance/capped_tokens": sums.get("is_capped", 0.0),
        "importance/ratio_masked_tokens": masked,
        "importance/stale_token_frac": applied / tokens,
        "importance/mean": sums.get("is_weight_sum", 0.0) / weighted if weighted else 1.0,
        "importance/max": maxima.get("is_weight_max", 1.0) if weighted else 1.0,
        "importance/capped_frac": sums.get("is_capped", 0.0) / applied if applied else 0.0,
        "importance/ratio_masked_frac": masked / applied if applied else 0.0,
    }


# --- the agreement buckets ---------------------------------------------------------------------


def agreement_buckets(
    known: torch.Tensor, versions: torch.Tensor, switched: torch.Tensor, current_version: int
) -> dict[str, torch.Tensor]:
    """Per token, the bucket its engine/trainer gap belongs to (tokens with a known logprob and
    version only): lag0 (must agree), stale (older weights), keep_kv (over the old weights' KV)."""
    versioned = known.bool() & (versions >= 0)
    switched = switched.bool()
    return {
        "lag0": versioned & (versions == current_version) & ~switched,
        "stale": versioned & (versions < current_version) & ~switched,
        "keep_kv": versioned & switched,
    }


# --- the step's staleness ----------------------------------------------------------------------


def staleness_metrics(loss_mask: torch.Tensor, versions: torch.Tensor, current_version: int) -> dict[str, float]:
    """staleness/* of the tokens in the loss: lag max and mean (over known versions), the stale share,
    and counts by lag (tokens_lag0.., tokens_lag{LAG_BUCKETS}plus, tokens_unknown) that add up to
    staleness/tokens."""
    trained = loss_mask > 0
    chosen = versions[trained]
    total = int(chosen.numel())
    if total == 0:
        return {}
    known = chosen >= 0
    lag = (current_version - chosen[known]).long()
    counts = torch.bincount(lag.clamp(0, LAG_BUCKETS), minlength=LAG_BUCKETS + 1).tolist() if lag.numel() else [0] * (
        LAG_BUCKETS + 1
    )
    out = {
        "staleness/tokens": float(total),
        "staleness/tokens_unknown": float(total - int(known.sum())),
        "staleness/max": float(lag.max()) if lag.numel() else 0.0,
        "staleness/mean": float(lag.float().mean()) if lag.numel() else 0.0,
        "staleness/stale_token_fraction": float((lag > 0).sum()) / total,
    }
    for k in range(LAG_BUCKETS):
        out[f"staleness/tokens_lag{k}"] = float(counts[k])
    out[f"staleness/tokens_lag{LAG_BUCKETS}plus"] = float(counts[LAG_BUCKETS])
    return out
