"""Log-probs and entropy of the scored tokens from their logits, a chunk of positions at a time.

The output head gives logits [K, V] for the K scored positions (bfloat16 under autocast on a GPU).
Log-softmax and entropy work in float32, and autograd would keep their [K, V] float32 tensors (the
upcast logits, the probabilities, their product) for the backward: with Qwen's 151,936-token
vocabulary and a few thousand scored tokens per micro-batch, gigabytes each. Here each chunk of
positions goes through the same functions (`token_logprobs`, `token_entropy`) under activation
checkpointing: the forward keeps only the head's own logits, the backward recomputes one chunk's
float32 work at a time, and the chunks' gradients meet in one [K, V] tensor of the logits' dtype
(what the head's matmul backward takes anyway). So no float32 [K, V] tensor exists whole, and the
values and gradients equal the unchunked ones exactly: every row sees the same operations (its
reductions run over its own vocabulary row), and the head's matmul is not split.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from agl_trainer.algorithms import token_entropy, token_logprobs

# logits per chunk: 64 Mi elements (256 MiB in float32); 441 positions of a 151,936-token vocabulary
CHUNK_ELEMENTS = 1 << 26


def chunk_positions(vocab_size: int, chunk_tokens: int | None = None) -> int:
    """Positions per chunk: `chunk_tokens`, or as many as keep a chunk within CHUNK_ELEMENTS."""
    return chunk_tokens if chunk_tokens else max(1, CHUNK_ELEMENTS // max(vocab_size, 1))


def chunk_sizes(positions: int, rows: int) -> list[int]:
    """`positions` cut into chunks of `rows`, none of a single row unless there is one position: torch
    reduces a lone row in parallel over the vocabulary (another summation order than the same row among
    others, which each thread reduces whole), so a one-row chunk would not be bit-identical."""
    rows = max(rows, 2)
    if positions <= rows:
        return [positions]
    sizes = [rows] * (positions // rows)
    rest = positions % rows
    if rest == 1:
        sizes[-1] += 1
    elif rest:
        sizes.append(rest)
    return sizes


def token_outputs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    chunk_tokens: int | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) [K] (float32, with its graph when grad is enabled) and, `with_entropy`, the
    entropy [K] (with a graph only when `entropy_grad`), of softmax(logits / temperature), from logits
    [K, V], `chunk_tokens` positions at a time (default: chunk_positions)."""
    entropy_grad = entropy_grad and torch.is_grad_enabled()
    sizes = chunk_sizes(logits.shape[0], chunk_positions(logits.shape[-1], chunk_tokens))
    if len(sizes) == 1:
        return _outputs(logits, labels, with_entropy, entropy_grad, temperature)
    recompute = torch.is_grad_enabled() and logits.requires_grad
    log_probs, entropies = [], []
    for chunk, chunk_labels in zip(torch.split(logits, sizes), torch.split(labels, sizes), strict=True):
        if recompute:
            log_prob, entropy = checkpoint(
                _outputs, chunk, chunk_labels, with_entropy, entropy_grad, temperature, use_reentrant=False
            )
        else:
            log_prob, entropy = _outputs(chunk, chunk_labels, with_entropy, entropy_grad, temperature)
        log_probs.append(log_prob)
        entropies.append(entropy)
    entropy = torch.cat(entropies) if with_entropy else None
    return torch.cat(log_probs), entropy


def _outputs(
    logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool, entropy_grad: bool, temperature: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if temperature != 1.0:  # in float32, as token_logprobs works: the scaled copy is one chunk's
        logits = logits.float() / temperature
    log_prob = token_logprobs(logits, labels)
    if not with_entropy:
        return log_prob, None
    with torch.set_grad_enabled(entropy_grad):
        return log_prob, token_entropy(logits)
