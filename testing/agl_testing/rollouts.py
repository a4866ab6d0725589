"""Rollouts written straight into a RolloutStore, as the receiver stores them (for --from-store)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from agl_trainer.store import RolloutStore
from agl_trainer.store.records import CallSpan, RewardSpan, RolloutSpan

T0 = 1_700_000_000_000_000_000


def call(rollout_id: str, task: str, *, seq: int = 0, version: int = 0, start: int = T0) -> CallSpan:
    prompt, completion = np.array([5, 6, 7, 8], np.int32), np.array([9, 10, 11], np.int32)
    return CallSpan(
        span_id=os.urandom(8), call_seq=seq, name="chat tiny", end_ns=start + 1000, prompt_ids=prompt,
        completion_ids=completion, logprobs=np.full(completion.size, -0.5, np.float32), prompt_ref_seq=None,
        prompt_ref_length=None, prompt_length=int(prompt.size), policy_version=version, finish_reason="stop",
        end_reason="completed", tokens_source="engine", trace_id=os.urandom(16), rollout_id=rollout_id, attempt=0,
        task_id=task, mode="train", start_ns=start, status_code=0,
    )  # fmt: skip


def reward(rollout_id: str, task: str, value: float = 1.0) -> RewardSpan:
    return RewardSpan(span_id=os.urandom(8), name="reward", value=value, call_seq=None, end_ns=T0 + 2000,
                      trace_id=os.urandom(16), rollout_id=rollout_id, attempt=0, task_id=task)  # fmt: skip


def end(rollout_id: str, task: str) -> RolloutSpan:
    return RolloutSpan(trace_id=os.urandom(16), span_id=os.urandom(8), rollout_id=rollout_id, attempt=0,
                       task_id=task, mode="train", status="succeeded", start_ns=T0, end_ns=T0 + 3000, error=None)  # fmt: skip


def write_rollouts(
    store: RolloutStore, ids: Sequence[str], *, tasks: int = 4, rewarded: bool = True, ended: bool = True, version: int = 0
) -> None:
    """One call each (version `version`), a reward and the end span unless told otherwise; task = index % tasks."""
    batches = []
    for rid in ids:
        task = f"task-{int(rid.rsplit('-', 1)[-1]) % tasks}"
        records: list = [call(rid, task, version=version)]
        records += [reward(rid, task)] if rewarded else []
        records += [end(rid, task)] if ended else []
        batches.append(records)
    for start in range(0, len(batches), 500):
        store.write_batches(batches[start : start + 500])
