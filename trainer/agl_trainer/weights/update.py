"""What a weight sync carries from a backend to an engine: the whole model or a LoRA adapter alone."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class AdapterState:
    """An adapter as peft saves it: `weights` under peft's names (CPU tensors) and `config`, its
    peft LoraConfig as a dict (r, lora_alpha, target_modules, use_rslora, fan_in_fan_out, ...)."""

    weights: dict[str, torch.Tensor]
    config: dict[str, Any]

    @property
    def nbytes(self) -> int:
        """What a sync of this adapter moves (the config's few hundred bytes aside)."""
        return sum(t.numel() * t.element_size() for t in self.weights.values())


@dataclass(frozen=True)
class WeightUpdate:
    """New policy weights. `state_dict` holds CPU tensors under Hugging Face names; `directory`
    holds the same weights saved with save_pretrained (engines in other processes read it);
    `adapter` a LoRA adapter alone, for the base the engine serves (an engine that
    `accepts_adapters`: megabytes a sync instead of the whole model)."""

    version: int
    state_dict: Mapping[str, torch.Tensor] | None = None
    directory: Path | None = None
    adapter: AdapterState | None = None

    @property
    def nbytes(self) -> int:
        """The tensor bytes the update carries (0 for a directory: the engine reads it from disk)."""
        if self.adapter is not None:
            return self.adapter.nbytes
        return sum(t.numel() * t.element_size() for t in (self.state_dict or {}).values())
