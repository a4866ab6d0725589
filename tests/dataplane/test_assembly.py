"""Spans -> samples: exact merges, classified merge failures, prompt references, truncation,
rewards and policies."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from agl import semconv
from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.batch import PER_TOKEN, Sample, TrainingBatch

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span, with_attributes
from agl_testing.tiny_tokenizer import encode, special, tiny_tokenizer


def finish(store, rollout_id="r", reward=1.0, **kwargs):
    spans = [rollout_span(rollout_id, **kwargs)]
    if reward is not None:
        spans.append(reward_span(rollout_id, reward))
    ingest(store, spans)


def test_exact_prefixes_merge_into_one_sample_with_a_mask_over_generated_tokens(store):
    p0, c0 = [100, 101, 102], [200, 201, 202]
    tool1 = [103, 104]
    p1 = p0 + c0 + tool1
    c1 = [203, 204]
    tool2 = [105]
    p2 = p1 + c1 + tool2
    c2 = [205]
    ingest(
        store,
        [
            call_span("r", 2, p2, c2, logprobs=[-0.3], version=4),  # arrival order does not matter
            call_span("r", 0, p0, c0, logprobs=[-0.1, -0.2, -0.3], version=3),
            call_span("r", 1, p1, c1, logprobs=[-0.4, -0.5], version=3),
        ],
    )
    finish(store)
    result = assemble(store, store.ready_rollouts())
    [rollout] = result.rollouts
    [sample] = rollout.samples
    assert sample.token_ids.tolist() == p2 + c2
    assert sample.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1]
    generated = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
    assert generated == c0 + c1 + c2
    assert sample.engine_logprobs.tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, -0.3, 0, 0, -0.4, -0.5, 0, -0.3])
    assert sample.policy_versions.tolist() == [-1, -1, -1, 3, 3, 3, -1, -1, 3, 3, -1, 4]
    assert sample.call_seqs == [0, 1, 2]
    assert result.report.merged_calls == 2 and result.report.merge_failures == {}
    TrainingBatch.from_rollouts(result.rollouts)  # the algorithms' input builds from it


def test_merge_calls_off_makes_every_call_its_own_sample_with_its_whole_prompt(store):
    """assembly.merge_calls false (Agent Lightning's rows): three calls that extend each other are three
    samples; each trains only its own completion, and none is a merge failure."""
    p0, c0 = [100, 101], [200, 201]
    p1 = p0 + c0 + [103]
    c1 = [202]
    p2 = p1 + c1 + [104, 105]
    c2 = [203, 204, 205]
    ingest(
        store,
        [
            call_span("r", 1, p1, c1, logprobs=[-0.5], version=3),
            call_span("r", 0, p0, c0, logprobs=[-0.1, -0.2], version=3),
            call_span("r", 2, p2, c2, logprobs=[-0.3, -0.4, -0.6], version=4),
        ],
    )
    finish(store)
    result = assemble(store, store.ready_rollouts(), AssemblyConfig(merge_calls=False))
    [rollout] = result.rollouts
    assert [s.token_ids.tolist() for s in rollout.samples] == [p0 + c0, p1 + c1, p2 + c2]
    assert [s.loss_mask.tolist() for s in rollout.samples] == [
        [0] * len(p) + [1] * len(c) for p, c in ((p0, c0), (p1, c1), (p2, c2))
    ]
    assert rollout.samples[2].engine_logprobs.tolist() == pytest.approx([0.0] * len(p2) + [-0.3, -0.4, -0.6])
    assert rollout.samples[2].policy_versions.tolist() == [-1] * len(p2) + [4, 4, 4]
    assert [s.call_seqs for s in rollout.samples] == [[0], [1], [2]]
    assert [(p.start, p.parent, p.sample) for p in result.details[0].placements] == [
        ("first", None, 0), ("per_call", 0, 1), ("per_call", 1, 2)
    ]
    assert result.report.merged_calls == 0 and result.report.merge_failures == {}
    # the default merges the same spans into one sample
    assert [len(r.samples) for r in assemble(store, store.ready_rollouts()).rollouts] == [1]


def test_prompt_by_reference_is_rebuilt_exactly(store):
    p0, c0 = [1, 2, 3], [10, 11]
    full0 = p0 + c0
    ingest(
        store,
        [
            call_span("r", 0, p0, c0),
            call_span("r", 1, [20, 21], [12], ref=(0, 5), prompt_length=7),  # = full0 + [20, 21]
            call_span("r", 2, [30], [13], ref=(1, 7), prompt_length=8),  # drops call 1's last token
        ],
    )
    finish(store)
    result = assemble(store, store.ready_rollouts())
    first, second = result.rollouts[0].samples
    assert first.token_ids.tolist() == full0 + [20, 21, 12] and first.call_seqs == [0, 1]
    assert second.token_ids.tolist() == full0 + [20, 21, 30, 13] and second.loss_mask.tolist() == [0] * 8 + [1]
    # In the call tree, call 2 is a branch of call 0 (whose sample call 1 continues); it went past
    # call 1's prompt and then differs, so it is also a failed merge onto call 1. Without a tokenizer,
    # a difference in the last token only looks like a turn end rendered differently.
    placement = result.details[0].placements[2]
    assert (placement.parent, placement.start, placement.merged) == (0, "branch", False)
    assert [(f.kind, f.classified_by, f.position) for f in result.details[0].merge_failures] == [
        ("template", "heuristic", 7)
    ]


def test_missing_reference_is_classified_never_guessed(store):
    ingest(
        store,
        [
            call_span("r", 0, [1, 2], [3]),
            call_span("r", 2, [9], [4], ref=(1, 3), prompt_length=4),  # call 1 was lost
            call_span("r", 3, [8], [5], ref=(0, 9), prompt_length=10),  # longer than call 0's sequence
            call_span("r", 4, [7], [6], ref=(0, 3), prompt_length=99),  # rebuild disagrees with its length
        ],
    )
    finish(store)
    result = assemble(store, store.ready_rollouts())
    assert result.report.call_problems == {
        "missing_reference": 1,
        "bad_reference_length": 1,
        "prompt_length_mismatch": 1,
    }
    [sample] = result.rollouts[0].samples
    assert sample.call_seqs == [0]
    problems = {p.call_seq: p.problem for p in result.details[0].placements}
    assert problems == {
        0: None,
        2: "missing_reference",
        3: "bad_reference_length",
        4: "prompt_length_mismatch",
    }


def _retokenized_rollout():
    """Call 0 generated "hel"+"lo"; the harness re-encoded the text, so call 1 has "hello"."""
    prompt = [special("<|im_start|>")] + encode("user hello") + [special("<|im_end|>")]
    generated = encode("hel") + encode("lo world") + [special("<|im_end|>")]
    reencoded = encode("hello world") + [special("<|im_end|>")]
    assert generated != reencoded
    next_prompt = prompt + reencoded + encode(" the tool says 42")
    return prompt, generated, next_prompt


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_retokenized_prefix_splits_and_is_classified(store, with_tokenizer):
    prompt, generated, next_prompt = _retokenized_rollout()
    ingest(store, [call_span("r", 0, prompt, generated), call_span("r", 1, next_prompt, encode(" hello"))])
    finish(store)
    tokenizer = tiny_tokenizer() if with_tokenizer else None
    result = assemble(store, store.ready_rollouts(), tokenizer=tokenizer)
    assert len(result.rollouts[0].samples) == 2
    [failure] = result.details[0].merge_failures
    assert failure.kind == "retokenization"
    assert failure.classified_by == ("tokenizer" if with_tokenizer else "heuristic")
    assert failure.position == len(prompt)  # where the re-encoded text starts to differ
    assert result.report.merge_failures == {"retokenization": 1}


@pytest.mark.parametrize("how", ["tokenizer", "special_ids", "heuristic"])
def test_template_difference_is_classified(store, how):
    im_end, im_start = special("<|im_end|>"), special("<|im_start|>")
    prompt = [im_start] + encode("user hello") + [im_end, im_start]
    generated = encode("the answer is 42") + [im_end]  # the engine ended its turn with <|im_end|>
    next_prompt = prompt + encode("the answer is 42") + [special("<|endoftext|>")] + encode(" user")
    ingest(store, [call_span("r", 0, prompt, generated), call_span("r", 1, next_prompt, encode(" ok"))])
    finish(store)
    config = (
        AssemblyConfig(special_token_ids=tiny_tokenizer().all_special_ids) if how == "special_ids" else None
    )
    tokenizer = tiny_tokenizer() if how == "tokenizer" else None
    result = assemble(store, store.ready_rollouts(), config, tokenizer=tokenizer)
    [failure] = result.details[0].merge_failures
    assert (failure.kind, failure.classified_by) == ("template", how)


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_edited_context_is_other(store, with_tokenizer):
    prompt = encode("user hello world")
    generated = encode("the answer is 42")
    next_prompt = encode("user tool call result") + encode(" the tool says")  # the harness rewrote history
    ingest(store, [call_span("r", 0, prompt, generated), call_span("r", 1, next_prompt, encode(" ok"))])
    finish(store)
    result = assemble(store, store.ready_rollouts(), tokenizer=tiny_tokenizer() if with_tokenizer else None)
    assert [f.kind for f in result.details[0].merge_failures] == ["other"]


def test_truncation_is_explicit_and_counted(store):
    ingest(store, [call_span("long-prompt", 0, list(range(1, 21)), [7, 8])])
    ingest(store, [call_span("long-response", 0, [1, 2], list(range(30, 40)))])
    ingest(store, [call_span("long-total", 0, [1, 2, 3, 4, 5, 6], [7, 8, 9, 10])])
    for rollout_id in ("long-prompt", "long-response", "long-total"):
        finish(store, rollout_id)
    config = AssemblyConfig(max_prompt_length=10, max_response_length=6, max_total_length=8)
    result = assemble(store, store.ready_rollouts(), config)
    by_id = {r.rollout_id: r for r in result.rollouts}
    assert set(by_id) == {"long-response", "long-total"}
    assert by_id["long-response"].samples[0].token_ids.tolist() == [1, 2] + list(range(30, 36))
    assert by_id["long-total"].samples[0].token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert result.report.truncations == {"prompt_too_long": 1, "response_truncated": 1, "total_truncated": 1}
    assert result.report.dropped == {"no_samples": 1}


def test_a_call_cut_away_by_truncation_leaves_the_sample(store):
    ingest(store, [call_span("r", 0, [1, 2], [3, 4]), call_span("r", 1, [1, 2, 3, 4, 5, 6], [7, 8])])
    ingest(store, [reward_span("r", 1.0, call_seq=1)])
    finish(store)
    result = assemble(store, store.ready_rollouts(), AssemblyConfig(max_total_length=5))
    [sample] = result.rollouts[0].samples
    assert sample.token_ids.tolist() == [1, 2, 3, 4, 5] and sample.call_seqs == [0]
    assert result.report.call_problems == {"call_reward_lost": 1}


def test_rewards_final_last_wins_and_per_call_on_the_last_generated_token(store):
    ingest(
        store,
        [
            call_span("r", 0, [1, 2], [3, 4]),
            call_span("r", 1, [1, 2, 3, 4, 5], [6, 7, 8]),
            reward_span("r", 0.1, end_ns=10),
            reward_span("r", 0.9, end_ns=30),
            reward_span("r", 0.5, end_ns=20),
            reward_span("r", 5.0, name="format", end_ns=40),  # another name: kept, not trained on
            reward_span("r", 0.25, call_seq=0),
            reward_span("r", -1.0, call_seq=1),
            reward_span("r", 3.0, call_seq=7),  # no such call
            rollout_span("r"),
        ],
    )
    result = assemble(store, store.ready_rollouts())
    [rollout] = result.rollouts
    assert rollout.reward == 0.9
    [sample] = rollout.samples
    assert sample.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sample.token_rewards.tolist() == [0, 0, 0, 0.25, 0, 0, 0, -1.0]
    assert result.report.call_problems == {"call_reward_lost": 1}
    assert assemble(store, ["r"], AssemblyConfig(reward_name="format")).rollouts[0].reward == 5.0


def test_assembly_hands_over_arrays_of_the_fixed_dtypes_that_pad_as_their_lists_do(store):
    ingest(
        store,
        [
            call_span("r", 0, [1, 2, 3], [4, 5], logprobs=[-0.5, float("nan")], version=2),
            with_attributes(  # generated across a keep switch: version 3, then 4
                call_span("r", 1, [1, 2, 3, 4, 5, 6], [7, 8], logprobs=[-0.25, -0.125], version=3),
                **{semconv.COMPLETION_POLICY_VERSIONS.replace(".", "__"): [0, 3, 1, 4]},
            ),
            reward_span("r", 0.5, call_seq=1),
        ],
    )
    finish(store)
    [rollout] = assemble(store, store.ready_rollouts()).rollouts
    [sample] = rollout.samples
    for name, dtype in PER_TOKEN.items():
        assert getattr(sample, name) is not None and getattr(sample, name).dtype == dtype, name
    assert sample.logprob_known.tolist() == [True] * 3 + [False, False] + [True] * 3  # a NaN: call 0 has no logprobs
    assert sample.token_rewards.tolist() == [0.0] * 7 + [0.5]
    assert sample.after_switch.tolist() == [False] * 7 + [True]
    assert sample.policy_versions.tolist() == [-1, -1, -1, 2, 2, -1, 3, 4]
    as_lists = Sample(
        sample.rollout_id, sample.task_id, call_seqs=sample.call_seqs,
        **{name: getattr(sample, name).tolist() for name in PER_TOKEN},
    )  # fmt: skip
    a = TrainingBatch.from_rollouts([rollout])
    b = TrainingBatch.from_rollouts([dataclasses.replace(rollout, samples=[as_lists])])
    assert all(torch.equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
               if isinstance(getattr(a, f.name), torch.Tensor))  # fmt: skip
    assert a.engine_logprobs[0].tolist() == [0.0] * 6 + [-0.25, -0.125]


def test_policies_for_missing_rewards_and_failed_rollouts(store):
    for rollout_id in ("ok-no-reward", "crashed", "infra", "slow"):
        ingest(store, [call_span(rollout_id, 0, [1], [2])])
    finish(store, "ok-no-reward", reward=None)
    finish(store, "crashed", reward=0.3, status="failed")
    store.mark_harness_exited("infra", None, cause="infra_error")
    store.mark_harness_exited("slow", None, cause="timeout")
    ready = store.ready_rollouts()
    assert len(ready) == 4

    default = assemble(store, ready, record_drops=False)
    assert {r.rollout_id: r.reward for r in default.rollouts} == {"crashed": 0.3}
    assert default.report.dropped == {"no_reward": 2, "cause:infra_error": 1}
    assert {r.rollout_id: r.end_cause for r in default.rollouts} == {"crashed": "harness_error"}

    config = AssemblyConfig(missing_reward=0.0, cause_policy={"harness_error": -1.0, "timeout": "drop"})
    custom = assemble(store, ready, config, record_drops=False)
    assert {r.rollout_id: r.reward for r in custom.rollouts} == {"ok-no-reward": 0.0, "crashed": -1.0}
    assert custom.report.dropped == {"cause:infra_error": 1, "cause:timeout": 1}

    assemble(store, ready, config)  # records its drops: they are not offered again
    assert {r.rollout_id for r in store.ready_rollouts()} == {"ok-no-reward", "crashed"}
    assert store.rollout("infra").dropped_reason == "cause:infra_error"


def test_absent_tokens_and_duplicate_seqs_are_counted(store):
    ingest(
        store,
        [
            call_span("r", 0, [1, 2], [3]),
            call_span("r", 1, [], [], tokens_source="absent"),
            call_span("r", 2, [1, 2, 3, 4], [5], end_ns=1_700_000_000_000_002_000),
            call_span("r", 2, [9, 9], [9], end_ns=1_700_000_000_000_009_000),  # a second span for seq 2
            call_span("r", 3, [1, 2, 3, 4, 5, 6], [7], choices=3),  # n=3: choices 1 and 2 are not trained
        ],
    )
    finish(store)
    result = assemble(store, store.ready_rollouts())
    [sample] = result.rollouts[0].samples
    assert sample.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and sample.call_seqs == [0, 2, 3]
    assert result.report.call_problems == {
        "tokens_absent": 1,
        "duplicate_call_seq": 1,
        "extra_choices_not_trained": 2,
    }


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"missing_reward": "keep"}, "assembly.missing_reward"),
        ({"cause_policy": {"oops": "drop"}}, "unknown cause"),
        ({"cause_policy": {"timeout": "maybe"}}, "assembly.cause_policy.timeout"),
        ({"max_total_length": 0}, "assembly.max_total_length"),
    ],
)
def test_config_errors_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AssemblyConfig(**kwargs)
