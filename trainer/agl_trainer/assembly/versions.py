"""Which policy version produced each completion token of a call.

Today one version per call (`agl.policy.version`); a completion generated across a policy switch
will carry where each version starts, and this is the one place that reads it.
"""

from __future__ import annotations

import numpy as np

from agl_trainer.store.records import CallRow


def token_versions(call: CallRow) -> np.ndarray:
    """One int64 per completion token of choice 0: the policy version that sampled it (-1: unknown)."""
    completion = call.completion_ids
    size = 0 if completion is None else int(completion.size)
    version = call.policy_version if call.policy_version is not None else -1
    return np.full(size, version, np.int64)
