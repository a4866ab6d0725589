"""The metrics of one training step, named the same whichever backend trained it.

No reward/*: the loop reports those, over every trained rollout (one rollout may have no samples)."""

from __future__ import annotations

from agl_trainer.algorithms.token_age import importance_metrics
from agl_trainer.backends.agreement import agreement_metrics
from agl_trainer.backends.step_plan import StepPlan


def step_metrics(
    step: int,
    policy_version: int,
    skipped_steps: int,
    plan: StepPlan,
    sums: dict[str, float],
    maxima: dict[str, float],
    grad_norms: list[float],
    lr: float,
    elapsed: float,
) -> dict[str, float]:
    """`sums` and `maxima` add up the micro-batches' statistics (tokens, losses, clip counts, importance
    weights, micro_batches, real_positions and padded_positions); losses are averaged over the
    optimizer steps (each a mean over its own rollouts) and token statistics over the trained tokens.
    `policy_version` is the one the step produced, `step` the optimizer steps taken so far."""
    advantages = plan.advantages
    real_positions, padded_positions = sums["real_positions"], sums["padded_positions"]
    trained_adv = advantages.values[advantages.trained]
    updates = max(len(grad_norms), 1)
    tokens = max(sums["tokens"], 1.0)
    out = {
        "step": float(step),
        "policy_version": float(policy_version),
        "advantage/mean": float(trained_adv.mean()) if trained_adv.numel() else 0.0,
        "advantage/std": float(trained_adv.std()) if trained_adv.numel() > 1 else 0.0,
        "advantage/min": float(trained_adv.min()) if trained_adv.numel() else 0.0,
        "advantage/max": float(trained_adv.max()) if trained_adv.numel() else 0.0,
        "advantage/small_groups": float(advantages.num_small_groups),
        "advantage/small_group_rollouts": float(advantages.num_small_group_rollouts),
        "advantage/flat_groups": float(advantages.num_flat_groups),
        "advantage/groups": float(advantages.num_groups),
        "loss/total": sums["loss"] / updates,
        "loss/pg": sums["pg_loss"] / updates,
        "actor/clip_frac": sums["clipped"] / tokens,
        "actor/dual_clip_frac": sums["dual_clipped"] / tokens,
        "actor/approx_kl": sums["approx_kl_k3"] / tokens,
        "actor/approx_kl_k1": sums["approx_kl_k1"] / tokens,
        "actor/ratio_max": maxima["ratio_max"],
        "actor/entropy": sums["entropy"] / tokens,
        "actor/grad_norm": sum(grad_norms) / updates,
        "actor/grad_norm_max": max(grad_norms, default=0.0),
        "actor/lr": float(lr),
        "actor/skipped_steps": float(skipped_steps),
        "actor/zero_signal_updates": sums["zero_signal_updates"],  # this step's, left unapplied (no gradient)
        "perf/step_s": elapsed,
        "perf/tokens": float(real_positions),
        "perf/trained_tokens": float(plan.loss_mask.sum()),
        "perf/tokens_per_s": real_positions / elapsed if elapsed > 0 else 0.0,
        "perf/padding_frac": padded_positions / max(real_positions + padded_positions, 1.0),
        "perf/micro_batches": float(sums["micro_batches"]),
        "perf/optimizer_steps": float(len(grad_norms)),
    }
    out.update(importance_metrics(sums, maxima))
    out.update(plan.staleness)  # staleness/*: the tokens in the loss by lag (algorithms/token_age.py)
    out.update(agreement_metrics(sums, maxima))
    if "agreement_s" in sums:  # what measuring agreement cost this step (backends/agreement.py)
        out["perf/agreement_s"] = sums["agreement_s"]
    out.update(plan.missing.counts)
    if "ref_kl" in sums:
        out["actor/ref_kl"] = sums["ref_kl"] / tokens
        out["loss/kl"] = sums["kl_loss"] / updates
    if "entropy_loss" in sums:
        out["loss/entropy"] = sums["entropy_loss"] / updates
    return out
