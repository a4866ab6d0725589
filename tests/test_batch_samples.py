"""Sample's per-token fields are numpy arrays of fixed dtypes (agl_trainer/batch.py PER_TOKEN):
lists are still accepted and converted once, bad shapes and values are refused naming the field,
and TrainingBatch.from_rollouts pads them in numpy into the same tensors either way."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from agl_trainer.batch import PER_TOKEN, RolloutResult, Sample, TrainingBatch

NAN = float("nan")


def as_lists(n: int, offset: int) -> dict[str, list]:
    """One sample's per-token values as Python lists, every optional field given, with a NaN logprob."""
    prompt = n // 2
    return {
        "token_ids": [offset + i for i in range(n)],
        "loss_mask": [0] * prompt + [1] * (n - prompt),
        "engine_logprobs": [0.0] * prompt + [NAN] + [-0.1 * (i + 1) for i in range(n - prompt - 1)],
        "policy_versions": [-1] * prompt + [offset % 5] * (n - prompt),
        "token_rewards": [0.0] * (n - 1) + [0.25 * offset],
        "logprob_known": [1] * prompt + [0] + [1] * (n - prompt - 1),
        "after_switch": [0] * (n - 1) + [1],
    }


def rollouts(arrays: bool) -> list[RolloutResult]:
    out = []
    for index, sizes in enumerate([(7, 12), (3,), (20, 5, 9)]):
        samples = []
        for k, n in enumerate(sizes):
            fields = as_lists(n, 100 * index + k)
            if arrays:
                fields = {name: np.asarray(values, PER_TOKEN[name]) for name, values in fields.items()}
            samples.append(Sample(f"r{index}", f"t{index % 2}", call_seqs=[k], **fields))
        out.append(RolloutResult(f"r{index}", f"t{index % 2}", float(index), samples))
    return out


def test_lists_are_converted_to_the_fixed_dtypes_and_arrays_of_them_are_kept_without_a_copy():
    from_lists = rollouts(arrays=False)[0].samples[0]
    for name, dtype in PER_TOKEN.items():
        assert getattr(from_lists, name).dtype == dtype, name
    ids = np.arange(5, dtype=np.int32)
    sample = Sample("r", "t", ids, np.ones(5, bool), np.zeros(5, np.float32), np.zeros(5, np.int64))
    assert sample.token_ids is ids  # converted once: an array already of its dtype is not copied


def test_a_sample_from_lists_and_one_from_arrays_give_the_same_training_batch():
    lists, arrays = rollouts(arrays=False), rollouts(arrays=True)
    assert [r.samples for r in lists] == [r.samples for r in arrays]
    a, b = TrainingBatch.from_rollouts(lists, pad_token_id=9), TrainingBatch.from_rollouts(arrays, pad_token_id=9)
    for name in ("input_ids", "attention_mask", "position_ids", "loss_mask", "engine_logprobs", "policy_versions",
                 "token_rewards", "rollout_index", "rollout_rewards", "rollout_group_index", "logprob_known",
                 "after_switch"):  # fmt: skip
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.rollout_ids == b.rollout_ids and a.task_ids == b.task_ids


def test_the_padded_batch_holds_each_sample_value_for_value():
    rollout = rollouts(arrays=False)
    batch = TrainingBatch.from_rollouts(rollout, pad_token_id=9)
    samples = [s for r in rollout for s in r.samples]
    assert batch.input_ids.shape == (len(samples), 20) and batch.input_ids.dtype == torch.long
    for row, sample in enumerate(samples):
        n = sample.token_ids.size
        values = as_lists(n, int(sample.token_ids[0]))
        assert batch.input_ids[row].tolist() == values["token_ids"] + [9] * (20 - n)
        assert batch.attention_mask[row].tolist() == [1] * n + [0] * (20 - n)
        assert batch.position_ids[row].tolist() == list(range(n)) + [n - 1] * (20 - n)
        assert batch.loss_mask[row].tolist() == values["loss_mask"] + [0] * (20 - n)
        assert batch.policy_versions[row].tolist() == values["policy_versions"] + [-1] * (20 - n)
        assert batch.token_rewards[row].tolist() == values["token_rewards"] + [0.0] * (20 - n)
        assert batch.after_switch[row].tolist() == [bool(v) for v in values["after_switch"]] + [False] * (20 - n)
        # the NaN logprob is unknown and 0.0; every other one is the engine's, rounded to float32 once
        known = [bool(k) and math.isfinite(v) for k, v in zip(values["logprob_known"], values["engine_logprobs"])]
        assert batch.logprob_known[row].tolist() == known + [True] * (20 - n)
        expected = [float(np.float32(v)) if k else 0.0 for v, k in zip(values["engine_logprobs"], known)]
        assert batch.engine_logprobs[row].tolist() == expected + [0.0] * (20 - n)


def make(**changes) -> Sample:
    fields = {"token_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "engine_logprobs": [0.0, -1.0, -2.0],
              "policy_versions": [-1, 0, 0], **changes}  # fmt: skip
    return Sample("r7", "t", **fields)


@pytest.mark.parametrize("name", ["loss_mask", "engine_logprobs", "policy_versions", "token_rewards",
                                  "logprob_known", "after_switch"])  # fmt: skip
def test_a_per_token_field_of_another_length_is_refused_naming_it(name):
    with pytest.raises(ValueError, match=rf"Sample r7: token_ids has 3 tokens but {{'{name}': 2}}"):
        make(**{name: [0, 1]})


@pytest.mark.parametrize("name", list(PER_TOKEN))
def test_a_2d_field_is_refused_naming_it(name):
    message = rf"Sample r7: {name} must be 1-D \(one value per token\), got shape \(1, 3\)"
    with pytest.raises(ValueError, match=message):
        make(**{name: [[0, 1, 1]]})


@pytest.mark.parametrize(
    ("name", "values", "message"),
    [
        ("token_ids", [1, 2, 2**31], r"token_ids\[2\] = 2147483648 is not exactly representable as int32"),
        ("token_ids", [1, 2.5, 3], r"token_ids\[1\] = 2.5 is not exactly representable as int32"),
        ("loss_mask", [0, 2, 1], r"loss_mask\[1\] = 2 is not exactly representable as bool"),
        ("policy_versions", ["a", "b", "c"], r"policy_versions must hold numbers"),
        ("engine_logprobs", [0.0, None, -1.0], r"engine_logprobs must hold numbers"),
        ("loss_mask", [[0, 1], [1]], r"loss_mask must be a flat list or 1-D array of numbers"),
        ("token_ids", None, r"token_ids must be 1-D \(one value per token\), got shape \(\)"),  # required
    ],
)
def test_a_value_the_dtype_cannot_hold_exactly_or_a_ragged_or_missing_field_is_refused_naming_it(name, values, message):
    with pytest.raises(ValueError, match=rf"Sample r7: {message}"):
        make(**{name: values})


def test_an_assignment_converts_and_a_wrong_length_is_refused_leaving_the_sample_as_it_was():
    sample = make()
    sample.loss_mask = [1, 0, 1]
    assert sample.loss_mask.dtype == np.bool_ and sample.loss_mask.tolist() == [True, False, True]
    with pytest.raises(ValueError, match=r"token_ids has 3 tokens but \{'token_rewards': 4\}"):
        sample.token_rewards = [0.0, 0.0, 0.0, 1.0]
    assert sample.token_rewards is None


def test_python_sum_of_a_long_mask_counts_every_token():
    sample = make(token_ids=list(range(300)), loss_mask=[1] * 300, engine_logprobs=[0.0] * 300,
                  policy_versions=[0] * 300)  # fmt: skip
    assert sum(sample.loss_mask) == 300 == sample.num_trained_tokens  # an int8 mask would wrap at 128


def test_samples_compare_by_value_and_survive_pickling():
    sample = make(engine_logprobs=[NAN, -1.0, -2.0])
    assert sample == make(engine_logprobs=np.array([NAN, -1.0, -2.0], np.float32))  # NaN equals NaN here
    assert sample != make(engine_logprobs=[NAN, -1.0, -2.5])
    assert sample != make(engine_logprobs=[NAN, -1.0, -2.0], after_switch=[0, 0, 0])  # None is not all-zero
    copy = pickle.loads(pickle.dumps(sample))
    assert copy == sample and copy.token_ids.dtype == np.int32
    with pytest.raises(ValueError, match="token_ids has 3 tokens"):
        copy.loss_mask = [1]  # still checked after unpickling
