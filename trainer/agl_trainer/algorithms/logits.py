"""Per-token quantities from logits: the log-prob of the chosen token, and the entropy."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] without materialising the whole log-softmax ([..., V] -> [...])."""
    logits = logits.float()
    chosen = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis ([..., V] -> [...])."""
    logits = logits.float()
    log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = (logits - log_norm).exp()
    return log_norm.squeeze(-1) - (probs * logits).sum(dim=-1)
