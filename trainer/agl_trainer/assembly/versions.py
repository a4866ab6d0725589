"""Which policy version produced each completion token of a call.

One version per call (`agl.policy.version`), unless the call was generated across a drain-free
policy switch (loop.switch: keep): then `agl.completion.policy_versions` holds run-length pairs
[start, version, ...] (the receiver checked them). This is the one place that reads either.
"""

from __future__ import annotations

import numpy as np

from agl_trainer.store.records import CallRow


def token_versions(call: CallRow) -> np.ndarray:
    """One int64 per completion token of choice 0: the policy version that sampled it (-1: unknown)."""
    completion = call.completion_ids
    size = 0 if completion is None else int(completion.size)
    version = call.policy_version if call.policy_version is not None else -1
    out = np.full(size, version, np.int64)
    runs = getattr(call, "policy_versions", None)
    if runs is not None and size:
        starts, versions = runs[0::2], runs[1::2]
        ends = list(starts[1:]) + [size]
        for start, end, run_version in zip(starts, ends, versions):
            out[int(start) : int(end)] = int(run_version)
    return out


def after_switch(mask: np.ndarray, versions: np.ndarray, call_starts: list[int]) -> np.ndarray | None:
    """Per token of a sample, True where a call's generated token has another version than the call's
    first one: sampled after a drain-free switch, over the old weights' KV of its prefix (switch_kv:
    keep). None when no call of the sample spans a switch (the common case)."""
    out: np.ndarray | None = None
    size = int(mask.size)
    for index, begin in enumerate(call_starts):
        if begin >= size or not mask[begin]:
            continue
        limit = call_starts[index + 1] if index + 1 < len(call_starts) else size  # a child may add no context
        rest = mask[begin:limit] == 0
        end = begin + int(np.argmax(rest)) if rest.any() else min(limit, size)  # the call's generated run
        changed = versions[begin:end] != versions[begin]
        if changed.any():
            if out is None:
                out = np.zeros(size, np.bool_)
            out[begin:end] = changed
    return out
