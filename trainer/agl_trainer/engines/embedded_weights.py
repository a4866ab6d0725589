"""Weight updates for the embedded engine: a state_dict (or a save_pretrained directory, read by
weight_files.read_safetensors) copied into the served model in place, all-or-nothing."""

from __future__ import annotations

from typing import Any


def load_in_place(model: Any, state: Any) -> None:
    """Copy `state` into the model's parameters: every parameter must be given once (a tied weight
    under either of its names), with its shape, and no unknown name is accepted. Everything is
    checked before anything is copied, so a refused update leaves the old weights whole."""
    import torch

    params = dict(model.named_parameters())  # tied weights appear once here
    tied_aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    unknown = [name for name in state if name not in params and name not in tied_aliases]
    if unknown:
        raise KeyError(
            f"update_weights: names the model does not have: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )
    alias_of = _tied_aliases(model)
    missing = [
        name for name in params if name not in state and not any(a in state for a in alias_of.get(name, ()))
    ]
    if missing:
        raise KeyError(
            f"update_weights: the state_dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    target = {**params, **{alias: params[name] for name, aliases in alias_of.items() for alias in aliases}}
    for name, source in state.items():
        if tuple(source.shape) != tuple(target[name].shape):
            raise ValueError(
                f"update_weights: {name} has shape {tuple(source.shape)}, the model {tuple(target[name].shape)}"
            )
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
