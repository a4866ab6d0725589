"""What the backend needs to know about a Hugging Face causal LM, found by probing it."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from agl_trainer.backends.torch_config import BackendConfigError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendConfigError(f"backend.device: {name!r} but CUDA is not available here; use device: cpu")
    return device


def supports_packing(model: torch.nn.Module, device: torch.device, tolerance: float) -> bool:
    """Does the model keep packed samples apart when position_ids restart (and attention_mask is None)?"""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(0)
    first = torch.randint(0, vocab, (1, 5), generator=generator).to(device)
    second = torch.randint(0, vocab, (1, 7), generator=generator).to(device)
    packed_ids = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0).to(device)
    with torch.no_grad():
        alone = model(input_ids=second, use_cache=False).logits.float()
        packed = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits.float()[:, 5:]
    return bool((alone - packed).abs().max() <= tolerance * max(1.0, float(alone.abs().max())))


@contextmanager
def head_sees_only(head: torch.nn.Module, rows: torch.Tensor, positions: torch.Tensor):
    """Feed the output head only the hidden states at (rows, positions), as one [1, K, H] row.

    Trained tokens are a small, scattered part of a packed micro-batch (prompts and tool outputs are
    not trained), and the head (H x V) with its float32 log-softmax is the costliest per-position
    step. Whatever the model does to logits afterwards (scaling, soft-capping) is elementwise."""

    def select(module: torch.nn.Module, args: tuple) -> tuple:
        return (args[0][rows, positions].unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def head_selection_works(model: torch.nn.Module, device: torch.device) -> bool:
    """Does selecting the head's input give the same logits as slicing the full output? (It does for
    every model whose forward applies get_output_embeddings() once to the final hidden states.)"""
    head = model.get_output_embeddings()
    if head is None:
        return False
    vocab = int(model.get_input_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    rows, positions = torch.tensor([0, 1, 1], device=device), torch.tensor([1, 4, 0], device=device)
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[rows, positions].float()
        with head_sees_only(head, rows, positions):
            selected = model(input_ids=ids, use_cache=False).logits
    return tuple(selected.shape) == (1, 3, vocab) and torch.allclose(
        selected[0].float(), full, atol=1e-2, rtol=1e-2
    )


def disable_dropout(model: torch.nn.Module) -> int:
    """Turn every dropout off and return how many were on. RL needs the log-probs of the policy that
    sampled (no dropout in the engine), and the old/new ratio must be 1 for an unchanged model.
    Kept in train mode otherwise, so gradient checkpointing still works."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            changed += 1
        # attention implementations read a float attribute: dropout=0.0 if not training else self.<attr>
        for attr in ("attention_dropout", "attn_dropout", "dropout"):
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                setattr(module, attr, 0.0)
                changed += 1
    return changed
