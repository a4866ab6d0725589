"""verl's CPU platform: verl 0.9.1 ships CUDA, NPU and ROCm platforms only.

verl loads this module in every process that imports it when the environment says so
(`platform_env()`: VERL_USE_EXTERNAL_MODULES names this module, VERL_PLATFORM=cpu); importing it
registers `PlatformCPU` (device "cpu", collectives over gloo, Ray resource "CPU", no IPC) and gives
`torch.cpu` the few device functions verl calls that it lacks (memory statistics are 0, RNG is the
CPU generator). VERL_ENGINE_DEVICE=cuda makes verl pick its FSDP engine, which is registered for
cuda/npu only but runs on whatever device the platform names.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

from agl_trainer.backends.verl.platform_env import PLATFORM_NAME, platform_env  # noqa: F401


def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


def _mem_get_info(*_args: Any, **_kwargs: Any) -> tuple[int, int]:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return free, total


_CPU_DEVICE_FUNCTIONS = {
    "empty_cache": _nothing,
    "ipc_collect": _nothing,
    "reset_peak_memory_stats": _nothing,
    "memory_allocated": _zero,
    "memory_reserved": _zero,
    "max_memory_allocated": _zero,
    "max_memory_reserved": _zero,
    "mem_get_info": _mem_get_info,
    "get_device_name": lambda *_a, **_k: "CPU",
    "manual_seed": lambda seed: torch.manual_seed(seed) and None,
    "manual_seed_all": lambda seed: torch.manual_seed(seed) and None,
    "get_rng_state": lambda *_a, **_k: torch.get_rng_state(),
    "set_rng_state": lambda state, *_a, **_k: torch.set_rng_state(state),
}


def patch_torch_cpu() -> None:
    """Add the missing functions to torch.cpu; never replaces one torch has."""
    for name, function in _CPU_DEVICE_FUNCTIONS.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, function)


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return torch.cpu

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"  # verl moves tensors with .to(current_device()); an int would mean cuda:N

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "AGL_VISIBLE_CPUS"  # nothing to hide on a CPU; verl only reads it

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


patch_torch_cpu()
