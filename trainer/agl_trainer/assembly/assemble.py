"""Spans -> samples: rebuild prompts, merge calls, truncate, attach rewards, apply policies.

`assemble_rollout` is a pure function of a rollout's stored rows (RolloutData), so the samples do
not depend on the order in which spans arrived. A rollout without a task id is its own group (its
task id is its rollout id). Calls are taken in `agl.call.seq` order; a call
whose prompt extends the current sample's tokens exactly is merged into it (the tokens in between
get loss_mask 0), otherwise the sample is closed and the failed merge classified (merge.py).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
from agl import semconv

from agl_trainer.assembly.config import DROP, KEEP, AssemblyConfig
from agl_trainer.assembly.merge import MergeFailure, classify, extends
from agl_trainer.assembly.versions import token_versions
from agl_trainer.batch import RolloutResult, Sample
from agl_trainer.store.records import CallRow, RolloutData, RolloutKey

# Per-call problems (the call is not trained on; the rollout goes on).
MISSING_REFERENCE = "missing_reference"
BAD_REFERENCE_LENGTH = "bad_reference_length"
PROMPT_LENGTH_MISMATCH = "prompt_length_mismatch"
TOKENS_ABSENT = "tokens_absent"
DUPLICATE_CALL_SEQ = "duplicate_call_seq"
LOGPROBS_MISSING = "logprobs_missing"  # trained, with logprob 0.0 (counted: importance weights are off)
CALL_REWARD_LOST = "call_reward_lost"  # a per-call reward whose call was skipped or cut away
EXTRA_CHOICES = (
    "extra_choices_not_trained"  # choices 1..n-1 of an n > 1 call: only choice 0 continues the rollout
)

# Truncation.
PROMPT_TOO_LONG = "prompt_too_long"  # the sample is dropped
RESPONSE_TRUNCATED = "response_truncated"
TOTAL_TRUNCATED = "total_truncated"
NO_TRAINED_TOKENS = "no_trained_tokens"  # the sample has nothing to train on and is dropped


class CallPlacement(msgspec.Struct):
    """Where a call's tokens went: sample index, and [context_start, completion_start,
    completion_end) in that sample (context = the new prompt tokens, loss_mask 0)."""

    call_seq: int
    sample: int | None  # None: the call was skipped (see problem)
    context_start: int = 0
    completion_start: int = 0
    completion_end: int = 0
    policy_version: int = -1
    merged: bool = False  # appended to the previous call's sample
    problem: str | None = None
    prompt_from_reference: bool = False


class RolloutAssembly(msgspec.Struct):
    """One rollout's result and everything that happened on the way (what `agl traces inspect` shows)."""

    key: RolloutKey
    result: RolloutResult | None
    dropped: str | None
    reward: float | None
    placements: list[CallPlacement]
    merge_failures: list[MergeFailure]
    truncations: dict[str, int]
    problems: dict[str, int]
    samples_dropped: int = 0


class _Building:
    """A sample being built: numpy chunks, concatenated when a merge needs to compare."""

    def __init__(
        self, prompt: np.ndarray, completion: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, call_seq: int
    ) -> None:
        self.tokens = np.concatenate([prompt, completion])
        self.mask = np.concatenate([np.zeros(prompt.size, np.int8), np.ones(completion.size, np.int8)])
        self.logprobs = np.concatenate([np.zeros(prompt.size, np.float32), logprobs])
        self.versions = np.concatenate([np.full(prompt.size, -1, np.int64), versions])
        self.call_seqs = [call_seq]
        self.call_starts = [int(prompt.size)]  # where each call's generated tokens start
        self.last_call = call_seq

    def extend(
        self, context: np.ndarray, completion: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, call_seq: int
    ) -> None:
        self.tokens = np.concatenate([self.tokens, context, completion])
        self.mask = np.concatenate(
            [self.mask, np.zeros(context.size, np.int8), np.ones(completion.size, np.int8)]
        )
        self.logprobs = np.concatenate([self.logprobs, np.zeros(context.size, np.float32), logprobs])
        self.versions = np.concatenate([self.versions, np.full(context.size, -1, np.int64), versions])
        self.call_seqs.append(call_seq)
        self.call_starts.append(int(self.tokens.size - completion.size))
        self.last_call = call_seq


def _count(counter: dict[str, int], key: str, n: int = 1) -> None:
    counter[key] = counter.get(key, 0) + n


def _rebuild_prompts(
    calls: list[CallRow], problems: dict[str, int], placements: dict[int, CallPlacement]
) -> dict[int, tuple[CallRow, np.ndarray]]:
    """Unique calls by seq with their full prompts; prompts sent by reference are rebuilt exactly."""
    usable: dict[int, tuple[CallRow, np.ndarray]] = {}
    full: dict[int, np.ndarray] = {}  # seq -> prompt + completion, for references
    for call in calls:  # sorted by (call_seq, end_ns, span_id): the first of duplicates wins
        if call.call_seq in placements:
            _count(problems, DUPLICATE_CALL_SEQ)
            continue
        placement = CallPlacement(call_seq=call.call_seq, sample=None, policy_version=_version(call))
        placements[call.call_seq] = placement
        problem = None
        prompt = call.prompt_ids
        if call.tokens_source == semconv.TOKENS_ABSENT or prompt is None or call.completion_ids is None:
            problem = TOKENS_ABSENT
        elif call.prompt_ref_seq is not None:
            placement.prompt_from_reference = True
            base = full.get(call.prompt_ref_seq)
            if base is None:
                problem = MISSING_REFERENCE
            elif call.prompt_ref_length is None or call.prompt_ref_length > base.size:
                problem = BAD_REFERENCE_LENGTH
            else:
                prompt = np.concatenate([base[: call.prompt_ref_length], prompt])
        if problem is None and call.prompt_length is not None and call.prompt_length != prompt.size:
            problem = PROMPT_LENGTH_MISMATCH
        if problem is not None:
            placement.problem = problem
            _count(problems, problem)
            continue
        if call.choices > 1:
            _count(problems, EXTRA_CHOICES, call.choices - 1)
        full[call.call_seq] = np.concatenate([prompt, call.completion_ids])
        usable[call.call_seq] = (call, prompt)
    return usable


def _version(call: CallRow) -> int:
    return call.policy_version if call.policy_version is not None else -1


def _logprobs(call: CallRow, problems: dict[str, int]) -> np.ndarray:
    completion = call.completion_ids
    assert completion is not None
    if call.logprobs is None or call.logprobs.size != completion.size:
        _count(problems, LOGPROBS_MISSING)
        return np.zeros(completion.size, np.float32)
    return call.logprobs.astype(np.float32, copy=False)


def assemble_rollout(data: RolloutData, config: AssemblyConfig, tokenizer: Any = None) -> RolloutAssembly:
    info = data.info
    problems: dict[str, int] = {}
    truncations: dict[str, int] = {}
    placements: dict[int, CallPlacement] = {}
    failures: list[MergeFailure] = []
    special = np.asarray(config.special_token_ids, dtype=np.int32) if config.special_token_ids else None

    usable = _rebuild_prompts(data.calls, problems, placements)
    built: list[_Building] = []
    current: _Building | None = None
    for seq in sorted(usable):
        call, prompt = usable[seq]
        completion = call.completion_ids
        assert completion is not None
        logprobs, versions, placement = _logprobs(call, problems), token_versions(call), placements[seq]
        if current is not None and extends(prompt, current.tokens):
            placement.context_start = int(current.tokens.size)
            current.extend(prompt[current.tokens.size :], completion, logprobs, versions, seq)
            placement.merged = True
        else:
            if current is not None:
                failures.append(classify(current.tokens, prompt, seq, current.last_call, tokenizer, special))
            current = _Building(prompt, completion, logprobs, versions, seq)
            built.append(current)
            placement.context_start = 0
        placement.sample = len(built) - 1
        placement.completion_end = int(current.tokens.size)
        placement.completion_start = placement.completion_end - int(completion.size)

    samples, kept_index = _finish_samples(built, info, config, truncations)
    for placement in placements.values():
        if placement.sample is not None:
            placement.sample = kept_index.get(placement.sample)
    _place_call_rewards(data, config, samples, placements, problems)

    key = RolloutKey(info.rollout_id, info.attempt)
    reward, dropped = _reward_and_policy(data, config)
    if dropped is None and not samples:
        dropped = "no_samples"
    result = None
    if dropped is None:
        result = RolloutResult(
            rollout_id=info.rollout_id,
            task_id=info.task_id or info.rollout_id,
            reward=float(reward),  # type: ignore[arg-type]
            samples=samples,
            attempt=info.attempt,
            end_cause=info.end_cause or "ok",
        )
    return RolloutAssembly(
        key=key,
        result=result,
        dropped=dropped,
        reward=reward,
        placements=[placements[seq] for seq in sorted(placements)],
        merge_failures=failures,
        truncations=truncations,
        problems=problems,
        samples_dropped=len(built) - len(samples),
    )


def _reward_and_policy(data: RolloutData, config: AssemblyConfig) -> tuple[float | None, str | None]:
    cause = data.info.end_cause or "ok"
    policy = config.policy_for(cause)
    if policy == DROP:
        return data.final_reward(config.reward_name), f"cause:{cause}"
    if policy != KEEP:
        return float(policy), None
    reward = data.final_reward(config.reward_name)
    if reward is not None:
        return reward, None
    if config.missing_reward == DROP:
        return None, "no_reward"
    return float(config.missing_reward), None


def _finish_samples(
    built: list[_Building], info: Any, config: AssemblyConfig, truncations: dict[str, int]
) -> tuple[list[Sample], dict[int, int]]:
    samples: list[Sample] = []
    kept_index: dict[int, int] = {}
    for index, sample in enumerate(built):
        trained = np.flatnonzero(sample.mask)
        if trained.size == 0:
            _count(truncations, NO_TRAINED_TOKENS)
            continue
        prompt_length = int(trained[0])
        if config.max_prompt_length is not None and prompt_length > config.max_prompt_length:
            _count(truncations, PROMPT_TOO_LONG)
            continue
        end = sample.tokens.size
        if config.max_response_length is not None and end - prompt_length > config.max_response_length:
            end = prompt_length + config.max_response_length
            _count(truncations, RESPONSE_TRUNCATED)
        if config.max_total_length is not None and end > config.max_total_length:
            end = config.max_total_length
            _count(truncations, TOTAL_TRUNCATED)
        if not sample.mask[:end].any():
            _count(truncations, NO_TRAINED_TOKENS)
            continue
        kept_index[index] = len(samples)
        starts = sample.call_starts
        kept_calls = [seq for seq, begin in zip(sample.call_seqs, starts, strict=True) if begin < end]
        samples.append(
            Sample(
                rollout_id=info.rollout_id,
                task_id=info.task_id or info.rollout_id,
                token_ids=sample.tokens[:end].tolist(),
                loss_mask=sample.mask[:end].tolist(),
                engine_logprobs=sample.logprobs[:end].tolist(),
                policy_versions=sample.versions[:end].tolist(),
                call_seqs=kept_calls,
            )
        )
    return samples, kept_index


def _place_call_rewards(
    data: RolloutData,
    config: AssemblyConfig,
    samples: list[Sample],
    placements: dict[int, CallPlacement],
    problems: dict[str, int],
) -> None:
    per_call: dict[int, float] = {}
    for reward in data.rewards:  # the last one per call wins
        if reward.name == config.reward_name and reward.call_seq is not None:
            per_call[reward.call_seq] = reward.value
    for seq, value in sorted(per_call.items()):
        placement = placements.get(seq)
        if placement is None or placement.sample is None:
            _count(problems, CALL_REWARD_LOST)
            continue
        sample = samples[placement.sample]
        last = min(placement.completion_end, len(sample.token_ids)) - 1
        if last < placement.completion_start:  # the call's tokens were cut away
            _count(problems, CALL_REWARD_LOST)
            continue
        if sample.token_rewards is None:
            sample.token_rewards = [0.0] * len(sample.token_ids)
        sample.token_rewards[last] += value
