"""Driver side of a worker call: which samples each data-parallel rank gets, in which micro-batches,
and the tensors it gets.

Samples are dealt to ranks balanced by tokens (longest first, to the lightest rank). Each rank's
samples are then cut into micro-batches by `packing.pack_samples`, the torch backend's own decision:
micro-batches of rows, a row holding several samples back to back (position_ids restarting) where
the model keeps packed samples apart. So at one data-parallel rank verl runs exactly the torch
backend's micro-batches. Every rank runs the same number of micro-batches (FSDP's collectives run
once per micro-batch on every rank): a rank with fewer gets micro-batches of one padding row (one
token, nothing trained, zero weight).

A packed row is one of verl's nested rows: values travel concatenated over a rank's samples in
micro-batch, row, sample order (verl's no-padding layout; `lengths` says where rows end). Values
about a trained token t are placed at t - 1, the logit position that predicts it, which is where
verl's log-probs come out; a sample's last position is never trained, so the label verl's roll
gives it (the next sample's first token) is never read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from agl_trainer.batch import TrainingBatch

PADDING_ROW = -1
Plan = list[list[list[int]]]  # micro-batches -> rows -> samples (batch rows; PADDING_ROW)


def deal_rows(samples: Sequence[int], lengths: torch.Tensor, dp_size: int) -> list[list[int]]:
    """`samples` split into dp_size lists of similar token totals (longest first, to the lightest
    rank; ties to the rank with fewer samples), each sorted."""
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for sample in sorted(samples, key=lambda s: (-int(lengths[s]), s)):
        rank = min(range(dp_size), key=lambda r: (loads[r], len(parts[r]), r))
        parts[rank].append(sample)
        loads[rank] += int(lengths[sample])
    return [sorted(part) for part in parts]


def plan_ranks(
    samples: Sequence[int],
    lengths: torch.Tensor,
    dp_size: int,
    pack: Callable[[list[int]], Plan],
) -> list[Plan]:
    """Each data-parallel rank's micro-batches: its dealt samples cut by `pack` (the backends' shared
    `pack_samples`), padded to the same count on every rank with one-padding-row micro-batches."""
    plans = [pack(part) if part else [] for part in deal_rows(samples, lengths, dp_size)]
    count = max(1, max(len(plan) for plan in plans))
    for plan in plans:
        plan.extend([[PADDING_ROW]] for _ in range(count - len(plan)))
    return plans


def flat_samples(plan: Plan) -> list[int]:
    """The plan's samples in the order their values travel (micro-batch, row, sample)."""
    return [sample for micro in plan for row in micro for sample in row]


def shift_to_logits(row_values: torch.Tensor) -> torch.Tensor:
    """[n] values per token -> [n] values per logit position (value of token t + 1 at t; last is 0)."""
    out = torch.zeros_like(row_values)
    out[:-1] = row_values[1:]
    return out


def payload(
    batch: TrainingBatch,
    lengths: torch.Tensor,
    plan: Plan,
    *,
    per_token: dict[str, torch.Tensor] | None = None,
    current_version: int | None = None,
) -> dict[str, object]:
    """One rank's call arguments for its micro-batches `plan`. `per_token` holds [N, L] tensors in
    batch layout, shifted here; `current_version` (the loop's policy version) for a training call.
    `lengths` of the payload are its nested rows' (packed rows), `micro_rows` the rows of each
    micro-batch."""
    per_token = per_token or {}
    ids, positions, trained, row_lengths = [], [], [], []
    values: dict[str, list[torch.Tensor]] = {name: [] for name in per_token}
    for micro in plan:
        for row in micro:
            row_length = 0
            for sample in row:
                if sample == PADDING_ROW:
                    ids.append(batch.input_ids[0, :1])
                    positions.append(torch.zeros(1, dtype=torch.long))
                    trained.append(torch.zeros(1))
                    row_length += 1
                    for name, tensor in per_token.items():
                        values[name].append(torch.zeros(1, dtype=tensor.dtype))
                    continue
                n = int(lengths[sample])
                ids.append(batch.input_ids[sample, :n])
                positions.append(batch.position_ids[sample, :n])
                trained.append(shift_to_logits(batch.loss_mask[sample, :n].float()))
                row_length += n
                for name, tensor in per_token.items():
                    values[name].append(shift_to_logits(tensor[sample, :n]))
            row_lengths.append(row_length)
    out: dict[str, object] = {
        "lengths": torch.tensor(row_lengths, dtype=torch.long),
        "micro_rows": [len(micro) for micro in plan],
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
    """Write a rank's log-probs (logit-position layout, its samples concatenated in `rows`' order,
    `flat_samples` of its plan) into [N, L] `out`."""
    cursor = 0
    for row in rows:
        if row == PADDING_ROW:
            cursor += 1
            continue
        n = int(lengths[row])
        out[row, 1:n] = flat[cursor : cursor + n - 1]
        cursor += n
