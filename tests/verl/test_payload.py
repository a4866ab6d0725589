"""How the driver deals rows to data-parallel ranks and lays out per-token values for verl."""

from __future__ import annotations

import torch
from agl_trainer.backends.verl.payload import (
    PADDING_ROW,
    deal_rows,
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
    sent = payload(batch, lengths, rows, max_token_len=99, per_token={"w": batch.loss_mask.float()})
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
