"""What `agl train --from-store` refuses to train on: a rollout the store holds but the model cannot
take. Each is set aside with its reason (recorded in the store as its dropped reason, counted,
shown by `agl traces ls`; version_ahead only skipped) and the rest of the step trains; before, one such rollout was a traceback
at the step that drew it, on every rerun.

    invalid_reward       its reward is NaN or infinite (the advantage of its whole group would be)
    token_out_of_vocab   a token id outside the model's vocabulary [0, vocab)
    version_ahead        a token says a policy version newer than the weights being trained (a
                         call's tokens after a keep switch): stored.py skips it unrecorded, as
                         `select` does a rollout whose calls say so
"""

from __future__ import annotations

import math

from agl_trainer.batch import RolloutResult
from agl_trainer.store import RolloutKey

INVALID_REWARD = "invalid_reward"
OUT_OF_VOCAB = "token_out_of_vocab"
VERSION_AHEAD = "version_ahead"


def why_not(result: RolloutResult, vocab_size: int | None, current: int) -> str | None:
    """Why this assembled rollout cannot be trained by weights at version `current`, or None."""
    if not math.isfinite(result.reward):
        return INVALID_REWARD
    for sample in result.samples:
        ids = sample.token_ids
        if ids.size and vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            return OUT_OF_VOCAB
        if sample.policy_versions.size and int(sample.policy_versions.max()) > current:
            return VERSION_AHEAD
    return None


def split(
    results: list[RolloutResult], vocab_size: int | None, current: int
) -> tuple[list[RolloutResult], dict[str, list[RolloutKey]]]:
    """The results to train, and the ones set aside by reason."""
    good: list[RolloutResult] = []
    bad: dict[str, list[RolloutKey]] = {}
    for result in results:
        reason = why_not(result, vocab_size, current)
        if reason is None:
            good.append(result)
        else:
            bad.setdefault(reason, []).append(RolloutKey(result.rollout_id, result.attempt))
    return good, bad
