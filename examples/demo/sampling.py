"""Batched sampling in one process, for evaluation and in-process references (no server).

    samples = sample_batch(model, prompts, max_tokens=3, eos_ids={2}, pad_id=2, generator=g)
    samples[i].token_ids, samples[i].stopped   # generated ids (EOS included), whether EOS ended it

Prompts may differ in length (left-padded, one KV cache). Rows that produced EOS stop growing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Sample:
    token_ids: list[int]
    stopped: bool  # True: ended with EOS (finish_reason "stop"); False: hit max_tokens ("length")


@torch.inference_mode()
def sample_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    eos_ids: Collection[int],
    pad_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[Sample]:
    from transformers import DynamicCache

    rows, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    eos = torch.as_tensor(sorted(eos_ids), dtype=torch.long)
    cache = DynamicCache()
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    done = torch.zeros(rows, dtype=torch.bool)
    generated = torch.empty((rows, 0), dtype=torch.long)
    alive = torch.empty((rows, 0), dtype=torch.bool)
    inputs = ids
    for _ in range(max_tokens):
        logits = (
            model(
                input_ids=inputs,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                logits_to_keep=1,
            )
            .logits[:, -1, :]
            .float()
        )
        if temperature < 1e-5:
            token = logits.argmax(dim=-1)
        else:
            token = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[
                :, 0
            ]
        alive = torch.cat([alive, ~done[:, None]], dim=1)
        generated = torch.cat([generated, token[:, None]], dim=1)
        done = done | torch.isin(token, eos)
        if bool(done.all()):
            break
        inputs = token[:, None]
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], dim=1)
        positions = positions[:, -1:] + 1
    tokens, kept = generated.tolist(), alive.tolist()
    eos_set = set(eos_ids)
    out = []
    for row in range(rows):
        row_tokens = [t for t, keep in zip(tokens[row], kept[row]) if keep]
        out.append(Sample(row_tokens, bool(row_tokens) and row_tokens[-1] in eos_set))
    return out
