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

peft is imported inside the functions that wrap: an engine applying adapters needs only torch.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agl_trainer.backends.torch_config import ALL_LINEAR, DEFAULT_LORA_TARGETS, BackendConfigError, LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's names: PeftModel.from_pretrained and vLLM read them
ADAPTER_CONFIG = "adapter_config.json"
_PREFIX = "base_model.model."  # peft's names: base_model.model.<module>.lora_A.weight


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
    adapted tied head as a weight of its own, HEAD_WEIGHT: see config_for_weights)."""
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
            yield hf_name, _merge(whole, deltas[hf_name]).to(dtype=target)
        else:
            seen.add(id(tensor))
            yield hf_name, whole.to(dtype=target)


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


def write_adapter(state: AdapterState, directory: Path) -> None:
    """An AdapterState in the files save_adapter writes (the verl backend holds no peft model)."""
    import json

    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    weights = {name: t.contiguous() for name, t in state.weights.items()}
    save_file(weights, directory / ADAPTER_WEIGHTS, {"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(state.config, indent=2, sort_keys=True))


def read_adapter(directory: Path) -> AdapterState:
    """What save_adapter wrote."""
    import json

    from safetensors.torch import load_file

    weights, config = directory / ADAPTER_WEIGHTS, directory / ADAPTER_CONFIG
    if not weights.is_file() or not config.is_file():
        raise FileNotFoundError(f"{directory} holds no peft adapter ({ADAPTER_WEIGHTS} and {ADAPTER_CONFIG})")
    return AdapterState(load_file(weights), json.loads(config.read_text()))


# ------------------------------------------------------------------------------- both sides: merging
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
        module, _, part = name.removeprefix(_PREFIX).rpartition(".lora_")
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


def _merge(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
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
                merged = _merge(base, deltas[name]) if name in deltas else base
                params[name].copy_(merged.to(dtype=params[name].dtype))

    def forget(self) -> None:
        """Full weights were loaded: they are the new base (a later adapter merges into them)."""
        self._pristine.clear()


# ------------------------------------------------------------------ a served model's tied output head
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
