"""Driver side of a worker call: which rows each data-parallel rank gets, and the tensors it gets.

Rows are dealt to ranks in equal numbers (verl's micro-batcher wants every rank to take part in
each collective), balanced by tokens (longest first, to the lightest rank with room). When the rows
do not divide by the DP size, padding rows fill up: one token, nothing trained, zero weight.

Per-token values travel concatenated over a rank's rows (verl's no-padding layout, `lengths` says
where rows end). Values about a trained token t are placed at t - 1, the logit position that
predicts it, which is where verl's log-probs come out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agl_trainer.backends.packing import group_rows
from agl_trainer.batch import TrainingBatch

PADDING_ROW = -1


def deal_rows(samples: Sequence[int], lengths: torch.Tensor, dp_size: int) -> list[list[int]]:
    """`samples` split into dp_size lists of equal length (PADDING_ROW fills up), similar token totals."""
    per_rank = -(-len(samples) // dp_size)
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for sample in sorted(samples, key=lambda s: (-int(lengths[s]), s)):
        open_ranks = [r for r in range(dp_size) if len(parts[r]) < per_rank]
        rank = min(open_ranks, key=lambda r: (loads[r], r))
        parts[rank].append(sample)
        loads[rank] += int(lengths[sample])
    for part in parts:
        part.sort()
        part.extend([PADDING_ROW] * (per_rank - len(part)))
    return parts


def order_micro_batches(
    parts: Sequence[Sequence[int]], lengths: torch.Tensor, token_budget: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Each rank's rows cut into micro-batches of similar lengths (agl's `group_rows`: longest first,
    rows x longest <= token_budget, least estimated compute), so verl's padded forward pads little.
    Every rank gets the same number (FSDP's collectives run once per micro-batch on every rank):
    a rank with fewer gets one-padding-row micro-batches. Returns (rows in micro-batch order, the
    row count of each micro-batch), per rank."""
    plans = []
    for rows in parts:
        row_lengths = [1 if row == PADDING_ROW else int(lengths[row]) for row in rows]
        plans.append([[rows[i] for i in group] for group in group_rows(row_lengths, token_budget)])
    count = max(len(plan) for plan in plans)
    for plan in plans:
        plan.extend([[PADDING_ROW] for _ in range(count - len(plan))])
    return [[row for group in plan for row in group] for plan in plans], [
        [len(g) for g in plan] for plan in plans
    ]


def shift_to_logits(row_values: torch.Tensor) -> torch.Tensor:
    """[n] values per token -> [n] values per logit position (value of token t + 1 at t; last is 0)."""
    out = torch.zeros_like(row_values)
    out[:-1] = row_values[1:]
    return out


def payload(
    batch: TrainingBatch,
    lengths: torch.Tensor,
    rows: Sequence[int],
    *,
    per_token: dict[str, torch.Tensor] | None = None,
    current_version: int | None = None,
) -> dict[str, object]:
    """One rank's call arguments. `per_token` holds [N, L] tensors in batch layout, shifted here;
    `current_version` (the loop's policy version) for a training call."""
    per_token = per_token or {}
    ids, positions, trained, row_lengths = [], [], [], []
    values: dict[str, list[torch.Tensor]] = {name: [] for name in per_token}
    for row in rows:
        if row == PADDING_ROW:
            ids.append(batch.input_ids[0, :1])
            positions.append(torch.zeros(1, dtype=torch.long))
            trained.append(torch.zeros(1))
            row_lengths.append(1)
            for name, tensor in per_token.items():
                values[name].append(torch.zeros(1, dtype=tensor.dtype))
            continue
        n = int(lengths[row])
        ids.append(batch.input_ids[row, :n])
        positions.append(batch.position_ids[row, :n])
        trained.append(shift_to_logits(batch.loss_mask[row, :n].float()))
        row_lengths.append(n)
        for name, tensor in per_token.items():
            values[name].append(shift_to_logits(tensor[row, :n]))
    out: dict[str, object] = {
        "lengths": torch.tensor(row_lengths, dtype=torch.long),
        "input_ids": torch.cat(ids).long(),
        "position_ids": torch.cat(positions).long(),
        "loss_mask": torch.cat(trained),
    }
    if current_version is not None:
        out["current_version"] = current_version
    for name, parts in values.items():
        out[name] = torch.cat(parts)
    return out


def scatter_logprobs(
    out: torch.Tensor, lengths: torch.Tensor, rows: Sequence[int], flat: torch.Tensor
) -> None:
    """Write a rank's log-probs (logit-position layout, rows concatenated) into [N, L] `out`."""
    cursor = 0
    for row in rows:
        if row == PADDING_ROW:
            cursor += 1
            continue
        n = int(lengths[row])
        out[row, 1:n] = flat[cursor : cursor + n - 1]
        cursor += n
