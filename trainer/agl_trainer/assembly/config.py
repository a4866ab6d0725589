"""How spans become samples: reward name, policies for missing rewards and failed rollouts, limits."""

from __future__ import annotations

from typing import Annotated

import msgspec
from agl import semconv

from agl_trainer.store.records import CAUSES

KEEP = "keep"
DROP = "drop"
# A policy is "keep" (train with the rollout's reward), "drop", or a number (train with this reward).
Policy = str | float

DEFAULT_CAUSE_POLICY: dict[str, Policy] = {
    "ok": KEEP,
    "harness_error": KEEP,  # the agent's own failure: train on it (its reward, or the missing-reward policy)
    "timeout": KEEP,
    "infra_error": DROP,  # not the agent's fault: never train on it
    "cancelled": DROP,
}


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class AssemblyConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The `assembly` section of `agl train`'s config (descriptions: `agl train --help`)."""

    reward_name: Annotated[str, _doc("the reward (agl.reward.name) to train on")] = semconv.DEFAULT_REWARD_NAME
    missing_reward: Annotated[
        Policy, _doc("a rollout without that reward: 'drop', or the reward to train it with")
    ] = DROP
    cause_policy: Annotated[
        dict[str, Policy],
        _doc("per end cause (ok, harness_error, timeout, infra_error, cancelled): 'keep', 'drop' or a reward"),
    ] = msgspec.field(default_factory=lambda: dict(DEFAULT_CAUSE_POLICY))
    # Agent Lightning trains every model call as its own row (its whole prompt as context); agl merges a
    # call onto the one its prompt extends, so a 20-turn conversation is one sample, its context
    # forwarded once rather than once a turn. False makes the per-call rows (to compare the two:
    # bench/swe_lite_normalization.py).
    merge_calls: Annotated[
        bool,
        _doc("merge a call onto the call its prompt extends (a sample per thread); false: every call its own"),
    ] = True
    max_prompt_length: Annotated[
        int | None, _doc("a sample whose prompt is longer is dropped (counted); unset: no limit")
    ] = None
    max_response_length: Annotated[int | None, _doc("longer responses are cut (counted); unset: no limit")] = None
    max_total_length: Annotated[int | None, _doc("longer samples are cut (counted); unset: no limit")] = None
    special_token_ids: Annotated[
        list[int], _doc("the tokenizer's special token IDs: classify failed merges without a tokenizer")
    ] = []
    # Calls from outside the harness's trace (agl.call.origin untraced / foreign_trace: a process the
    # agent spawned, which inherited OPENAI_BASE_URL) are still the policy's samples under the
    # rollout's reward: trained by default.
    train_outside_trace: Annotated[
        bool,
        _doc("train calls from outside the harness's trace (agl.call.origin untraced/foreign_trace); false skips them"),
    ] = True

    def __post_init__(self) -> None:
        if not self.reward_name:
            raise ValueError("assembly.reward_name must be a non-empty string (default: 'reward')")
        _check_policy("assembly.missing_reward", self.missing_reward, allow_keep=False)
        unknown = sorted(set(self.cause_policy) - set(CAUSES))
        if unknown:
            raise ValueError(f"assembly.cause_policy: unknown cause(s) {unknown}; known: {list(CAUSES)}")
        for cause, policy in self.cause_policy.items():
            _check_policy(f"assembly.cause_policy.{cause}", policy, allow_keep=True)
        merged = dict(DEFAULT_CAUSE_POLICY)
        merged.update(self.cause_policy)
        self.cause_policy = merged
        for name in ("max_prompt_length", "max_response_length", "max_total_length"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"assembly.{name} must be a positive number of tokens or unset, got {value}")

    def policy_for(self, cause: str | None) -> Policy:
        return self.cause_policy.get(cause or "ok", KEEP)


def _check_policy(key: str, policy: object, allow_keep: bool) -> None:
    if isinstance(policy, bool):
        raise TypeError(f"{key}: expected 'drop'{', keep' if allow_keep else ''} or a number, got {policy!r}")
    if isinstance(policy, (int, float)):
        return
    allowed = (DROP, KEEP) if allow_keep else (DROP,)
    if policy not in allowed:
        choices = " or ".join(repr(a) for a in allowed)
        raise ValueError(f"{key}: expected {choices} or a number (a fill reward), got {policy!r}")
