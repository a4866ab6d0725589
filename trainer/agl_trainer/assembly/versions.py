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
