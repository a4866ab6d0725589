"""How the driver deals samples to data-parallel ranks, cuts them into micro-batches (the torch
backend's packing) and lays out per-token values for verl."""

from __future__ import annotations

from pathlib import Path

import torch
from agl_trainer.backends import TorchBackend
from agl_trainer.backends.packing import ComputeModel, pack_samples
from agl_trainer.backends.verl.payload import (
    PADDING_ROW,
    deal_rows,
    flat_samples,
    payload,
    plan_ranks,
    scatter_logprobs,
    shift_to_logits,
)

from tests.algorithms.tiny import random_batch, training_config


def packer(lengths: torch.Tensor, budget: int, packed: bool = True):
    compute = ComputeModel(hidden_size=64)
    return lambda samples: pack_samples(lengths, samples, token_budget=budget, packed=packed, compute=compute)


def test_samples_are_dealt_balanced_by_tokens():
    lengths = torch.tensor([50, 40, 30, 20, 10, 5, 5])
    parts = deal_rows(list(range(7)), lengths, 2)
    assert sorted(r for p in parts for r in p) == list(range(7))
    loads = [int(lengths[p].sum()) for p in parts]
    assert abs(loads[0] - loads[1]) <= 10
    assert all(p == sorted(p) for p in parts)
    assert deal_rows([3], lengths, 4) == [[3], [], [], []]
    assert deal_rows(list(range(7)), lengths, 1) == [list(range(7))]


def test_every_rank_runs_as_many_micro_batches_padding_ones_included():
    lengths = torch.tensor([100, 96, 10, 9, 8, 7, 50])
    plans = plan_ranks(list(range(7)), lengths, 2, packer(lengths, 120, packed=False))
    assert len(plans[0]) == len(plans[1]) >= 2
    assert sorted(s for plan in plans for s in flat_samples(plan) if s != PADDING_ROW) == list(range(7))
    for plan in plans:
        for micro in plan:
            widths = [sum(1 if s == PADDING_ROW else int(lengths[s]) for s in row) for row in micro]
            assert len(micro) * max(widths) <= 120 or len(micro) == 1  # padded size within the budget
    # a batch smaller than the DP group: the idle ranks run one padding row per micro-batch
    lonely = plan_ranks([6], lengths, 3, packer(lengths, 120))
    assert lonely[0] == [[[6]]] and lonely[1] == lonely[2] == [[[PADDING_ROW]]]


def test_values_move_to_the_logit_position_that_predicts_their_token():
    assert shift_to_logits(torch.tensor([1.0, 2.0, 3.0])).tolist() == [2.0, 3.0, 0.0]
    batch = random_batch(num_tasks=1, per_task=2, seed=3)
    lengths = batch.attention_mask.sum(-1)
    plan = [[[1], [PADDING_ROW]], [[0]]]
    sent = payload(batch, lengths, plan, per_token={"w": batch.loss_mask.float()})
    assert sent["lengths"].tolist() == [int(lengths[1]), 1, int(lengths[0])]
    assert sent["micro_rows"] == [2, 1]
    n1 = int(lengths[1])
    assert torch.equal(sent["input_ids"][:n1], batch.input_ids[1, :n1])
    assert torch.equal(sent["w"][: n1 - 1], batch.loss_mask[1, 1:n1].float())
    assert float(sent["w"][n1]) == 0.0  # the padding row trains nothing
    # log-probs come back at logit positions and land on the token they score
    flat = torch.arange(int(sent["lengths"].sum()), dtype=torch.float32)
    out = torch.zeros(batch.input_ids.shape)
    scatter_logprobs(out, lengths, flat_samples(plan), flat)
    assert out[1, 0] == 0 and out[1, 1] == flat[0] and out[1, n1 - 1] == flat[n1 - 2]
    assert out[0, 1] == flat[n1 + 1]


def test_a_packed_row_is_one_nested_row_of_its_samples_back_to_back():
    batch = random_batch(num_tasks=2, per_task=2, seed=5)
    lengths = batch.attention_mask.sum(-1)
    plan = [[[2, 0], [1]], [[3]]]
    sent = payload(batch, lengths, plan, per_token={"w": batch.loss_mask.float()})
    n0, n1, n2, n3 = (int(lengths[s]) for s in range(4))
    assert sent["lengths"].tolist() == [n2 + n0, n1, n3] and sent["micro_rows"] == [2, 1]
    # positions restart at the second sample of the packed row: that is what keeps them apart
    assert torch.equal(sent["position_ids"][n2 : n2 + n0], batch.position_ids[0, :n0])
    # the first sample's last position predicts nothing (the roll would give it the next sample's token)
    assert float(sent["w"][n2 - 1]) == 0.0 and float(sent["loss_mask"][n2 - 1]) == 0.0
    flat = torch.arange(int(sent["lengths"].sum()), dtype=torch.float32)
    out = torch.zeros(batch.input_ids.shape)
    scatter_logprobs(out, lengths, flat_samples(plan), flat)
    assert out[0, 1] == flat[n2] and out[1, 1] == flat[n2 + n0] and out[3, 1] == flat[n2 + n0 + n1]


def _torch_micro_batches(backend: TorchBackend, batch, samples: list[int]) -> list[list[list[int]]]:
    """The samples of each row of each micro-batch the torch backend runs, read back from its tensors."""
    lengths = batch.attention_mask.sum(-1)
    width = batch.input_ids.shape[1]
    plan = []
    for micro in backend._plan(batch, lengths, samples):
        rows = []
        for row in micro.source:
            real = row[row >= 0]
            rows.append(list(dict.fromkeys(int(s) // width for s in real)))  # in order, each sample once
        plan.append(rows)
    return plan


def test_both_backends_cut_a_batch_into_the_same_micro_batches(tiny_model: Path):
    """The verl driver's plan at one data-parallel rank is the torch backend's micro-batches (the
    same samples in the same rows of the same micro-batches); at two ranks each rank's share is cut
    by the same rule and together they hold every sample once."""
    batch = random_batch(num_tasks=6, per_task=4, seed=7, max_calls=3, max_len=40)
    lengths = batch.attention_mask.sum(-1)
    samples = list(range(batch.num_samples))
    for budget in (64, 160, 4096):
        backend = TorchBackend(training_config(tiny_model, micro_batch_tokens=budget))
        assert backend.packed  # the tiny Qwen2 keeps packed samples apart
        want = _torch_micro_batches(backend, batch, samples)
        pack = lambda part, b=backend: pack_samples(  # noqa: E731 - the verl driver's rule, as VerlBackend.plan
            lengths, part, token_budget=b.config.micro_batch_tokens, packed=b.packed,
            row_capacity=b.config.max_row_tokens, compute=b.compute_model,
        )  # fmt: skip
        (got,) = plan_ranks(samples, lengths, 1, pack)
        assert got == want, budget
        assert any(len(row) > 1 for micro in got for row in micro)  # rows really hold several samples
        two = plan_ranks(samples, lengths, 2, pack)
        assert len(two[0]) == len(two[1])
        assert sorted(s for plan in two for s in flat_samples(plan) if s != PADDING_ROW) == samples
