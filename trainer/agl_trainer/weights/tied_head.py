"""A tied output head (lm_head sharing the input embedding's weight, as small models have) and the
weights that untie it.

An adapter on a tied head changes the head's output only: merged, such a policy is no longer tied.
Its lm_head is a weight of its own (HEAD_WEIGHT, beside the embedding), a saved config says
tie_word_embeddings false, and a served model's head gets a weight of its own (untie_weight) until
full tied weights come again (retie_weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

HEAD_WEIGHT = "lm_head.weight"  # the output head's weight (Llama/Qwen-style names), as merged


def ties_head(config: dict[str, Any]) -> bool:
    """A model's config.json (a dict) ties its output head to the input embedding (a multimodal one's
    text_config says so where the top level does not)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def config_for_weights(config: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """A model's config.json (a dict) for weights under `names`: where they hold an output head of
    their own (an untied model's, or a tied one's merged with its adapter) it says tie_word_embeddings
    false (a multimodal one's text_config too), so transformers and vLLM load that head instead of
    tying it to the embedding. Weights without one: the config as it is."""
    if HEAD_WEIGHT not in set(names):
        return config
    out = {**config, "tie_word_embeddings": False}
    if isinstance(config.get("text_config"), dict):
        out["text_config"] = {**config["text_config"], "tie_word_embeddings": False}
    return out


def untie_weight(model: torch.nn.Module, name: str) -> None:
    """Give the module that holds weight `name` (a tied output head: lm_head.weight) a weight of its
    own, a copy of the one it shared; the model's config then says tie_word_embeddings false, so
    transformers does not tie it back. retie_weights undoes it."""
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    shared = getattr(module, attribute)
    untied = getattr(model, "_agl_untied", {})
    owner = next(n for n, p in model.named_parameters() if p is shared)
    own = torch.nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
    setattr(module, attribute, own)
    untied[name] = owner
    model._agl_untied = untied  # type: ignore[assignment]
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "tie_word_embeddings"):
        config.tie_word_embeddings = False


def retie_weights(model: torch.nn.Module, names: set[str] | None = None) -> list[str]:
    """Tie back what untie_weight untied (those of `names`, or all): each shares its owner's weight
    again. Returns the names retied."""
    untied: dict[str, str] = getattr(model, "_agl_untied", {})
    done = [name for name in untied if names is None or name in names]
    params = dict(model.named_parameters())
    for name in done:
        module_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(module_name), attribute, params[untied.pop(name)])
    if done and not untied and getattr(model, "config", None) is not None:
        model.config.tie_word_embeddings = True
    return done
