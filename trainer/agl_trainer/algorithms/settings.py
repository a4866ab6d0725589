"""`agl train`'s `backend.algorithm` section: every algorithm setting with its default and meaning,
torch-free (reading a config imports no torch). `AlgorithmConfig` (config.py) is these settings
with their checks, which need the estimators' and losses' registries; the backends take it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec


def _doc(text: str) -> Any:
    return msgspec.Meta(description=text)


class AlgorithmSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Types are checked as a config is read; values by `AlgorithmConfig`, where the backend is built."""

    # Advantages (per rollout, grouped by task)
    advantage_estimator: Annotated[str, _doc("advantages per rollout, grouped by task: grpo, dr_grpo or rloo")] = "grpo"
    advantage_unit: Annotated[
        str,
        _doc("rollout: an advantage and weight per rollout; sample: per sample (call), as Agent Lightning"),
    ] = "rollout"
    min_group_size: Annotated[int, _doc("a smaller group has no baseline (2 or more)")] = 2
    small_group_policy: Annotated[
        str, _doc("a group smaller than min_group_size: advantage 0 (zero) or out of the loss (drop)")
    ] = "zero"
    advantage_epsilon: Annotated[float, _doc("added to the group's reward std before dividing by it")] = 1e-6
    # Loss
    policy_loss: Annotated[str, _doc("ppo or reinforce")] = "ppo"
    loss_agg_mode: Annotated[
        str, _doc("how token losses are summed: rollout-mean (each rollout weighs the same) or verl's modes")
    ] = "rollout-mean"
    loss_norm_constant: Annotated[
        float | None, _doc("C of the *-token-sum-norm modes (e.g. the most tokens a rollout may generate)")
    ] = None
    clip_ratio_low: Annotated[float, _doc("PPO's clip below 1 (0.2 is usual)")] = 0.2
    clip_ratio_high: Annotated[float, _doc("PPO's clip above 1 (0.2 is usual)")] = 0.2
    dual_clip_c: Annotated[float | None, _doc("dual clip of negative advantages (> 1; null: off)")] = 3.0
    kl_coef: Annotated[
        float, _doc("> 0 keeps a frozen reference model (with LoRA: the base) and adds coef * KL to the loss")
    ] = 0.0
    kl_estimator: Annotated[str, _doc("k1, k2 or k3")] = "k3"
    entropy_coef: Annotated[float, _doc("> 0 adds a bonus -coef * entropy; entropy is always measured")] = 0.0
    # The loss trains softmax(logits / T). Rollouts sampled at temperature T come from that distribution,
    # not the model's own (T = 1): training the model's own on them is off-policy with no correction, and
    # the tail the sampler rarely draws is never pushed down (swe-lite seed 2 sampled at 0.6: the entropy at
    # T = 1 went 0.25 -> 2.40 in its last 3 steps). null: sampling.train.temperature, as verl's actor does
    # (1.0 where training samples greedily). The engine's logprobs are the model's own, so agreement and
    # importance weights compare at T = 1; the policy loss, the KL to the reference and the entropy at T.
    loss_temperature: Annotated[
        float | None,
        _doc("the loss trains softmax(logits / T); null: sampling.train.temperature (1.0 where it is 0)"),
    ] = None
    # A mini-batch whose every trained token has advantage 0 (every group tied) and no KL or entropy
    # term has a gradient of exactly 0; AdamW would still move the weights by its momentum and weight
    # decay, carrying the policy on with no signal. True: such an update leaves the weights and the
    # optimizer's state as they are (the step still counts); false: step anyway.
    skip_zero_signal_updates: Annotated[
        bool, _doc("a mini-batch with no signal (every group tied, no KL or entropy term) leaves the weights alone")
    ] = True
    # Off-policy correction
    importance_cap: Annotated[float, _doc("truncated importance weights are capped at this value")] = 2.0
    importance_scope: Annotated[str, _doc("importance weights for stale tokens, all tokens, or off")] = "stale"
    # truncate: min(r, cap) (TIS); ratio_mask: r inside [importance_floor, importance_cap], else the
    # token leaves the gradient (in the spirit of IcePop/M2PO; algorithms/token_age.py)
    importance_rule: Annotated[
        str, _doc("truncate: weight min(r, cap); ratio_mask: a token whose r is outside [floor, cap] leaves the loss")
    ] = "truncate"
    importance_floor: Annotated[float, _doc("ratio_mask's lower bound on the importance ratio (0.5 is usual)")] = 0.5
    bypass_old_logprobs: Annotated[bool, _doc("use the engine's log-probs as the PPO old log-probs")] = False
    # Engine/trainer agreement (backends/agreement.py): agreement/*/frac_over counts |delta| above this
    agreement_threshold: Annotated[
        float, _doc("agreement/*/frac_over counts engine/trainer |logprob delta| above this many nats")
    ] = 0.1
