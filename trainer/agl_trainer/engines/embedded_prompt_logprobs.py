"""`prompt_logprobs` on /v1/completions, in vLLM's wire format: per prompt position, None for the
first token, then {token id: {logprob, rank, decoded_token}} holding the prompt's own token and the
`k` most likely ones. One forward over the prompt with the served weights (under the scheduler's
weights lock, so never across a weight update). The canary (loop/canary.py) scores its probes so."""

from __future__ import annotations

from typing import Any

from agl_trainer.engines.embedded_wire import token_text


def prompt_logprobs(
    model: Any, tokenizer: Any, lock: Any, prompt_ids: list[int], k: int, as_token_id: bool
) -> list[dict[str, dict[str, Any]] | None]:
    import torch

    with lock, torch.inference_mode():
        device = next(model.parameters()).device
        logits = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=False).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)[:-1]  # position t predicts token t + 1
    targets = torch.tensor(prompt_ids[1:])
    chosen = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ranks = (logprobs > chosen.unsqueeze(-1)).sum(-1) + 1  # vLLM's rank: 1 is the most likely
    top = torch.topk(logprobs, k=min(k, logprobs.shape[-1]), dim=-1) if k > 0 else None
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for position, token in enumerate(prompt_ids[1:]):
        entry = {str(token): _entry(tokenizer, token, float(chosen[position]), int(ranks[position]), as_token_id)}
        if top is not None:
            for rank, (value, other) in enumerate(zip(top.values[position], top.indices[position]), start=1):
                entry.setdefault(str(int(other)), _entry(tokenizer, int(other), float(value), rank, as_token_id))
        out.append(entry)
    return out


def _entry(tokenizer: Any, token: int, logprob: float, rank: int, as_token_id: bool) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tokenizer, token, as_token_id)[0]}
