"""Pack a batch's samples into micro-batches by token budget, with little padding.

Rows are filled first-fit decreasing (longest sample first, each into the first row it fits), so a
row holds several short samples back to back; a model that honours position_ids resets (most
transformers models, with attention_mask=None) then attends within each sample only. Rows are
grouped into micro-batches of at most `token_budget` padded positions. Models that do not support
packing get one sample per row, sorted by length so rows of a micro-batch have similar lengths.

A `MicroBatch` remembers, for every position, which [sample, token] of the batch it holds
(`source`, flat index into N*L, -1 for padding), so per-token tensors move in and out by gather.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # [rows, width]
    position_ids: torch.Tensor  # [rows, width], restarting at 0 for each packed sample
    attention_mask: torch.Tensor | None  # [rows, width] when unpacked; None when packed
    source: torch.Tensor  # [rows, width] flat index into the batch's [N * L] tokens; -1 = padding
    num_tokens: int  # real (non-padding) tokens

    @property
    def num_positions(self) -> int:
        return int(self.input_ids.numel())

    def gather(self, per_token: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Batch-shaped [N, L] values -> this micro-batch's [rows, width] layout."""
        flat = per_token.reshape(-1)
        values = flat[self.source.clamp(min=0)]
        return torch.where(self.source >= 0, values, torch.full_like(values, fill))

    def scatter_into(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """Write this micro-batch's [rows, width] values back into batch-shaped `out` [N, L]."""
        real = self.source >= 0
        out.view(-1)[self.source[real]] = values[real].to(out.dtype)


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity; an item longer than capacity gets its own."""
    bins: list[list[int]] = []
    free: list[int] = []
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = lengths[item]
        for slot, room in enumerate(free):
            if size <= room:
                bins[slot].append(item)
                free[slot] -= size
                break
        else:
            bins.append([item])
            free.append(capacity - size)
    return bins


@dataclass(frozen=True)
class ComputeModel:
    """Estimated cost of a forward/backward over `count` rows of `width` positions, in MACs / layer.

    Per position, projections and MLP cost about 16 h^2 and attention 2 W h with dense attention
    (sdpa/eager with a block mask: a row of W positions costs W^2 however many samples it holds);
    with varlen kernels (flash_attention_2) attention is per sample and packing adds none. Each
    micro-batch also pays a fixed overhead (launches, Python), here worth `overhead_positions`."""

    hidden_size: int = 1024
    dense_attention: bool = True
    overhead_positions: int = 256

    def micro_batch(self, count: int, width: int) -> float:
        per_position = 2 * self.hidden_size * (8 * self.hidden_size + (width if self.dense_attention else 0))
        return (count * width + self.overhead_positions) * per_position

    @classmethod
    def of(cls, hidden_size: int, attn_implementation: str | None) -> ComputeModel:
        """The cost model of a model with this hidden size run with this attention implementation."""
        return cls(hidden_size=hidden_size, dense_attention=attn_implementation not in VARLEN_ATTENTION)


# attention whose cost follows each packed sample, not a row's square: flash's varlen kernels, agl's
# own over PyTorch's (backends/varlen_attention.py), and flex_attention, whose block mask (built by
# transformers from restarting position_ids) skips the blocks between samples
VARLEN_ATTENTION = frozenset({"flash_attention_2", "flash_attention_3", "flex_attention", "agl_varlen"})


def group_rows(
    row_lengths: Sequence[int], token_budget: int, compute: ComputeModel | None = None
) -> list[list[int]]:
    """Rows, longest first, cut into consecutive groups (micro-batches) of rows * longest <= budget,
    with the least total estimated cost (dynamic programming over the cut points)."""
    compute = compute or ComputeModel()
    order = sorted(range(len(row_lengths)), key=lambda i: (-row_lengths[i], i))
    n = len(order)
    best = [0.0] + [math.inf] * n  # best[end]: cheapest grouping of order[:end]
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end - 1, -1, -1):
            count, width = end - start, row_lengths[order[start]]
            if count > 1 and count * width > token_budget:
                break  # earlier starts only add rows and width
            total = best[start] + compute.micro_batch(count, width)
            if total < best[end]:
                best[end], cut[end] = total, start
    groups: list[list[int]] = []
    end = n
    while end > 0:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def choose_row_capacity(lengths: Sequence[int], token_budget: int, compute: ComputeModel) -> int:
    """The packed-row length that minimises estimated compute (see ComputeModel): with dense attention
    long rows of short samples waste work on masked attention; with varlen kernels rows fill the budget."""
    longest = max(lengths)
    # a capacity below the longest sample is fine: FFD gives a sample longer than the capacity its own row
    candidates = {longest} | {2**k for k in range(6, 20) if 2**k <= max(token_budget, longest)}

    def cost(capacity: int) -> float:
        row_lengths = [sum(lengths[i] for i in row) for row in first_fit_decreasing(lengths, capacity)]
        groups = group_rows(row_lengths, token_budget, compute)
        return sum(compute.micro_batch(len(group), row_lengths[group[0]]) for group in groups)

    return min(sorted(candidates, reverse=True), key=cost)  # ties: the longer rows


def pack_samples(
    lengths: torch.Tensor | Sequence[int],
    samples: Sequence[int],
    *,
    token_budget: int,
    packed: bool,
    row_capacity: int | None = None,
    compute: ComputeModel | None = None,
) -> list[list[list[int]]]:
    """Which samples go together: micro-batches, each a list of rows, each a list of samples (rows
    of the [N, L] batch, back to back). Both backends cut a batch with this one decision, so the same
    samples share a forward/backward whichever runs it. Each micro-batch holds rows x longest row <=
    token_budget (a sample longer than the budget gets a micro-batch of its own); packed rows are at
    most `row_capacity` long, or the capacity choose_row_capacity picks."""
    if token_budget <= 0:
        raise ValueError(f"token_budget {token_budget} must be positive")
    if not samples:
        return []
    sample_lengths = [int(lengths[s]) for s in samples]
    compute = compute or ComputeModel()
    if packed:
        if row_capacity is None:
            capacity = choose_row_capacity(sample_lengths, token_budget, compute)
        else:
            capacity = min(row_capacity, token_budget)
        rows = [[samples[i] for i in row] for row in first_fit_decreasing(sample_lengths, capacity)]
    else:
        rows = [[s] for s in samples]
    row_lengths = [sum(int(lengths[s]) for s in row) for row in rows]
    return [[rows[r] for r in group] for group in group_rows(row_lengths, token_budget, compute)]


def plan_micro_batches(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    lengths: torch.Tensor,
    samples: Sequence[int],
    *,
    token_budget: int,
    packed: bool,
    row_capacity: int | None = None,
    compute: ComputeModel | None = None,
    pad_token_id: int = 0,
) -> list[MicroBatch]:
    """Micro-batches holding exactly `samples` (rows of the [N, L] batch) as `pack_samples` groups
    them, as tensors: packed rows back to back, padded to the micro-batch's longest row."""
    plan = pack_samples(
        lengths, samples, token_budget=token_budget, packed=packed, row_capacity=row_capacity, compute=compute
    )
    width_of_batch = input_ids.shape[1]
    micro_batches = []
    for group in plan:
        row_lengths = [sum(int(lengths[s]) for s in row) for row in group]
        width = max(row_lengths)
        ids = torch.full((len(group), width), pad_token_id, dtype=input_ids.dtype)
        pos = torch.zeros((len(group), width), dtype=position_ids.dtype)
        source = torch.full((len(group), width), -1, dtype=torch.long)
        for out_row, row in enumerate(group):
            cursor = 0
            for sample in row:
                n = int(lengths[sample])
                ids[out_row, cursor : cursor + n] = input_ids[sample, :n]
                pos[out_row, cursor : cursor + n] = position_ids[sample, :n]
                source[out_row, cursor : cursor + n] = sample * width_of_batch + torch.arange(n)
                cursor += n
            # padding continues as its own "sequence" from position 0, so packed attention keeps it apart
            pos[out_row, cursor:] = torch.arange(width - cursor)
        attention_mask = None if packed else (source >= 0).long()
        micro_batches.append(MicroBatch(ids, pos, attention_mask, source, int((source >= 0).sum())))
    return micro_batches


def split_rollouts(token_counts: Sequence[int], parts: int) -> list[list[int]]:
    """Rollouts (by index) into `parts` groups of similar total tokens; a rollout is never split."""
    parts = max(1, min(parts, len(token_counts)))
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for rollout in sorted(range(len(token_counts)), key=lambda r: (-token_counts[r], r)):
        target = loads.index(min(loads))
        groups[target].append(rollout)
        loads[target] += token_counts[rollout]
    return [sorted(group) for group in groups if group]
