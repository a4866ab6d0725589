"""Settings of the verl backend, validated before any Ray worker starts: a setting that cannot work
fails here, naming its key and the fix.

The training settings are the torch backend's (`TorchBackendConfig`: model_path, lr, device,
param_dtype, micro_batch_tokens, num_mini_batches, ppo_epochs, warmup_steps, lr_schedule, ...,
algorithm), validated by it; the rest says where verl's workers run (`backend.verl.*`, the config's
section itself: `VerlBackendConfig` is a `VerlSettings`). Its types are checked as a config is read;
the checks here also hold a config built in code.
"""

from __future__ import annotations

import socket

from agl_trainer.backends.settings import VerlSettings
from agl_trainer.backends.torch_config import BackendConfigError, TorchBackendConfig

WEIGHT_SYNCS = ("auto", "in_place", "nccl", "cuda_ipc")


class VerlBackendConfig(VerlSettings, frozen=True, kw_only=True):
    """`backend.verl` (`VerlSettings`, declared once in backends/settings.py: where the workers run)
    with the training settings and what the checks below need from the rest of the run."""

    training: TorchBackendConfig  # model, optimizer, schedule, batching, algorithm: as the torch backend
    rollouts_per_batch: int | None = None  # the loop's batch_rollouts, for the data-parallel check
    cuda_available: bool | None = None  # None: ask torch (tests pass False to act as a CPU machine)

    def __post_init__(self) -> None:
        def fail(key: str, message: str) -> None:
            raise BackendConfigError(f"backend.{key}: {message}")

        t = self.training
        cuda = self.has_cuda
        if self.strategy != "fsdp2":
            fail(
                "verl.strategy",
                f"{self.strategy!r}: only fsdp2 is supported (FSDP1 and Megatron are not wired)",
            )
        for key in ("nnodes", "n_gpus_per_node", "ulysses_sequence_parallel_size"):
            if getattr(self, key) < 1:
                fail(f"verl.{key}", f"{getattr(self, key)} must be >= 1")
        if self.weight_sync not in WEIGHT_SYNCS:
            fail("verl.weight_sync", f"{self.weight_sync!r} is not one of {list(WEIGHT_SYNCS)}")
        if t.lora.enabled and self.weight_sync in ("nccl", "cuda_ipc"):
            fail(
                "verl.weight_sync",
                f"{self.weight_sync!r} moves full weights, but with backend.lora the engine takes the "
                "adapter alone (megabytes, in place); set weight_sync: auto",
            )
        device = self.device
        if device == "cpu":
            gpu_only = {
                "verl.param_offload": self.param_offload,
                "verl.optimizer_offload": self.optimizer_offload,
                "verl.weight_sync": self.weight_sync in ("nccl", "cuda_ipc"),
                "verl.ulysses_sequence_parallel_size": self.ulysses_sequence_parallel_size > 1,
            }
            for key, used in gpu_only.items():
                if used:
                    fail(
                        key,
                        f"{getattr(self, key.split('.')[1])!r} needs CUDA GPUs, but the workers run on the CPU "
                        f"(backend.device: {t.device}); remove it, or run on GPUs with device: cuda",
                    )
            if t.compute_dtype == "bfloat16":
                fail("options.compute_dtype", "bfloat16 autocast is for GPUs; use auto or float32 on the CPU")
        elif not cuda and self.ray_address is None:
            fail(
                "device",
                f"{t.device!r}, but CUDA is not available here and no backend.verl.ray_address names a GPU "
                f"cluster; use device: cpu (n_gpus_per_node then counts CPU worker processes)",
            )
        if self.ulysses_sequence_parallel_size > 1 and device == "cuda" and not has_flash_attn():
            fail(
                "verl.ulysses_sequence_parallel_size",
                f"{self.ulysses_sequence_parallel_size} needs verl's packed inputs, which need flash-attn; "
                "pip install flash-attn, or set it to 1",
            )
        if self.world_size % self.ulysses_sequence_parallel_size:
            fail(
                "verl.ulysses_sequence_parallel_size",
                f"{self.ulysses_sequence_parallel_size} must divide nnodes x n_gpus_per_node = {self.world_size}",
            )
        if self.rollouts_per_batch is not None:
            per_update = self.rollouts_per_batch // t.num_mini_batches
            if self.dp_size > per_update:
                fail(
                    "verl.n_gpus_per_node",
                    f"data-parallel size {self.dp_size} (nnodes {self.nnodes} x n_gpus_per_node "
                    f"{self.n_gpus_per_node} / ulysses {self.ulysses_sequence_parallel_size}) is larger than "
                    f"the {per_update} rollouts of a mini-batch (loop.batch_rollouts {self.rollouts_per_batch} / "
                    f"num_mini_batches {t.num_mini_batches}): workers would train on padding only; lower "
                    "n_gpus_per_node or nnodes, or raise loop.batch_rollouts",
                )
        if self.ray_address is not None:
            problem = ray_address_problem(self.ray_address)
            if problem:
                fail(
                    "verl.ray_address",
                    f"{self.ray_address!r}: {problem}; start the cluster with `ray start --head` (and "
                    "`ray start --address HEAD:6379` on the other nodes), or set ray_address: null to start "
                    "a local one",
                )
        from agl_trainer.backends.verl.overrides import override_problem

        for key in self.override:
            problem = override_problem(key)
            if problem:
                fail("verl.override", f"{problem}; see agl_trainer/backends/verl/overrides.py")

    @property
    def has_cuda(self) -> bool:
        if self.cuda_available is not None:
            return self.cuda_available
        import torch

        return torch.cuda.is_available()

    @property
    def device(self) -> str:
        """Where the workers compute: cpu or cuda."""
        name = self.training.device
        if name == "auto":
            return "cuda" if self.has_cuda else "cpu"
        return "cpu" if name == "cpu" else "cuda"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    @property
    def dp_size(self) -> int:
        return self.world_size // self.ulysses_sequence_parallel_size


def ray_address_problem(address: str, timeout_s: float = 3.0) -> str | None:
    """A quick reachability check of HOST:PORT or ray://HOST:PORT (`auto` is left to Ray)."""
    if address == "auto" or address.startswith("local"):
        return None
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return "not HOST:PORT, ray://HOST:PORT or auto"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as error:
        return f"nothing answers at {host}:{port} ({error.strerror or error})"


def has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None
