"""Spans -> samples: rebuild prompts, merge calls onto the call tree, truncate, attach rewards,
apply policies.

`assemble_rollout` is a pure function of a rollout's stored rows (RolloutData), so the samples do
not depend on the order in which spans arrived. A rollout without a task id is its own group (its
task id is its rollout id).

Calls are taken in `agl.call.seq` order. A call's parent is the earlier call whose full sequence
(prompt + choice-0 completion) its prompt extends exactly, the longest such one, whatever came in
between (tree.py): a sub-agent's calls interleaved with the main thread's each find their own
thread. The calls form a forest, and each sample is one path down it: the first child of a call
continues its sample (the new prompt tokens get loss_mask 0); any later child (a retry, a parallel
branch) starts a new sample whose copy of the shared prefix is context (loss_mask 0), so shared
tokens are trained once per rollout. A call that extends no earlier call starts a new sample; the
break is classified against the earlier call sharing the longest common prefix (merge.py).
A call whose response never reached the harness is not trained and is no one's parent.

Where the harness declares its agents (agl.call.agent_id / parent_agent_id), the declared tree wins
over the prefixes: a call joins a sample only along its own agent's thread (or, for an agent's first
call, its parent agent's); one whose prefix parent is another agent's starts a new sample. Every
call where the two trees disagree is reported (CallPlacement.declared), and a declared compaction
starts a new sample of the same rollout. A call whose prompt the sidecar edited (Anthropic's context
editing, agl.call.context_edits) and that extends no earlier call starts one too, named as a context
edit rather than a merge failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import numpy as np
from agl import semconv

from agl_trainer.assembly.config import DROP, KEEP, AssemblyConfig
from agl_trainer.assembly.merge import MergeFailure, classify
from agl_trainer.assembly.tree import PrefixIndex
from agl_trainer.assembly.versions import after_switch, token_versions
from agl_trainer.batch import RolloutResult, Sample
from agl_trainer.store.records import COMPACTED, CONTEXT_EDITED, CallRow, RolloutData, RolloutKey

CHECK_EVERY = 256  # calls between two `check()`s

# Per-call problems (the call is not trained on; the rollout goes on).
MISSING_REFERENCE = "missing_reference"
BAD_REFERENCE_LENGTH = "bad_reference_length"
PROMPT_LENGTH_MISMATCH = "prompt_length_mismatch"
TOKENS_ABSENT = "tokens_absent"
DUPLICATE_CALL_SEQ = "duplicate_call_seq"
NOT_DELIVERED = "response_not_delivered"  # agl.call.end_reason in semconv.ENDS_UNDELIVERED
# delivery_unknown (a span recovered from a killed sidecar's log without its delivery marker) and no
# later call building on its answer: the harness most likely never got it
DELIVERY_UNKNOWN = "delivery_unknown_not_built_on"
OUTSIDE_TRACE = "outside_trace_not_trained"  # agl.call.origin not harness, train_outside_trace off
LOGPROBS_MISSING = "logprobs_missing"  # trained; Sample.logprob_known 0: re-scored or excluded (agreement.py)
CALL_REWARD_LOST = "call_reward_lost"  # a per-call reward whose call was skipped or cut away
EXTRA_CHOICES = (
    "extra_choices_not_trained"  # choices 1..n-1 of an n > 1 call: only choice 0 continues the rollout
)

# Why a call starts a new sample (CallPlacement.start).
START_FIRST = "first"  # the rollout's first trained call
START_BRANCH = "branch"  # extends a call whose sample an earlier child continues (retry, parallel branch)
START_NO_PREFIX = "no_prefix"  # extends no earlier call (sub-agent, compaction, edit): see merge_failures
START_COMPACTION = "compaction"  # the harness declared a compaction (agl.call.compaction): not a merge failure
START_CONTEXT_EDIT = "context_edit"  # extends no earlier call, its prompt edited by the sidecar: not a merge failure
START_DECLARED = "declared_agent"  # extends another agent's call, which the declared tree says is not its thread
START_PER_CALL = "per_call"  # extends a call, but assembly.merge_calls is off: every call its own sample
# Each start said in words ({parent}: the call it branches from), for `agl traces inspect` and `agl harness check`.
START_REASONS = {
    START_FIRST: "new sample: the first call",
    START_BRANCH: "new sample: a branch of call {parent} (the shared prefix is context)",
    START_NO_PREFIX: "new sample: extends no earlier call",
    START_COMPACTION: "new sample: the harness declared a compaction",
    START_CONTEXT_EDIT: "new sample: the sidecar edited its prompt (context_management)",
    START_PER_CALL: "new sample: extends call {parent}, not merged (assembly.merge_calls is off)",
    START_DECLARED: "new sample: extends call {parent} of another agent (the declared tree wins)",
}

# Where the prefix-built tree disagrees with the agents the harness declared (CallPlacement.declared).
DECLARED_OTHER_AGENT = "prefix_parent_of_another_agent"  # extends a call of an agent neither its own nor its parent
DECLARED_THREAD_BROKEN = "agent_thread_broken"  # a later call of an agent that extends none of its calls

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
    merged: bool = False  # appended to its parent's sample
    problem: str | None = None
    prompt_from_reference: bool = False
    parent: int | None = None  # the call whose full sequence this call's prompt extends (the tree)
    start: str | None = None  # why a new sample: START_FIRST | START_BRANCH | START_NO_PREFIX
    origin: str | None = None  # agl.call.origin
    agent_id: str | None = None  # agl.call.agent_id, as the harness declared it
    declared: str | None = None  # DECLARED_*: how the prefix tree disagrees with the declared agents
    # (None: it agrees, or the call declares no agent)


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
    """A sample being built: one path down the call tree, as numpy chunks joined when finished."""

    def __init__(
        self, prompt: np.ndarray, completion: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, call_seq: int
    ) -> None:
        self.tokens = [prompt, completion]
        self.mask = [np.zeros(prompt.size, np.bool_), np.ones(completion.size, np.bool_)]
        self.logprobs = [np.zeros(prompt.size, np.float32), logprobs]
        self.versions = [np.full(prompt.size, -1, np.int64), versions]
        self.size = int(prompt.size + completion.size)
        self.call_seqs = [call_seq]
        self.call_starts = [int(prompt.size)]  # where each call's generated tokens start

    def extend(
        self, context: np.ndarray, completion: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, call_seq: int
    ) -> None:
        self.tokens += [context, completion]
        self.mask += [np.zeros(context.size, np.bool_), np.ones(completion.size, np.bool_)]
        self.logprobs += [np.zeros(context.size, np.float32), logprobs]
        self.versions += [np.full(context.size, -1, np.int64), versions]
        self.call_seqs.append(call_seq)
        self.call_starts.append(self.size + int(context.size))
        self.size += int(context.size + completion.size)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (
            np.concatenate(self.tokens),
            np.concatenate(self.mask),
            np.concatenate(self.logprobs),
            np.concatenate(self.versions),
        )


def _count(counter: dict[str, int], key: str, n: int = 1) -> None:
    counter[key] = counter.get(key, 0) + n


class _Tape:
    """A growable token buffer. A call whose prompt extends, by reference, the whole sequence at
    the tape's end is appended to it, and its prompt and full sequence are views: a thread of
    calls costs its new tokens, not every call's whole context again (quadratic in calls)."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        size = sum(int(p.size) for p in parts)
        self.buffer = np.empty(max(64, size), np.result_type(*parts))
        self.size = 0
        self.append(parts)

    def append(self, parts: list[np.ndarray]) -> None:
        size = self.size + sum(int(p.size) for p in parts)
        dtype = np.result_type(self.buffer, *parts)  # a wider part widens the tape (never wraps)
        if size > self.buffer.size or dtype != self.buffer.dtype:  # views of the old buffer stay valid
            grown = np.empty(max(size, 2 * self.buffer.size), dtype)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        for part in parts:
            self.buffer[self.size : self.size + part.size] = part
            self.size += int(part.size)


def _rebuild_prompts(
    calls: list[CallRow], problems: dict[str, int], placements: dict[int, CallPlacement]
) -> dict[int, tuple[CallRow, np.ndarray, np.ndarray]]:
    """Unique calls by seq with their full prompts and full sequences (prompt + completion);
    prompts sent by reference are rebuilt exactly."""
    usable: dict[int, tuple[CallRow, np.ndarray, np.ndarray]] = {}
    full: dict[int, tuple[_Tape, int]] = {}  # seq -> its full sequence: tape[:length], for references
    for call in calls:  # sorted by (call_seq, end_ns, span_id): the first of duplicates wins
        if call.call_seq in placements:
            _count(problems, DUPLICATE_CALL_SEQ)
            continue
        placement = CallPlacement(
            call_seq=call.call_seq,
            sample=None,
            policy_version=_version(call),
            origin=call.origin,
            agent_id=call.agent_id,
        )
        placements[call.call_seq] = placement
        problem = None
        prompt = call.prompt_ids
        base: tuple[_Tape, int] | None = None
        if call.tokens_source == semconv.TOKENS_ABSENT or prompt is None or call.completion_ids is None:
            problem = TOKENS_ABSENT
        elif call.prompt_ref_seq is not None:
            placement.prompt_from_reference = True
            base = full.get(call.prompt_ref_seq)
            if base is None:
                problem = MISSING_REFERENCE
            elif call.prompt_ref_length is None or not 0 <= call.prompt_ref_length <= base[1]:
                problem = BAD_REFERENCE_LENGTH
        reused = (call.prompt_ref_length or 0) if base is not None else 0
        size = None if prompt is None else int(prompt.size) + reused
        if problem is None and call.prompt_length is not None and call.prompt_length != size:
            problem = PROMPT_LENGTH_MISMATCH
        if problem is not None:
            placement.problem = problem
            _count(problems, problem)
            continue
        assert prompt is not None and call.completion_ids is not None and size is not None
        if call.choices > 1:
            _count(problems, EXTRA_CHOICES, call.choices - 1)
        if base is not None and base[1] == call.prompt_ref_length == base[0].size:  # extends the tape's end
            tape = base[0]
            tape.append([prompt, call.completion_ids])
        elif base is not None:
            tape = _Tape([base[0].buffer[: call.prompt_ref_length], prompt, call.completion_ids])
        else:
            tape = _Tape([prompt, call.completion_ids])
        length = size + int(call.completion_ids.size)
        full[call.call_seq] = (tape, length)
        usable[call.call_seq] = (call, tape.buffer[:size], tape.buffer[:length])
    return usable


def full_sequences(calls: list[CallRow]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each usable call's prompt and full sequence (prompt + completion) by seq, prompts sent by
    reference rebuilt: what a merge break compares (`agl harness check` shows the text there)."""
    return {seq: (prompt, full) for seq, (_, prompt, full) in _rebuild_prompts(calls, {}, {}).items()}


def _built_on(usable: dict[int, tuple[CallRow, np.ndarray, np.ndarray]]) -> set[int]:
    """The calls of unknown delivery (a killed sidecar could not say their answer went out) that a
    later call of the rollout builds on: its prompt extends the call's whole sequence, so the
    harness got the answer. There are few such calls (the ones answered as the sidecar died)."""
    unknown = [seq for seq, (call, _, _) in usable.items() if call.end_reason == semconv.END_DELIVERY_UNKNOWN]
    found: set[int] = set()
    for seq in unknown:
        full = usable[seq][2]
        for later, (_, prompt, _) in usable.items():
            if later > seq and prompt.size >= full.size and np.array_equal(prompt[: full.size], full):
                found.add(seq)
                break
    return found


def _trainable(call: CallRow, config: AssemblyConfig, built_on: set[int]) -> str | None:
    """Why a call with usable tokens is not trained, or None."""
    if call.end_reason in semconv.ENDS_UNDELIVERED:
        return NOT_DELIVERED
    if call.end_reason == semconv.END_DELIVERY_UNKNOWN and call.call_seq not in built_on:
        return DELIVERY_UNKNOWN
    if not config.train_outside_trace and call.origin not in (None, semconv.ORIGIN_HARNESS):
        return OUTSIDE_TRACE
    return None


def _version(call: CallRow) -> int:
    return call.policy_version if call.policy_version is not None else -1


def _logprobs(call: CallRow, problems: dict[str, int]) -> np.ndarray:
    completion = call.completion_ids
    assert completion is not None
    if call.logprobs is None or call.logprobs.size != completion.size:
        _count(problems, LOGPROBS_MISSING)
        return np.full(completion.size, np.nan, np.float32)  # unknown: Sample.logprob_known says so
    return call.logprobs.astype(np.float32, copy=False)


def assemble_rollout(
    data: RolloutData, config: AssemblyConfig, tokenizer: Any = None, check: Callable[[], None] | None = None
) -> RolloutAssembly:
    """`check`, when given, is called every CHECK_EVERY calls and may raise to stop (the viewer's
    request budget)."""
    info = data.info
    problems: dict[str, int] = {}
    truncations: dict[str, int] = {}
    placements: dict[int, CallPlacement] = {}
    failures: list[MergeFailure] = []
    special = np.asarray(config.special_token_ids, dtype=np.int32) if config.special_token_ids else None

    usable = _rebuild_prompts(data.calls, problems, placements)
    built_on = _built_on(usable)
    built: list[_Building] = []
    index = PrefixIndex()
    sample_of: dict[int, int] = {}  # call seq -> the sample that ends with it
    continued: set[int] = set()  # calls whose sample a child already continues
    agents_seen: set[str] = set()  # declared agents with a trained call so far
    for done, seq in enumerate(sorted(usable)):
        if check is not None and done % CHECK_EVERY == 0:
            check()
        call, prompt, full = usable[seq]
        placement = placements[seq]
        problem = _trainable(call, config, built_on)
        if problem is not None:
            placement.problem = problem
            _count(problems, problem)
            continue
        completion = call.completion_ids
        assert completion is not None
        logprobs, versions = _logprobs(call, problems), token_versions(call)
        # a prompt sent by reference is known to start with that call's first tokens: walk from there
        known = None if call.prompt_ref_seq is None else (call.prompt_ref_seq, call.prompt_ref_length or 0)
        parent = index.parent(prompt, known)
        placement.parent = parent
        if call.agent_id is not None:
            placement.declared = _declared_disagreement(call, parent, usable, agents_seen)
            agents_seen.add(call.agent_id)
        compacted = call.compaction == COMPACTED
        if compacted or placement.declared == DECLARED_OTHER_AGENT:
            # the harness rewrote its context, or the prefix joins this call to an agent that is
            # neither its own nor the one that started it: the declared tree wins, a new sample
            placement.start = START_COMPACTION if compacted else START_DECLARED
            sample, current = len(built), _Building(prompt, completion, logprobs, versions, seq)
            built.append(current)
        elif parent is not None and not config.merge_calls:
            placement.start = START_PER_CALL  # its own sample by choice, not a merge failure
            sample, current = len(built), _Building(prompt, completion, logprobs, versions, seq)
            built.append(current)
        elif parent is not None and parent not in continued:
            sample = sample_of.pop(parent)
            current = built[sample]
            continued.add(parent)
            placement.context_start = current.size  # == the parent's full sequence length
            current.extend(prompt[current.size :], completion, logprobs, versions, seq)
            placement.merged = True
        elif parent is None and call.compaction == CONTEXT_EDITED and len(index):
            placement.start = START_CONTEXT_EDIT  # the sidecar said why: no merge failure to classify
            sample, current = len(built), _Building(prompt, completion, logprobs, versions, seq)
            built.append(current)
        else:
            placement.start = START_BRANCH if parent is not None else START_NO_PREFIX if len(index) else START_FIRST
            closest = index.closest(prompt, known if parent is None else (parent, int(prompt.size)))
            if closest is not None:
                near, sequence, common = closest
                # A branch is a failed merge only when the prompt went past the nearest call's
                # prompt and then differs (re-encoded answer, edited turn); a retry or a parallel
                # branch differs within it.
                past = index.prompt_size(near) <= common < prompt.size
                if parent is None or past:
                    failures.append(classify(sequence, prompt, seq, near, tokenizer, special))
            sample, current = len(built), _Building(prompt, completion, logprobs, versions, seq)
            built.append(current)
        sample_of[seq] = placement.sample = sample
        placement.completion_end = current.size
        placement.completion_start = placement.completion_end - int(completion.size)
        index.add(seq, full, int(prompt.size), None if parent is None else (parent, int(prompt.size)))

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


def _declared_disagreement(
    call: CallRow, parent: int | None, usable: dict[int, tuple[CallRow, np.ndarray, np.ndarray]], seen: set[str]
) -> str | None:
    """How the prefix-built parent of a call that declares its agent disagrees with the declared tree:
    a call continues its own agent's thread, and an agent's first call may extend a call of the agent
    that started it (a sub-agent given its parent's context) or nothing (a fresh context)."""
    first = call.agent_id not in seen
    if parent is None:
        return DECLARED_THREAD_BROKEN if not first and not call.compaction else None
    parent_agent = usable[parent][0].agent_id
    if parent_agent is None or parent_agent == call.agent_id:
        return None
    if first and parent_agent == call.parent_agent_id:
        return None
    return DECLARED_OTHER_AGENT


def training_reward(data: RolloutData, config: AssemblyConfig) -> float | None:
    """The reward a rollout trains with, as assembly gives it (its end cause's policy, its final reward,
    assembly.missing_reward); None when assembly drops it for its cause or a missing reward."""
    reward, dropped = _reward_and_policy(data, config)
    return None if dropped is not None else reward


def awaits_reward(data: RolloutData, config: AssemblyConfig) -> bool:
    """No final reward yet, and its end cause's policy trains it with the one it gets."""
    return config.policy_for(data.info.end_cause or "ok") == KEEP and data.final_reward(config.reward_name) is None


def has_call_rewards(data: RolloutData, config: AssemblyConfig) -> bool:
    """Per-call rewards of the trained reward name: they shape token rewards beyond the final one."""
    return any(r.name == config.reward_name and r.call_seq is not None for r in data.rewards)


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
        tokens, mask, logprobs, versions = sample.arrays()
        trained = np.flatnonzero(mask)
        if trained.size == 0:
            _count(truncations, NO_TRAINED_TOKENS)
            continue
        prompt_length = int(trained[0])
        if config.max_prompt_length is not None and prompt_length > config.max_prompt_length:
            _count(truncations, PROMPT_TOO_LONG)
            continue
        end = tokens.size
        if config.max_response_length is not None and end - prompt_length > config.max_response_length:
            end = prompt_length + config.max_response_length
            _count(truncations, RESPONSE_TRUNCATED)
        if config.max_total_length is not None and end > config.max_total_length:
            end = config.max_total_length
            _count(truncations, TOTAL_TRUNCATED)
        if not mask[:end].any():
            _count(truncations, NO_TRAINED_TOKENS)
            continue
        kept_index[index] = len(samples)
        starts = sample.call_starts
        kept_calls = [seq for seq, begin in zip(sample.call_seqs, starts, strict=True) if begin < end]
        if end < tokens.size:  # a truncated sample holds copies, not views keeping the whole sequence alive
            tokens, mask, logprobs, versions = (a[:end].copy() for a in (tokens, mask, logprobs, versions))
        known = np.isfinite(logprobs)
        switched = after_switch(mask, versions, starts)
        samples.append(
            Sample(
                rollout_id=info.rollout_id,
                task_id=info.task_id or info.rollout_id,
                token_ids=tokens,
                loss_mask=mask,
                engine_logprobs=np.where(known, logprobs, np.float32(0.0)),
                policy_versions=versions,
                call_seqs=kept_calls,
                logprob_known=None if known.all() else known,
                after_switch=switched,
            )
        )
    return samples, kept_index


def rewarded_call(named: int, ordered: Sequence[int]) -> int:
    """The seq of the call a reward's agl.call.seq names: the seq itself, or a position in the
    rollout (0 = the first call: what a harness counting its calls knows; seqs are clock readings,
    sidecar/spans/call_seq.py) where no seq can be mistaken for a position (a counted 1, 2 with call
    0 lost is not positions). `ordered`: the rollout's call seqs, sorted."""
    by_position = bool(ordered) and ordered[0] >= len(ordered)
    return ordered[named] if by_position and named < len(ordered) else named


def call_rewards(rewards: Iterable[Any], reward_name: str, seqs: Iterable[int]) -> dict[int, float]:
    """Per-call rewards of `reward_name` by the seq of the call each names (the last one per call
    wins); the one rule, for training and for the viewer."""
    ordered = sorted(seqs)
    per_call: dict[int, float] = {}
    for reward in rewards:
        if reward.name == reward_name and reward.call_seq is not None:
            per_call[rewarded_call(reward.call_seq, ordered)] = reward.value
    return per_call


def _place_call_rewards(
    data: RolloutData,
    config: AssemblyConfig,
    samples: list[Sample],
    placements: dict[int, CallPlacement],
    problems: dict[str, int],
) -> None:
    per_call = call_rewards(data.rewards, config.reward_name, placements)
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
            sample.token_rewards = np.zeros(sample.token_ids.size)
        sample.token_rewards[last] += value
