"""LoRA adapters over a frozen base: wrapping a model with peft, the adapter's state, merging it.

The trainer (torch_backend.py) wraps its model with `wrap`; only the adapter trains. An engine gets
either the merged weights under the base model's Hugging Face names (`merged_state_dict`: any engine
loads them as full weights) or the adapter alone (`adapter_state`: peft's format, megabytes), which
`AdapterMerger` applies to a served model's pristine base. Both merges use `adapter_deltas`, so the
engine's weights after an adapter sync are the trainer's merged weights (bit for bit in one dtype on
one kind of device).

An adapter on a tied output head (lm_head sharing the input embedding's weight, as small models
have) changes the head's output only: peft wraps the head's Linear, the embedding lookup stays the
base's. Merged, such a policy is no longer tied: its lm_head is written as a weight of its own
(HEAD_WEIGHT, beside the embedding) and a saved config says tie_word_embeddings false.

The trainer-side functions also take a peft model sharded by FSDP2 (the verl workers): its DTensors
are gathered whole, a collective, so there every rank calls them, in the same order.

peft is imported inside the functions that wrap. The adapter's types, files and merge live in the
weights layer (agl_trainer.weights), which engines import instead of this module.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from agl_trainer.backends.torch_config import ALL_LINEAR, DEFAULT_LORA_TARGETS, BackendConfigError, LoraConfig
from agl_trainer.weights.merge import adapter_deltas, merge
from agl_trainer.weights.update import AdapterState

# ------------------------------------------------------------------------------------- trainer side
def wrap(model: torch.nn.Module, config: LoraConfig, seed: int | None = None) -> Any:
    """The model as a peft model with fresh adapters (B = 0: the same function as the base) on the
    configured linear layers; every base parameter is frozen, in place. A is drawn from `seed` (by
    default the one torch was last seeded with), not from wherever the RNG stands after loading and
    probing the model: the torch backend and every verl worker start from the same adapter."""
    import warnings

    import peft

    targets = resolve_targets(model, config.target_modules)
    peft_config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):  # peft initialises the adapter on the CPU, then moves it
        torch.manual_seed(torch.initial_seed() if seed is None else seed)
        with warnings.catch_warnings():  # peft warns of merging a tied head in place; agl merges it untied
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings=True.*")
            # autocast_adapter_dtype: adapters stay float32 over a bfloat16 base (their master weights)
            return peft.get_peft_model(model, peft_config, autocast_adapter_dtype=True)


def resolve_targets(model: torch.nn.Module, names: tuple[str, ...]) -> list[str]:
    """The target names, checked against the model: each must match a linear layer (as peft matches:
    the module's name or its last parts). The output head may be one, tied to the input embedding or
    not (its adapter changes the head's output only); no other layer may share its weight. all-linear:
    every linear layer but the output head, as peft reads it."""
    linear = _linear_layers(model)
    head = model.get_output_embeddings()
    if tuple(names) == (ALL_LINEAR,):
        return sorted({name.rsplit(".", 1)[-1] for name, module in linear.items() if module is not head})
    kind = type(model).__name__
    unmatched = [target for target in names if not any(_matches(name, target) for name in linear)]
    if unmatched:
        default = " (the default, for Qwen2/Llama-style models)" if names == DEFAULT_LORA_TARGETS else ""
        known = sorted({name.rsplit(".", 1)[-1] for name in linear})
        embedding = next((n for n, m in model.named_modules() if m is model.get_input_embeddings()), "")
        hint = (
            f"; {embedding} is the input embedding, which agl does not adapt (tied to the output head, an "
            "adapter there would change both): adapt lm_head, the output head, instead"
            if embedding and any(_matches(embedding, target) for target in unmatched)
            else ""
        )
        raise BackendConfigError(
            f"backend.lora.target_modules{default}: {', '.join(unmatched)} match no linear layer of {kind}; "
            f"its linear layers are {', '.join(known)} (or give {ALL_LINEAR}){hint}"
        )
    shared = _shared_weights(model)
    tied = sorted(
        n for n in linear if n in shared and linear[n] is not head and any(_matches(n, t) for t in names)
    )
    if tied:
        raise BackendConfigError(
            f"backend.lora.target_modules: {', '.join(tied)} of {kind} shares its weight with another "
            "module, and an adapter on it would change both: leave it out (only the output head, lm_head, "
            "may be adapted while tied: its adapter changes the head's output alone)"
        )
    return list(names)


def _linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def _matches(module_name: str, target: str) -> bool:
    return module_name == target or module_name.endswith("." + target)


def _shared_weights(model: torch.nn.Module) -> set[str]:
    """Modules whose weight is also another module's (tied)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners.setdefault(id(weight), []).append(name)
    return {name for names in owners.values() if len(names) > 1 for name in names}


def adapter_state(peft_model: Any, dtype: torch.dtype | None = None) -> AdapterState:
    """The adapter's weights (copies on the CPU) and config, as peft's save_pretrained writes them."""
    live = _live_adapter(peft_model)
    weights = {name: t.to("cpu", dtype=dtype or t.dtype, copy=True) for name, t in live.weights.items()}
    return AdapterState(weights, live.config)


def adapter_config(peft_model: Any) -> dict[str, Any]:
    """The adapter's peft LoraConfig as a dict, as adapter_config.json holds it."""
    return {key: _plain(value) for key, value in peft_model.peft_config["default"].to_dict().items()}


@torch.no_grad()
def _live_adapter(peft_model: Any) -> AdapterState:
    """The adapter's own tensors (detached, where they train; gathered whole where sharded) and its config."""
    weights = {name: _whole(t).detach() for name, t in _peft_state(peft_model).items()}
    return AdapterState(weights, adapter_config(peft_model))


def _peft_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter's A and B under peft's names. save_embedding_layers off: with lm_head a target, peft
    would add the whole embedding and head weights (the base's, megabytes to gigabytes) to it."""
    import peft

    return peft.get_peft_model_state_dict(peft_model, save_embedding_layers=False)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor FSDP2 shards (a DTensor) gathered whole on every rank; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _plain(value: Any) -> Any:
    """A peft config value as JSON has it (peft keeps enums and sets)."""
    if isinstance(value, enum.Enum):
        return value.value
    return sorted(value) if isinstance(value, set) else value


def _as_set(value: Any) -> Any:
    return set(value) if isinstance(value, (list, tuple)) else value


def load_adapter_weights(peft_model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Set the adapter to `weights` (peft's names), all of them: a missing or unknown name refuses."""
    import peft

    expected = set(_peft_state(peft_model))
    missing, unknown = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unknown:
        raise ValueError(
            f"the adapter does not fit the model: missing {missing[:4]}, unknown {unknown[:4]}; "
            "was it trained with other backend.lora target_modules or another model?"
        )
    result = peft.set_peft_model_state_dict(peft_model, weights)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"the adapter does not fit the model: unexpected {list(result.unexpected_keys)[:4]}")


def merged_state_dict(peft_model: Any, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Base + adapter as plain weights (CPU copies) under the base model's Hugging Face names, as
    save_pretrained writes them (a tied output embedding once, under the input embedding's name; an
    adapted tied head as a weight of its own, weights/tied_head.HEAD_WEIGHT)."""
    from agl_trainer.backends.weight_buckets import host_copy

    return {name: host_copy(tensor) for name, tensor in merged_tensors(peft_model, dtype)}


@torch.no_grad()
def merged_tensors(peft_model: Any, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """merged_state_dict's weights one at a time, where they live (an unmerged one may be the model's
    own tensor: copy it). Sharded by FSDP2, every rank walks it whole: each weight is gathered."""
    base = peft_model.get_base_model()
    deltas = adapter_deltas(_live_adapter(peft_model))  # on the adapter's device, one weight's at a time
    seen: set[int] = set()
    for name, tensor in base.state_dict(keep_vars=True).items():
        hf_name = name.replace(".base_layer.", ".")
        if ".lora_" in name or (id(tensor) in seen and hf_name not in deltas):
            continue  # an adapter weight, or tied to a weight already given (an unadapted output head)
        whole = _whole(tensor).detach()
        target = dtype or whole.dtype
        if hf_name in deltas:  # an adapted tied head too: its own weight, the embedding stays as it is
            yield hf_name, merge(whole, deltas[hf_name]).to(dtype=target)
        else:
            seen.add(id(tensor))
            yield hf_name, whole.to(dtype=target)


def check_checkpoint_kind(directory: Path, holds_adapter: bool, uses_lora: bool) -> None:
    """Refuse a checkpoint of the other kind: full weights for a LoRA backend, or an adapter for one
    that trains every weight."""
    if uses_lora != holds_adapter:
        kinds = ("full weights", "an adapter")
        raise ValueError(
            f"{directory} holds {kinds[holds_adapter]} but this backend trains {kinds[uses_lora]}: resume "
            "with the backend.lora settings the run was started with"
        )


def check_same_adapter(current: dict[str, Any], saved: dict[str, Any]) -> None:
    """Refuse an adapter saved with other LoRA settings (its weights would mean another update)."""
    keys = ("r", "lora_alpha", "target_modules", "use_rslora", "fan_in_fan_out")
    differ = [
        f"{key} {saved.get(key)!r} (now {current.get(key)!r})"
        for key in keys
        if _plain(_as_set(current.get(key))) != _plain(_as_set(saved.get(key)))
    ]
    if differ:
        raise ValueError(
            f"the saved adapter was trained with other settings: {', '.join(differ)}; resume with the "
            "backend.lora settings the run was started with"
        )


def save_adapter(peft_model: Any, directory: Path) -> None:
    """The bare adapter in peft's format (adapter_model.safetensors + adapter_config.json)."""
    peft_model.save_pretrained(directory, save_embedding_layers=False)  # A and B only, as _peft_state
