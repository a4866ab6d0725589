"""Settings of the torch backend, validated when built: a bad value names its key and how to fix it."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from agl_trainer.algorithms import AlgorithmConfig
from agl_trainer.backends.schedule import SCHEDULES
from agl_trainer.backends.settings import (  # re-exported: the sections live there, torch-free
    ALL_LINEAR as ALL_LINEAR,
    DEFAULT_LORA_TARGETS as DEFAULT_LORA_TARGETS,
    BackendConfigError as BackendConfigError,
    LoraConfig as LoraConfig,
    TrainingOptions,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchBackendConfig(TrainingOptions, frozen=True, kw_only=True):
    """What a backend is built from: the shared training options (`backend.options`, declared once in
    backends/settings.py) and the rest of the `backend` section, with the model's path and the seed.
    A value that cannot work is refused here, naming its key and the fix."""

    model_path: str | Path
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    lr: float = 1e-6
    seed: int = 0
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)  # rank 0: full training

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
