"""The store's record types: the spans the receiver hands it (`Record`) and the rows it hands out.

A received span is the stored row plus where it came from: `CallSpan` is a `CallRow` with the
span's trace, rollout and timing fields, `RewardSpan` a `RewardRow` with its trace and rollout.
(The sidecar's `CallRecord` is the call it is recording, a different concept.)
The receiver builds records (receiver/contract.py); the store never imports the receiver.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:  # arrays only in annotations: `agl traces ls` reads records without numpy
    import numpy as np


# CallRow.compaction's values.
COMPACTED = 1
CONTEXT_EDITED = 2

class Cause(str, enum.Enum):
    """How a rollout ended: a runner's outcome, and the store's `rollouts.end_cause`."""

    OK = "ok"
    HARNESS_ERROR = "harness_error"  # non-zero exit, exception or failed rollout span: not retried
    TIMEOUT = "timeout"  # killed after harness.timeout_s, or no end within rollout_timeout_s
    INFRA_ERROR = "infra_error"  # could not start, killed from outside, worker died: retried
    CANCELLED = "cancelled"  # stopped by the loop (shutdown, or dropped as too stale)


CAUSES: tuple[str, ...] = tuple(cause.value for cause in Cause)


class RolloutKey(msgspec.Struct, frozen=True, order=True):
    rollout_id: str
    attempt: int = 0


class RolloutInfo(msgspec.Struct):
    """A rollout's row: identity, completion and training state."""

    rollout_id: str
    attempt: int
    task_id: str | None
    mode: str | None
    status: str | None
    complete: bool
    end_cause: str | None
    first_seen_at: float
    last_span_at: float
    completed_at: float | None
    trained_step: int | None
    dropped_reason: str | None
    calls: int = 0
    rewards: int = 0
    error: str | None = None
    harness_exit_code: int | None = None
    late_spans: int = 0

    @property
    def key(self) -> RolloutKey:
        return RolloutKey(self.rollout_id, self.attempt)


class CallRow(msgspec.Struct, gc=False):
    """A stored call as assembly reads it; token arrays decoded to numpy (int32 / float32)."""

    span_id: bytes
    call_seq: int
    name: str
    end_ns: int
    prompt_ids: np.ndarray | None
    completion_ids: np.ndarray | None
    logprobs: np.ndarray | None
    prompt_ref_seq: int | None
    prompt_ref_length: int | None
    prompt_length: int | None
    policy_version: int | None
    finish_reason: str | None
    end_reason: str | None
    tokens_source: str | None
    choices: int = 1
    origin: str | None = None  # agl.call.origin (None: a sidecar that did not say)
    parent_span_id: bytes | None = None  # the W3C parent the harness sent (None: none)
    # agl.completion.policy_versions: int64 run-length pairs [start, version, ...] over the completion
    # (a call generated across a drain-free switch); None: every token is policy_version's. Read it
    # through assembly.versions.token_versions.
    policy_versions: np.ndarray | None = None
    # The sidecar's account of the call (schema 4; None: not sent, or a store from before): ms held
    # while training paused the sidecar, the replica that served it, the protocol the harness spoke.
    held_ms: float | None = None
    upstream: str | None = None
    api: str | None = None
    # The structure the harness declared (schema 5; None: not declared): its agent, that agent's
    # parent agent, and why its context is not its thread's continuation: COMPACTED (a declared
    # compaction), CONTEXT_EDITED (the sidecar edited its prompt: agl.call.context_edits).
    agent_id: str | None = None
    parent_agent_id: str | None = None
    compaction: int | None = None
    # What a translating front did not interpret (schema 6; empty: nothing, or a plain chat call):
    # agl.request.fields.dropped / .passed, each entry "<JSON path>: <why>".
    fields_dropped: tuple[str, ...] = ()
    fields_passed: tuple[str, ...] = ()


class CallSpan(CallRow, kw_only=True, gc=False):
    """A model call span as received: the row plus its trace, rollout and start (None arrays: absent)."""

    trace_id: bytes
    rollout_id: str
    attempt: int
    task_id: str | None
    mode: str | None
    start_ns: int
    status_code: int


class RewardRow(msgspec.Struct, gc=False):
    span_id: bytes
    name: str
    value: float
    call_seq: int | None
    end_ns: int


class RewardSpan(RewardRow, kw_only=True, gc=False):
    """A reward span as received: the row plus its trace and rollout."""

    trace_id: bytes
    rollout_id: str
    attempt: int | None  # None: the reward names no attempt (e.g. emit_reward(rollout_id=...))
    task_id: str | None


class RolloutSpan(msgspec.Struct, gc=False):
    """An `agl.rollout` span: the harness's own account of the rollout's end."""

    trace_id: bytes
    span_id: bytes
    rollout_id: str
    attempt: int
    task_id: str | None
    mode: str | None
    status: str | None
    start_ns: int
    end_ns: int
    error: str | None


class Violation(msgspec.Struct, gc=False):
    """A span that broke the contract, kept as its reason."""

    trace_id: bytes
    span_id: bytes
    name: str
    reason: str
    rollout_id: str | None


Record = CallSpan | RolloutSpan | RewardSpan | Violation


class RolloutData(msgspec.Struct):
    """Everything assembly needs about one rollout. Calls are sorted by (call_seq, end, span id),
    rewards by (end, span id)."""

    info: RolloutInfo
    calls: list[CallRow]
    rewards: list[RewardRow]

    def final_reward(self, name: str) -> float | None:
        return final_reward(self.rewards, name)


def final_reward(rewards: list[RewardRow], name: str) -> float | None:
    """A rollout's reward: the last (by end, span id) whole-rollout reward (no call_seq) named `name`."""
    value = None
    for reward in rewards:
        if reward.name == name and reward.call_seq is None:
            value = reward.value
    return value


class WriteResult(msgspec.Struct):
    stored: int = 0
    duplicates: int = 0
    violations: dict[str, int] = {}
    tokens: int = 0


class StoreStats(msgspec.Struct):
    rollouts: int
    complete: int
    ready: int
    trained: int
    dropped: int
    by_cause: dict[str, int]
    calls: int
    rewards: int
    violations: dict[str, int]
    last_step: int | None
