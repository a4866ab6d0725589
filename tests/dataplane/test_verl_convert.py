"""TrainingBatch <-> verl DataProto, checked against verl itself on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from agl_trainer.batch import RolloutResult, Sample, TrainingBatch
from agl_trainer.verl_convert import from_dataproto, to_dataproto


def sample(rollout_id, task_id, prompt, segments, version=0, rewards=None):
    """segments: list of (context tokens, generated tokens) after the prompt."""
    tokens, mask, logprobs, versions = (
        list(prompt),
        [0] * len(prompt),
        [0.0] * len(prompt),
        [-1] * len(prompt),
    )
    for context, generated in segments:
        tokens += context + generated
        mask += [0] * len(context) + [1] * len(generated)
        logprobs += [0.0] * len(context) + [-0.1 * (i + 1) for i in range(len(generated))]
        versions += [-1] * len(context) + [version] * len(generated)
    return Sample(
        rollout_id, task_id, tokens, mask, logprobs, versions, token_rewards=rewards and rewards(len(tokens))
    )


def batch() -> TrainingBatch:
    def call_reward(n):
        out = [0.0] * n
        out[4] = 0.5
        return out

    rollouts = [
        RolloutResult(
            "a",
            "t1",
            1.0,
            [sample("a", "t1", [1, 2, 3], [([], [10, 11]), ([4, 5], [12])], version=2, rewards=call_reward)],
        ),
        RolloutResult(
            "b",
            "t1",
            0.0,
            [
                sample("b", "t1", [1, 2], [([], [13])]),
                sample("b", "t1", [6, 7, 8, 9, 5], [([], [14, 15, 16])], version=1),
            ],
        ),
        RolloutResult("c", "t2", 0.5, [sample("c", "t2", [1], [([], [17, 18]), ([3], [19])])]),
    ]
    return TrainingBatch.from_rollouts(rollouts)


def assert_same(left: TrainingBatch, right: TrainingBatch) -> None:
    for name in (
        "input_ids",
        "attention_mask",
        "position_ids",
        "loss_mask",
        "policy_versions",
        "rollout_index",
        "rollout_group_index",
    ):
        assert torch.equal(getattr(left, name), getattr(right, name)), name
    for name in ("engine_logprobs", "token_rewards", "rollout_rewards"):
        assert torch.allclose(getattr(left, name), getattr(right, name)), name
    assert torch.equal(left.known_logprobs(), right.known_logprobs())
    assert torch.equal(left.switched(), right.switched())
    assert left.rollout_ids == right.rollout_ids and left.task_ids == right.task_ids


def test_layout_is_what_verl_expects():
    from verl import DataProto

    original = batch()
    data = to_dataproto(original)
    assert isinstance(data, DataProto)
    tensors = data.batch
    n, width_p, width_r = 4, 5, 5  # longest prompt: b's second sample; longest response: a's 2 + 2 + 1
    assert tensors["prompts"].shape == (n, width_p) and tensors["responses"].shape == (n, width_r)
    assert torch.equal(tensors["input_ids"], torch.cat([tensors["prompts"], tensors["responses"]], dim=1))
    # row 0 (rollout a): prompt [1, 2, 3] left-padded; response [10, 11, 4, 5, 12] with the tool tokens masked
    assert tensors["prompts"][0].tolist() == [0, 0, 1, 2, 3]
    assert tensors["responses"][0].tolist() == [10, 11, 4, 5, 12]
    assert tensors["response_mask"][0].tolist() == [1, 1, 0, 0, 1]
    assert tensors["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert tensors["position_ids"][0].tolist()[2:] == list(range(8))
    assert tensors["responses"][1].tolist() == [13, 0, 0, 0, 0]  # right padding
    assert tensors["attention_mask"][1].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    assert tensors["old_log_probs"][0].tolist() == pytest.approx([-0.1, -0.2, 0, 0, -0.1])
    # the rollout reward sits on the last trained token; the per-call reward where it was placed
    assert tensors["token_level_rewards"][0].tolist() == pytest.approx([0, 0.5, 0, 0, 1.0])
    assert list(data.non_tensor_batch["uid"]) == ["group-0", "group-0", "group-0", "group-1"]
    assert list(data.non_tensor_batch["rollout_id"]) == ["a", "b", "b", "c"]
    # verl's own response-mask helper sees the same response window
    from verl.trainer.ppo.core_algos import agg_loss

    loss = agg_loss(torch.ones(n, width_r), tensors["response_mask"], "token-mean")
    assert float(loss) == pytest.approx(1.0)


def test_round_trip_through_verl_operations():
    from verl import DataProto

    original = batch()
    original.logprob_known[0, 4] = False  # an unknown engine logprob and a token after a keep switch
    original.after_switch[3, 2] = True  # survive the trip
    data = to_dataproto(original)
    assert_same(from_dataproto(data), original)
    rejoined = DataProto.concat(data.chunk(2))  # what verl does across data-parallel workers
    assert_same(from_dataproto(rejoined), original)
    selected = data.select(
        batch_keys=list(data.batch.keys()), non_tensor_batch_keys=["uid"], meta_info_keys=None
    )
    assert_same(from_dataproto(selected), original)


def test_verl_grpo_runs_on_the_converted_batch():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_policy_loss_vanilla

    data = to_dataproto(batch())
    scores = data.batch["token_level_rewards"]
    mask = data.batch["response_mask"]
    advantages, _ = compute_grpo_outcome_advantage(scores, mask, data.non_tensor_batch["uid"])
    # per row: score = sum of its token rewards; group t1 = rows 0..2, group t2 = row 3 (a singleton)
    row_scores = scores.sum(dim=1)
    group = row_scores[:3]
    expected = (group - group.mean()) / (group.std() + 1e-6)
    assert torch.allclose(
        advantages[:3][mask[:3] > 0], expected.repeat_interleave(mask[:3].sum(1).long()), atol=1e-5
    )
    assert torch.all(advantages[mask == 0] == 0)

    from verl.workers.config import FSDPActorConfig

    config = FSDPActorConfig(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=4, rollout_n=1
    )
    old = data.batch["old_log_probs"]
    loss, _ = compute_policy_loss_vanilla(old, old.clone(), advantages, mask, "token-mean", config)
    # on-policy (ratio 1): the clipped objective is minus the mean advantage over trained tokens
    assert float(loss) == pytest.approx(float(-(advantages * mask).sum() / mask.sum()), abs=1e-5)


def test_advantages_given_per_rollout_are_broadcast_over_trained_tokens():
    original = batch()
    data = to_dataproto(original, advantages=torch.tensor([1.0, -1.0, 0.5]))
    mask = data.batch["response_mask"]
    assert data.batch["advantages"][1].tolist() == (-1.0 * mask[1]).tolist()
    with pytest.raises(ValueError, match="advantages must be"):
        to_dataproto(original, advantages=torch.zeros(7))
    assert np.array_equal(data.non_tensor_batch["task_id"], np.array(["t1", "t1", "t1", "t2"], dtype=object))
