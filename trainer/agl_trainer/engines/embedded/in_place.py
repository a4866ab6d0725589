"""Weight updates for the embedded engine: a state_dict (or a save_pretrained directory, read by
weights/files.read_safetensors) copied into the served model in place, all-or-nothing."""

from __future__ import annotations

from typing import Any

from agl_trainer.weights.tied_head import retie_weights, untie_weight


def load_in_place(model: Any, state: Any) -> None:
    """Copy `state` into the model's parameters: every parameter must be given once (a tied weight
    under either of its names), with its shape, and no unknown name is accepted. Everything is
    checked before anything is copied, so a refused update leaves the old weights whole.

    Ties follow the state (weights/tied_head.py): a tied pair given as two different tensors (a LoRA
    policy's merged head) unties the model's head; a head an adapter untied (AdapterMerger) is tied
    back when the state gives only the weight it shared (a tied model's full weights)."""
    import torch

    every = dict(model.named_parameters(remove_duplicate=False))
    unknown = [name for name in state if name not in every]
    if unknown:
        raise KeyError(
            f"update_weights: names the model does not have: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )
    untied: dict[str, str] = getattr(model, "_agl_untied", {})
    retie = {name for name, owner in untied.items() if name not in state and owner in state}
    alias_of = _tied_aliases(model)
    untie = {
        alias for owner, aliases in alias_of.items() for alias in aliases
        if alias in state and owner in state and not torch.equal(state[alias], state[owner])
    }  # fmt: skip
    params = dict(model.named_parameters())  # tied weights appear once here
    missing = [
        name for name in params
        if name not in state and name not in retie and not any(a in state for a in alias_of.get(name, ()))
    ]  # fmt: skip
    if missing:
        raise KeyError(
            f"update_weights: the state_dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    for name, source in state.items():
        if tuple(source.shape) != tuple(every[name].shape):
            raise ValueError(
                f"update_weights: {name} has shape {tuple(source.shape)}, "
                f"the model {tuple(every[name].shape)}"
            )
    with torch.no_grad():
        retie_weights(model, retie)
        for name in sorted(untie):
            untie_weight(model, name)
    params, alias_of = dict(model.named_parameters()), _tied_aliases(model)
    pairs = [
        (param, state[name] if name in state else next(state[a] for a in alias_of[name] if a in state))
        for name, param in params.items()
    ]
    with torch.no_grad():
        for param, source in pairs:
            param.copy_(source.to(dtype=param.dtype))


def _tied_aliases(model: Any) -> dict[str, list[str]]:
    by_tensor: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first = by_tensor.setdefault(id(param), name)
        if first != name:
            aliases.setdefault(first, []).append(name)
    return aliases
