"""A LoRA adapter merged into base weights, the same arithmetic on both sides of a sync: the
trainer's merged weights (backends/lora.py) and an engine's adapter update (AdapterMerger) use
`adapter_deltas` and `merge`, so the engine's weights after an adapter sync are the trainer's merged
weights (bit for bit in one dtype on one kind of device)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from agl_trainer.weights.peft_files import PEFT_PREFIX
from agl_trainer.weights.tied_head import untie_weight
from agl_trainer.weights.update import AdapterState


def adapter_deltas(state: AdapterState) -> AdapterDeltas:
    """Each adapted weight's update, float32 on the weights' device, by the base model's Hugging Face
    weight name: scaling x B @ A (transposed where the layer stores its weight fan-in first). Checked
    whole here; each update is computed when it is read, so a merge holds one at a time (an 8B's
    float32 updates of every linear layer together are 26 GiB)."""
    config = state.config
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("adapter_deltas: DoRA and per-layer rank or alpha patterns are not supported")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.weights.items():
        module, _, part = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise ValueError(f"adapter_deltas: {name} is not a LoRA A or B weight")
        pairs.setdefault(module, {})[part[0]] = tensor
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter_deltas: {module} has lora_{''.join(pair)} only")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterDeltas(
        {f"{module}.weight": (pair["A"], pair["B"]) for module, pair in pairs.items()},
        scaling,
        bool(config.get("fan_in_fan_out")),
    )


class AdapterDeltas(Mapping[str, torch.Tensor]):
    """Weight name -> its update, computed when read (not kept)."""

    def __init__(
        self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float, fan_in_fan_out: bool
    ) -> None:
        self._pairs = pairs
        self._scaling = scaling
        self._transposed = fan_in_fan_out

    def __getitem__(self, name: str) -> torch.Tensor:
        a, b = self._pairs[name]
        delta = (b.float() @ a.float()) * self._scaling
        return delta.T if self._transposed else delta

    def __contains__(self, name: object) -> bool:  # Mapping's own would compute the update
        return name in self._pairs

    def __iter__(self) -> Iterator[str]:
        return iter(self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)

    def shape(self, name: str) -> tuple[int, int]:
        """The update's shape, without computing it."""
        a, b = self._pairs[name]
        out, fan_in = int(b.shape[0]), int(a.shape[1])
        return (fan_in, out) if self._transposed else (out, fan_in)


def merge(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """base + delta in float32, on the base's device (a bfloat16 sum would round the small update away)."""
    return base.detach().float() + delta.to(base.device)


class AdapterMerger:
    """Applies successive adapters to a served model: each one replaces the last, merged into the
    base weights the model had before the first (a copy of the adapted ones is kept), so neither
    rounding nor old adapters accumulate. An adapter on a tied output head unties it first (untie_weight):
    the head gets a weight of its own, the embedding stays the base's."""

    def __init__(self) -> None:
        self._pristine: dict[str, torch.Tensor] = {}  # HF weight name -> the base weight, as loaded

    def apply(self, model: torch.nn.Module, state: AdapterState) -> None:
        """Set the model's weights to base + this adapter; checked whole before anything changes."""
        deltas = adapter_deltas(state)
        every = dict(model.named_parameters(remove_duplicate=False))  # a tied head under its own name too
        unknown = sorted(name for name in deltas if name not in every)
        if unknown:
            raise KeyError(f"update_adapter: weights the model does not have: {unknown[:5]}")
        for name in deltas:
            if deltas.shape(name) != tuple(every[name].shape):
                raise ValueError(
                    f"update_adapter: {name}'s update has shape {deltas.shape(name)}, the model "
                    f"{tuple(every[name].shape)}"
                )
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name in deltas:
                if name not in params:  # tied: it shares the weight it is listed with
                    untie_weight(model, name)
            params = dict(model.named_parameters())
            for name in deltas:
                self._pristine.setdefault(name, params[name].detach().clone())
            for name, base in self._pristine.items():  # a module the new adapter leaves out: back to base
                merged = merge(base, deltas[name]) if name in deltas else base
                params[name].copy_(merged.to(dtype=params[name].dtype))

    def forget(self) -> None:
        """Full weights were loaded: they are the new base (a later adapter merges into them)."""
        self._pristine.clear()
