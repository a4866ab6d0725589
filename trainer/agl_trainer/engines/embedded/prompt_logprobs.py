"""`prompt_logprobs` on /v1/completions, in vLLM's wire format: per prompt position, None for the
first token, then {token id: {logprob, rank, decoded_token}} holding the prompt's own token and the
`k` most likely ones. Prompts of one length share a forward, run with the served weights under the
scheduler's weights lock (never across a weight update). The canary (loop/canary.py) scores its
probes so."""

from __future__ import annotations

from typing import Any

from agl_trainer.engines.embedded.wire import token_text

Scored = list[dict[str, dict[str, Any]] | None]


def prompt_logprobs(
    model: Any, tokenizer: Any, lock: Any, prompts: list[list[int]], k: int, as_token_id: bool
) -> list[Scored]:
    import torch

    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    out: list[Scored] = [[None] for _ in prompts]
    for indices in by_length.values():
        ids = torch.tensor([prompts[i] for i in indices])
        with lock, torch.inference_mode():
            logits = model(input_ids=ids.to(next(model.parameters()).device), use_cache=False).logits
        logprobs = torch.log_softmax(logits.float().cpu(), dim=-1)[:, :-1]  # position t predicts t + 1
        for row, index in enumerate(indices):
            out[index] = _scored(tokenizer, logprobs[row], prompts[index], k, as_token_id)
    return out


def _scored(tokenizer: Any, logprobs: Any, prompt: list[int], k: int, as_token_id: bool) -> Scored:
    import torch

    targets = torch.tensor(prompt[1:], dtype=torch.long)
    chosen = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ranks = (logprobs > chosen.unsqueeze(-1)).sum(-1) + 1  # vLLM's rank: 1 is the most likely
    top = torch.topk(logprobs, k=min(k, logprobs.shape[-1]), dim=-1) if k > 0 else None
    out: Scored = [None]
    for position, token in enumerate(prompt[1:]):
        entry = {str(token): _entry(tokenizer, token, float(chosen[position]), int(ranks[position]), as_token_id)}
        if top is not None:
            for rank, (value, other) in enumerate(zip(top.values[position], top.indices[position]), start=1):
                entry.setdefault(str(int(other)), _entry(tokenizer, int(other), float(value), rank, as_token_id))
        out.append(entry)
    return out


def _entry(tokenizer: Any, token: int, logprob: float, rank: int, as_token_id: bool) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tokenizer, token, as_token_id)[0]}
