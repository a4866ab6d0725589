"""LoRA's share of the arithmetic, from the architecture alone: which linear layers backend.lora adapts
and how many parameters its adapters train (rank x (in + out) per adapted layer).

Targets match as the backend matches them (backends/lora.py: a module's name or its last parts), here
against the Llama-style module names (model.layers.N.self_attn.q_proj, model.layers.N.mlp.up_proj,
lm_head); all-linear is every linear layer but the output head, as peft reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from agl_trainer.backends.settings import ALL_LINEAR
from agl_trainer.resources.architecture import Architecture

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class LoraTargetError(ValueError):
    """A target that matches no linear layer; says the fix."""


@dataclass(frozen=True)
class AdaptedLayer:
    name: str  # the module's full name, e.g. model.layers.3.self_attn.q_proj
    in_features: int
    out_features: int

    def adapter_parameters(self, rank: int) -> int:
        return rank * (self.in_features + self.out_features)  # A: rank x in, B: out x rank

    @property
    def weight_parameters(self) -> int:
        return self.in_features * self.out_features


def linear_layers(arch: Architecture) -> list[AdaptedLayer]:
    """Every linear layer of the decoder, with its shape; the output head last."""
    h, q, kv, inter = (
        arch.hidden_size,
        arch.num_attention_heads * arch.head_dim,
        arch.num_key_value_heads * arch.head_dim,
        arch.intermediate_size,
    )
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    layers = []
    for index in range(arch.num_hidden_layers):
        for name in ATTENTION + MLP:
            block = "self_attn" if name in ATTENTION else "mlp"
            layers.append(AdaptedLayer(f"model.layers.{index}.{block}.{name}", *shapes[name]))
    layers.append(AdaptedLayer("lm_head", h, arch.vocab_size))
    return layers


def adapted_layers(arch: Architecture, targets: tuple[str, ...]) -> list[AdaptedLayer]:
    """The linear layers `targets` adapt; an unmatched target is refused, as the backend refuses it
    when the model loads (so the dry run fails where the run would). A tied lm_head counts as adapted:
    its adapter is hidden x rank + rank x vocab, and merged it is a weight of its own."""
    every = linear_layers(arch)
    if tuple(targets) == (ALL_LINEAR,):
        return every[:-1]
    unmatched = [target for target in targets if not any(_matches(layer.name, target) for layer in every)]
    if unmatched:
        known = ", ".join(dict.fromkeys(layer.name.rsplit(".", 1)[-1] for layer in every))
        raise LoraTargetError(
            f"{', '.join(unmatched)} match no linear layer of {arch.model_type}; its linear layers are "
            f"{known} (or give {ALL_LINEAR})"
        )
    # lm_head is adapted tied or not (backends/lora.py: the adapter changes the head's output alone)
    return [layer for layer in every if any(_matches(layer.name, target) for target in targets)]


def _matches(module_name: str, target: str) -> bool:
    return module_name == target or module_name.endswith("." + target)


def short_names(layers: list[AdaptedLayer]) -> list[str]:
    """q_proj, k_proj, ... once each, in the model's order."""
    return list(dict.fromkeys(layer.name.rsplit(".", 1)[-1] for layer in layers))
