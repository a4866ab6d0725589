"""`attn_implementation: agl_varlen`: attention over packed rows, each sample attending to itself only,
at the cost of its own length (PyTorch's variable-length flash attention), with no flash-attn package.

Packed rows (backends/packing.py) hold several samples back to back, told apart by position_ids
restarting. transformers' `sdpa` then builds a block-diagonal [width x width] mask, and the fused
kernel computes every block of it (what ComputeModel calls dense attention, which is why rows are
kept short); flash_attention_2's varlen kernel skips the blocks between samples but needs the
flash-attn package (not on every GPU image). This implementation gives transformers an attention
function that cuts the row into samples where position_ids stop increasing by one (the rule
transformers uses for packed rows), and runs `torch.nn.attention.varlen.varlen_attn` over them:
queries, keys and values of the whole micro-batch as [tokens, heads, dim] with cumulative sample
lengths. Padding at a row's end (positions restarting from 0, or all 0 in verl's padded layout) is
a sample of its own; nothing reads its outputs.

On the CPU (no varlen kernel there) each sample goes through scaled_dot_product_attention alone:
the same math, slowly; what the tests use. It is for training forwards only: no KV cache, no
sliding window or soft-capping (the function refuses them).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

NAME = "agl_varlen"


def register() -> None:
    """Make `attn_implementation="agl_varlen"` known to transformers (idempotent): the attention
    function, and flash attention's mask function (no 4D mask: the samples come from position_ids)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)


def sample_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sample lengths (int32, [samples + 1]) over the flattened [rows, width] positions,
    a sample starting at each row's start and wherever a position is not the previous one plus 1;
    and the longest sample."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    first = torch.nonzero(starts.reshape(-1)).reshape(-1)
    bounds = torch.cat([first, first.new_tensor([position_ids.numel()])]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [rows, heads, width, dim], key and value
    [rows, kv_heads, width, dim] -> output [rows, width, heads, dim]."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None or query.shape[2] != key.shape[2] or sliding_window or softcap or dropout:
        raise ValueError(
            f"attn_implementation {NAME}: for training forwards over packed rows (position_ids given, no KV "
            "cache, no sliding window, soft-capping or attention dropout); use sdpa for this model"
        )
    rows, heads, width, dim = query.shape
    positions = position_ids.reshape(-1, width).expand(rows, width)  # [1, width] when the model made them
    bounds, longest = sample_bounds(positions.to(query.device))
    # [rows, heads, width, dim] -> [tokens, heads, dim]
    q, k, v = (t.transpose(1, 2).reshape(rows * width, t.shape[1], dim) for t in (query, key, value))
    scale = scaling if scaling is not None else dim**-0.5
    if query.is_cuda:
        out = _flash_varlen(q, k, v, bounds, longest, scale)
    else:
        out = _reference_varlen(q, k, v, bounds, scale)
    return out.reshape(rows, width, heads, dim), None


def _flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, longest: int, scale: float
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    parameters = inspect.signature(varlen_attn).parameters
    if q.shape[1] != k.shape[1] and "enable_gqa" not in parameters:  # an older PyTorch: repeat the KV heads
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    options: dict[str, Any] = {"scale": scale}
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)  # causal
    else:
        options["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        options["enable_gqa"] = True
    return varlen_attn(q, k, v, bounds, bounds, longest, longest, **options)


def _reference_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, scale: float
) -> torch.Tensor:
    out = torch.empty_like(q)
    enable_gqa = q.shape[1] != k.shape[1]
    edges = bounds.tolist()
    for start, end in zip(edges[:-1], edges[1:], strict=True):
        # [n, heads, dim] -> [heads, n, dim] for sdpa, causal within the sample
        piece = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1),
            is_causal=True,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        out[start:end] = piece.transpose(0, 1)
    return out


def available_on(device: torch.device) -> bool:
    """Whether this implementation runs its fused kernel here (CUDA with PyTorch's varlen attention)."""
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True
