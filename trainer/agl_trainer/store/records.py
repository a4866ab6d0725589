"""What the store hands out: rollouts, their calls and rewards, and its statistics."""

from __future__ import annotations

from typing import Final

import msgspec
import numpy as np

# How a rollout ended (rollouts.end_cause).
CAUSE_OK: Final = "ok"
CAUSE_HARNESS_ERROR: Final = "harness_error"
CAUSE_INFRASTRUCTURE_ERROR: Final = "infra_error"  # the same spelling as runners.base.Cause
CAUSE_TIMEOUT: Final = "timeout"
CAUSE_CANCELLED: Final = "cancelled"  # stopped by the trainer (shutdown, too stale)
CAUSES: Final = (CAUSE_OK, CAUSE_HARNESS_ERROR, CAUSE_INFRASTRUCTURE_ERROR, CAUSE_TIMEOUT, CAUSE_CANCELLED)


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
    """A stored call; token arrays decoded to numpy (int32 / float32)."""

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


class RewardRow(msgspec.Struct, gc=False):
    span_id: bytes
    name: str
    value: float
    call_seq: int | None
    end_ns: int


class RolloutData(msgspec.Struct):
    """Everything assembly needs about one rollout. Calls are sorted by (call_seq, end, span id)."""

    info: RolloutInfo
    calls: list[CallRow]
    rewards: list[RewardRow]


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
