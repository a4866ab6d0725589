"""The backends' settings as the config holds them, torch-free: `agl train`'s `backend.lora` section
is this `LoraConfig`, `backend.options` this `TrainingOptions` and `backend.verl` these `VerlSettings`,
which the backends take as they are (`TorchBackendConfig` is a `TrainingOptions` with the model,
device, learning rate, seed, algorithm and adapters added; `VerlBackendConfig` is `VerlSettings` with
those training settings added): each key is declared once, with its default and meaning, for the
config, the backends and `agl train --help`. Reading a config imports no torch
(tests/loop/test_config.py), so what lives here imports none either.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

# Every linear layer of a Qwen2/Qwen3/Llama/Mistral decoder block; other models name theirs otherwise.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # every linear layer but the output head (peft's spelling)


class BackendConfigError(ValueError):
    """A backend setting that cannot work; the message names the key and the fix."""


def _doc(text: str, **constraints: Any) -> Any:
    return msgspec.Meta(description=text, **constraints)


class TrainingOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """`backend.options`: the training settings both backends share. Types are checked as a config is
    read; values where the backend is built (`TorchBackendConfig.__post_init__`: each message names
    its key and the fix)."""

    param_dtype: Annotated[str, _doc("master weights and optimizer state: float32, bfloat16 or float16")] = "float32"
    compute_dtype: Annotated[
        str, _doc("auto (bfloat16 autocast on CUDA; on the CPU, param_dtype), float32 or bfloat16")
    ] = "auto"
    attn_implementation: Annotated[
        str | None,
        _doc("sdpa, eager, flash_attention_2, agl_varlen (packed rows at each sample's cost with PyTorch's varlen "
             "flash attention, no flash-attn package: backends/varlen_attention.py); null: transformers' default"),
    ] = None
    trust_remote_code: Annotated[bool, _doc("let transformers run the model repository's own code")] = False
    gradient_checkpointing: Annotated[bool, _doc("recompute activations in backward (less memory)")] = False
    disable_dropout: Annotated[
        bool, _doc("dropout off at load: RL wants the sampling policy's log-probs, dropout would perturb them")
    ] = True
    weight_decay: Annotated[float, _doc("AdamW weight decay")] = 0.0
    betas: Annotated[tuple[float, float], _doc("AdamW betas")] = (0.9, 0.999)
    eps: Annotated[float, _doc("AdamW epsilon")] = 1e-8
    max_grad_norm: Annotated[float | None, _doc("gradient clipping by global norm (null: none)")] = 1.0
    warmup_steps: Annotated[int, _doc("linear learning-rate warmup, in optimizer steps")] = 0
    lr_schedule: Annotated[str, _doc("constant, linear or cosine (the last two decay over total_steps)")] = "constant"
    total_steps: Annotated[int | None, _doc("optimizer steps a linear or cosine schedule decays over")] = None
    min_lr_ratio: Annotated[float, _doc("the decayed learning rate's floor, as a fraction of lr")] = 0.0
    micro_batch_tokens: Annotated[int, _doc("padded positions per forward/backward")] = 8192
    max_row_tokens: Annotated[
        int | None, _doc("longest packed row (null: the batch's longest sample)")
    ] = None
    packing: Annotated[str, _doc("auto (probe the model), packed or padded")] = "auto"
    logit_chunk_tokens: Annotated[
        int | None,
        _doc("scored positions per chunk of the output head's float32 log-softmax and entropy "
             "(backends/chunked_logprobs.py); null: as many as keep a chunk within 64 Mi logits"),
    ] = None
    num_mini_batches: Annotated[
        int, _doc("optimizer steps per training step; a rollout is never split across them")
    ] = 1
    ppo_epochs: Annotated[int, _doc("passes over the batch per training step")] = 1


class LoraConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Low-rank adapters over a frozen base (backends/lora.py); rank 0 (the default) trains every weight.
    Target names are module names' last parts (q_proj matches model.layers.3.self_attn.q_proj); those
    matching no linear layer of the model are refused when it loads. A config's values are checked
    as they are read (types and ranges: msgspec; the rest: `__post_init__`, which also checks one
    built in code)."""

    rank: Annotated[int, _doc("adapter rank (0: no adapters, every weight trains; 8-64 is usual)", ge=0)] = 0
    alpha: Annotated[float, _doc("adapter scale: the update is multiplied by alpha / rank", gt=0)] = 16.0
    dropout: Annotated[
        float, _doc("dropout on the adapters' input in training (> 0 perturbs the trainer's log-probs)", ge=0, lt=1)
    ] = 0.0
    target_modules: Annotated[
        tuple[str, ...] | str,
        _doc("the linear layers adapted, by their names' last parts (a comma-separated string works too), or "
             "all-linear (every one but the output head); the default fits Qwen2/Qwen3/Llama/Mistral"),
    ] = DEFAULT_LORA_TARGETS  # always a tuple once built: a string is split at its commas

    def __post_init__(self) -> None:
        def fail(key: str, message: str) -> None:
            raise BackendConfigError(f"backend.lora.{key}: {message}")

        names = self.target_modules
        names = tuple(_split_names(names)) if isinstance(names, str) else tuple(names)  # "q_proj,v_proj" from a flag
        msgspec.structs.force_setattr(self, "target_modules", names)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            fail("rank", f"{self.rank!r} must be an integer >= 0 (0: no adapters; 8-64 is usual)")
        if not self.alpha > 0:
            fail("alpha", f"{self.alpha!r} must be positive (the update is scaled by alpha / rank)")
        if not 0.0 <= self.dropout < 1.0:
            fail("dropout", f"{self.dropout!r} must be in [0, 1) (0 is usual for RL)")
        if not names or not all(isinstance(name, str) and name.strip() for name in names):
            fail("target_modules", f"{list(names)!r}: give layer names (q_proj, v_proj, ...) or {ALL_LINEAR}")
        if ALL_LINEAR in names and len(names) > 1:
            fail("target_modules", f"{ALL_LINEAR} already names every linear layer; give it alone")
        if len(set(names)) != len(names):
            fail("target_modules", f"{list(names)!r} names a module twice")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def _split_names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


class VerlSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """`backend.verl`: where verl's workers run. The same config runs on a laptop CPU, one GPU, one node or
    several. `VerlBackendConfig` is these settings with the training ones added; its checks name the key
    and the fix."""

    nnodes: Annotated[int, _doc("machines in the Ray cluster that run training workers (verl's trainer.nnodes)", ge=1)] = 1
    n_gpus_per_node: Annotated[
        int, _doc("training workers per machine: GPUs, or processes on a CPU (verl's trainer.n_gpus_per_node)", ge=1)
    ] = 1
    ray_address: Annotated[
        str | None,
        _doc("an existing Ray cluster (`auto`, `HOST:6379`, `ray://HOST:10001`); null starts a local one"),
    ] = None
    strategy: Annotated[Literal["fsdp2"], _doc("verl's actor strategy (FSDP2)")] = "fsdp2"
    param_offload: Annotated[bool, _doc("offload parameters to CPU between steps (collocated GPUs)")] = False
    optimizer_offload: Annotated[bool, _doc("offload optimizer state to CPU between steps")] = False
    gradient_checkpointing: Annotated[bool, _doc("recompute activations in backward (less memory)")] = False
    ulysses_sequence_parallel_size: Annotated[int, _doc("Ulysses sequence parallelism per model replica", ge=1)] = 1
    weight_sync: Annotated[
        Literal["auto", "in_place", "nccl", "cuda_ipc"],
        _doc("how new weights reach the engine: in_place (gathered tensors through the engine's load path), "
             "nccl or cuda_ipc (vLLM's GPU weight transfer); auto picks cuda_ipc on GPUs, in_place on CPU"),
    ] = "auto"
    override: Annotated[
        dict[str, Any], _doc("verl actor config keys by dotted name, applied last (e.g. fsdp_config.wrap_policy...)")
    ] = {}
