"""Settings of the torch backend, validated when built: a bad value names its key and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends.schedule import SCHEDULES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BackendConfigError(ValueError):
    """A backend setting that cannot work; the message names the key and the fix."""


# Every linear layer of a Qwen2/Qwen3/Llama/Mistral decoder block; other models name theirs otherwise.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # every linear layer but the output head (peft's spelling)


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters over a frozen base (backends/lora.py); rank 0 (the default) trains every weight.
    Target names are module names' last parts (q_proj matches model.layers.3.self_attn.q_proj); those
    matching no linear layer of the model are refused when it loads."""

    rank: int = 0
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input while training; > 0 perturbs the trainer's log-probs
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS

    def __post_init__(self) -> None:
        def fail(key: str, message: str) -> None:
            raise BackendConfigError(f"backend.lora.{key}: {message}")

        if isinstance(self.target_modules, str):  # "q_proj,v_proj" as a flag gives it
            object.__setattr__(self, "target_modules", tuple(_split_names(self.target_modules)))
        else:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            fail("rank", f"{self.rank!r} must be an integer >= 0 (0: no adapters; 8-64 is usual)")
        if not self.alpha > 0:
            fail("alpha", f"{self.alpha!r} must be positive (the update is scaled by alpha / rank)")
        if not 0.0 <= self.dropout < 1.0:
            fail("dropout", f"{self.dropout!r} must be in [0, 1) (0 is usual for RL)")
        names = self.target_modules
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


@dataclass(frozen=True)
class TorchBackendConfig:
    model_path: str | Path
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    param_dtype: str = "float32"  # master weights and optimizer state
    compute_dtype: str = "auto"  # auto: bfloat16 autocast on CUDA; on CPU, param_dtype
    # e.g. sdpa, eager, flash_attention_2, agl_varlen (packed rows at each sample's cost with PyTorch's
    # varlen flash attention, no flash-attn package: backends/varlen_attention.py); None: transformers' default
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    disable_dropout: bool = True  # RL wants the sampling policy's log-probs; dropout would perturb them
    # optimizer and schedule
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | linear | cosine
    total_steps: int | None = None  # needed by linear and cosine
    min_lr_ratio: float = 0.0
    # batching
    micro_batch_tokens: int = 8192  # padded positions per forward/backward
    max_row_tokens: int | None = None  # longest packed row (default: the batch's longest sample)
    packing: str = "auto"  # auto (probe the model) | packed | padded
    # scored positions per chunk of the output head's float32 log-softmax/entropy (backends/chunked_logprobs.py);
    # None: as many as keep a chunk within 64 Mi logits (441 positions of a 151,936-token vocabulary)
    logit_chunk_tokens: int | None = None
    num_mini_batches: int = 1  # optimizer steps per train_step; rollouts are never split across them
    ppo_epochs: int = 1  # passes over the batch
    seed: int = 0
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank 0: full training

    def __post_init__(self) -> None:
        def fail(key: str, message: str) -> None:
            raise BackendConfigError(f"backend.{key}: {message}")

        if not Path(self.model_path).is_dir():
            fail(
                "model_path",
                f"{self.model_path} is not a directory; give a save_pretrained directory of a causal LM",
            )
        if self.param_dtype not in DTYPES:
            fail("param_dtype", f"{self.param_dtype!r} is not one of {list(DTYPES)}")
        if self.compute_dtype == "float16":
            fail("compute_dtype", "float16 needs loss scaling, which this backend does not do; use bfloat16")
        if self.compute_dtype not in ("auto", "float32", "bfloat16"):
            fail("compute_dtype", f"{self.compute_dtype!r} is not one of auto, float32, bfloat16")
        if self.lr <= 0:
            fail("lr", f"{self.lr} must be positive (1e-6 is usual for LLMs)")
        if self.lr_schedule not in SCHEDULES:
            fail("lr_schedule", f"{self.lr_schedule!r} is not one of {list(SCHEDULES)}")
        if self.lr_schedule != "constant" and not self.total_steps:
            fail("total_steps", f"lr_schedule {self.lr_schedule!r} decays over total_steps; set it")
        if self.warmup_steps < 0:
            fail("warmup_steps", f"{self.warmup_steps} must be >= 0")
        if self.micro_batch_tokens <= 0:
            fail("micro_batch_tokens", f"{self.micro_batch_tokens} must be positive")
        if self.packing not in ("auto", "packed", "padded"):
            fail("packing", f"{self.packing!r} is not one of auto, packed, padded")
        if self.logit_chunk_tokens is not None and self.logit_chunk_tokens < 1:
            fail("logit_chunk_tokens", f"{self.logit_chunk_tokens} must be >= 1, or null for the default")
        if self.num_mini_batches < 1 or self.ppo_epochs < 1:
            fail("num_mini_batches", "num_mini_batches and ppo_epochs must be >= 1")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            fail("max_grad_norm", f"{self.max_grad_norm} must be positive, or null for no clipping")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            fail("device", f"{self.device!r}: use auto, cpu, cuda or cuda:N")
        if not isinstance(self.lora, LoraConfig):
            fail("lora", f"{self.lora!r}: give a LoraConfig(rank, alpha, dropout, target_modules)")

    @property
    def updates_per_step(self) -> int:
        return self.num_mini_batches * self.ppo_epochs
