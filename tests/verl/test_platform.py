"""agl's CPU platform for verl: registered, device cpu, gloo, and loaded by verl itself from the
environment in a fresh process (which is how every Ray worker gets it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch


def test_platform_is_registered_as_cpu_with_gloo():
    from agl_trainer.backends.verl.platform import PlatformCPU
    from verl.plugin.platform.platform_manager import PlatformRegistry

    assert PlatformRegistry.get("cpu") is PlatformCPU
    platform = PlatformCPU()
    assert platform.device_name == "cpu" and platform.communication_backend_name() == "gloo"
    assert platform.ray_resource_name() == "CPU" and not platform.is_ipc_supported()
    assert platform.current_device() == "cpu"  # .to(current_device()) must not mean cuda:0
    for name in (
        "empty_cache",
        "memory_allocated",
        "max_memory_allocated",
        "mem_get_info",
        "manual_seed_all",
    ):
        assert callable(getattr(torch.cpu, name)), name
    free, total = torch.cpu.mem_get_info()
    assert 0 < free <= total


def test_verl_loads_the_platform_from_the_environment_in_a_fresh_process():
    from agl_trainer.backends.verl.platform_env import platform_env

    code = (
        "import json, torch, verl\n"
        "from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device\n"
        "from verl.workers.engine import EngineRegistry\n"
        "cls = EngineRegistry.get_engine_cls('language_model', 'fsdp2')\n"
        "print(json.dumps([get_device_name(), get_nccl_backend(), get_torch_device() is torch.cpu, cls.__name__]))\n"
    )
    env = {**os.environ, **platform_env()}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    device, backend, is_cpu_module, engine = json.loads(out.stdout.strip().splitlines()[-1])
    assert (device, backend, is_cpu_module, engine) == ("cpu", "gloo", True, "FSDPEngineWithLMHead")
