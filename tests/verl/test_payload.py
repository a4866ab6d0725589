"""How the driver deals rows to data-parallel ranks and lays out per-token values for verl."""

from __future__ import annotations

import torch
from agl_trainer.backends.verl.payload import (
    PADDING_ROW,
    deal_rows,
    order_micro_batches,
    payload,
    scatter_logprobs,
    shift_to_logits,
)

from tests.algorithms.tiny import random_batch


def test_rows_are_dealt_in_equal_numbers_balanced_by_tokens_with_padding_rows():
    lengths = torch.tensor([50, 40, 30, 20, 10, 5, 5])
    parts = deal_rows(list(range(7)), lengths, 2)
    assert [len(p) for p in parts] == [4, 4]
    real = [[r for r in p if r != PADDING_ROW] for p in parts]
    assert (
        sorted(r for p in real for r in p) == list(range(7)) and sum(p.count(PADDING_ROW) for p in parts) == 1
    )
    loads = [int(lengths[p].sum()) for p in real]
    assert abs(loads[0] - loads[1]) <= 10
    assert deal_rows([3], lengths, 4) == [[3], [PADDING_ROW], [PADDING_ROW], [PADDING_ROW]]


def test_values_move_to_the_logit_position_that_predicts_their_token():
    assert shift_to_logits(torch.tensor([1.0, 2.0, 3.0])).tolist() == [2.0, 3.0, 0.0]
    batch = random_batch(num_tasks=1, per_task=2, seed=3)
    lengths = batch.attention_mask.sum(-1)
    rows = [1, PADDING_ROW, 0]
    sent = payload(batch, lengths, rows, per_token={"w": batch.loss_mask.float()})
    assert sent["lengths"].tolist() == [int(lengths[1]), 1, int(lengths[0])]
    n1 = int(lengths[1])
    assert torch.equal(sent["input_ids"][:n1], batch.input_ids[1, :n1])
    assert torch.equal(sent["w"][: n1 - 1], batch.loss_mask[1, 1:n1].float())
    assert float(sent["w"][n1]) == 0.0  # the padding row trains nothing
    # log-probs come back at logit positions and land on the token they score
    flat = torch.arange(int(sent["lengths"].sum()), dtype=torch.float32)
    out = torch.zeros(batch.input_ids.shape)
    scatter_logprobs(out, lengths, rows, flat)
    assert out[1, 0] == 0 and out[1, 1] == flat[0] and out[1, n1 - 1] == flat[n1 - 2]
    assert out[0, 1] == flat[n1 + 1]


def test_micro_batches_group_similar_lengths_and_every_rank_gets_as_many():
    lengths = torch.tensor([100, 96, 10, 9, 8, 7, 50])
    rows, counts = order_micro_batches([[0, 1, 2, 3], [4, 5, 6, PADDING_ROW]], lengths, token_budget=200)
    assert [len(c) for c in counts] == [len(counts[0])] * 2  # the same number of micro-batches per rank
    for rank_rows, rank_counts in zip(rows, counts, strict=True):
        assert sum(rank_counts) == len(rank_rows)
        cursor = 0
        for count in rank_counts:
            group = [int(lengths[r]) if r != PADDING_ROW else 1 for r in rank_rows[cursor : cursor + count]]
            assert count * max(group) <= 200 or count == 1  # padded size within the budget
            cursor += count
    assert sorted(r for r in rows[0] if r != PADDING_ROW) == [0, 1, 2, 3]
    assert rows[0][:2] == [0, 1]  # the two long rows together, the short ones apart from them
