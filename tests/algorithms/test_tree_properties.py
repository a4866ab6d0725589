"""Rollout-level normalization over call forests (hypothesis): rollouts whose calls branch (retries,
parallel branches), restart (sub-agents, compaction) and continue each other, assembled by the real
assembly. Every generated token is trained exactly once, and under rollout-mean every rollout
weighs 1 / (number of rollouts), each of its trained tokens the same, whatever its calls,
branches, samples and tokens: the weights equal those of one sample per call."""

from __future__ import annotations

import numpy as np
import torch
from agl_trainer.algorithms import token_weights
from agl_trainer.assembly import AssemblyConfig, assemble_rollout
from agl_trainer.batch import TrainingBatch
from agl_trainer.store.records import CallRow, RolloutData, RolloutInfo, RewardRow
from hypothesis import given, settings
from hypothesis import strategies as st

small = st.lists(st.integers(0, 6), max_size=3)  # few token values: accidental prefixes happen


@st.composite
def forest(draw) -> list[tuple[list[int], list[int]]]:
    """A rollout's calls as (prompt, completion): each one a new root, a continuation of an
    earlier call (its full sequence + new tokens), or a retry (an earlier call's exact prompt)."""
    calls: list[tuple[list[int], list[int]]] = []
    for _ in range(draw(st.integers(1, 7))):
        how = draw(st.sampled_from(["root", "continue", "retry"])) if calls else "root"
        if how == "root":
            prompt = [draw(st.integers(0, 6)), *draw(small)]
        else:
            earlier_prompt, earlier_completion = calls[draw(st.integers(0, len(calls) - 1))]
            prompt = earlier_prompt if how == "retry" else earlier_prompt + earlier_completion + draw(small)
        calls.append((prompt, draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))))
    return calls


def rollout_data(index: int, calls: list[tuple[list[int], list[int]]]) -> RolloutData:
    info = RolloutInfo(
        rollout_id=f"r{index}", attempt=0, task_id=f"t{index % 2}", mode="train", status="succeeded",
        complete=True, end_cause="ok", first_seen_at=0.0, last_span_at=0.0, completed_at=0.0,
        trained_step=None, dropped_reason=None,
    )  # fmt: skip
    rows = [
        CallRow(
            span_id=seq.to_bytes(8), call_seq=seq, name="chat tiny", end_ns=seq,
            prompt_ids=np.asarray(prompt, np.int32), completion_ids=np.asarray(completion, np.int32),
            logprobs=np.full(len(completion), -0.5, np.float32), prompt_ref_seq=None, prompt_ref_length=None,
            prompt_length=len(prompt), policy_version=0, finish_reason="stop", end_reason="completed",
            tokens_source="engine",
        )  # fmt: skip
        for seq, (prompt, completion) in enumerate(calls)
    ]
    return RolloutData(info=info, calls=rows, rewards=[RewardRow(b"\x01" * 8, "reward", 1.0, None, 1)])


@settings(max_examples=80, deadline=None)
@given(rollouts=st.lists(forest(), min_size=1, max_size=5))
def test_every_rollout_weighs_the_same_whatever_its_forest(rollouts):
    results, owners = [], []  # owners[r][(row, col)] = (call, position): who generated each trained token
    for index, calls in enumerate(rollouts):
        detail = assemble_rollout(rollout_data(index, calls), AssemblyConfig())
        assert detail.result is not None
        samples = detail.result.samples
        placed: dict[tuple[int, int], tuple[int, int]] = {}
        for placement in detail.placements:
            sample = samples[placement.sample]
            completion = calls[placement.call_seq][1]
            span = range(placement.completion_start, placement.completion_end)
            assert [sample.token_ids[i] for i in span] == completion
            assert all(sample.loss_mask[i] == 1 for i in span)
            placed.update({(placement.sample, i): (placement.call_seq, i - span.start) for i in span})
        # every generated token is trained exactly once: in its call's placement, nowhere else
        trained = {(s, i) for s, sample in enumerate(samples) for i, m in enumerate(sample.loss_mask) if m}
        assert trained == set(placed)
        assert len(trained) == sum(len(c) for _, c in calls)
        results.append(detail.result)
        owners.append(placed)

    batch = TrainingBatch.from_rollouts(results)
    weights = token_weights(batch.loss_mask, batch.rollout_index, "rollout-mean")
    rows_of = [torch.nonzero(batch.rollout_index == r).flatten().tolist() for r in range(len(results))]
    for r, placed in enumerate(owners):
        rows = rows_of[r]
        per_token = {owner: float(weights[rows[s], i]) for (s, i), owner in placed.items()}
        # the weights one sample per call would give: 1 / (rollouts x the rollout's trained tokens)
        expected = 1.0 / (len(results) * len(per_token))
        assert np.allclose(list(per_token.values()), expected, rtol=1e-5)
        assert abs(float(weights[rows].sum()) - 1.0 / len(results)) < 1e-5
    constant = token_weights(batch.loss_mask, batch.rollout_index, "rollout-mean-token-sum-norm", 8.0)
    for r, placed in enumerate(owners):
        assert abs(float(constant[rows_of[r]].sum()) - len(placed) / (8.0 * len(results))) < 1e-5
