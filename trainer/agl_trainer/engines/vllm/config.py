"""The vLLM engine's settings: `VLLMConfig` (validated on construction), where the servers' Python is,
which device they run on and which weight path (in_place, nccl, cuda_ipc) that device allows.

Light to import (no httpx, no torch): `agl train --dry-run` checks these without starting anything.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec

WORKER_MODULE = "agl_vllm_worker"
WORKER_CLASS = "WeightSyncExtension"
LOAD_METHOD = "agl_load_weights"
LORA_METHOD = "agl_load_adapter"  # (directory, vLLM's adapter id): LoRA sync, lora.py
ADAPTER_IDS_METHOD = "agl_adapter_ids"
LORA_LOGITS_METHOD = "agl_patch_lora_logits"  # vLLM 0.32's LoRA + prompt_logprobs crash: worker.py
PROGRESS_METHOD = "agl_request_progress"  # while paused with mode=keep: request id -> output tokens
STEP_DELAY_METHOD = "agl_set_step_delay"  # device_step_ms, in seconds
MAX_DEVICE_STEP_MS = 10_000.0
REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
LOG_TAIL_LINES = 40
KEEP_ALIVE_S = 3600


class VLLMConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to run (or reach) the servers. Validated on construction: errors name the key."""

    model: str | None = None  # model directory or name; required unless `urls` is given
    urls: list[str] = []  # attach to these servers instead of starting any
    replicas: int = 1
    python: str | None = None  # interpreter with vllm installed (see module docstring)
    served_model_name: str | None = None  # default: the model path, as vLLM does
    host: str = "127.0.0.1"
    ports: list[int] = []  # one per replica; empty: free ports
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: str = "auto"  # "auto" means float32 on CPU (exact logprobs vs the trainer)
    max_model_len: int | None = None  # default: vLLM's, from the model's config
    enforce_eager: bool | None = None  # default: True on CPU (no graphs to capture there)
    kv_cache_space_gb: int = 1  # CPU only (VLLM_CPU_KVCACHE_SPACE); vLLM's default takes 21 GB
    gpu_memory_utilization: float | None = None  # GPU only
    collocated: bool = False  # GPU: start with --enable-sleep-mode so sleep()/wake_up() free memory
    sleep_level: int = 1
    pause_mode: Literal["wait", "abort", "keep", "none"] = "wait"
    # loop.switch=keep (freeze(), sync, thaw()): what a frozen request's KV cache becomes on thaw.
    # recompute: vLLM preempts the frozen requests and recomputes their prefix (prompt + tokens so
    # far) with the new weights, and the prefix cache is emptied; keep: the old weights' KV stays,
    # and the prefix cache cannot be emptied while requests hold blocks (new requests may then reuse
    # the old weights' KV of a shared prefix: start vLLM with --no-enable-prefix-caching).
    switch_kv: Literal["recompute", "keep"] = "recompute"
    # Simulated device time: each engine step first waits this long in the worker (as the embedded
    # engine's option of the same name). For CPU benches that model an accelerator's batch-independent
    # decode step, and for tests that need a generation slower than a pause takes to land.
    device_step_ms: float = 0.0
    # LoRA (lora.py): > 0 serves the base once and the trained adapter under the model name, and
    # takes adapter-only updates (accepts_adapters); the loop sets it from backend.lora.rank.
    lora_rank: int = 0
    extra_args: list[str] = []
    env: dict[str, str] = {}
    weights_dir: str | None = None  # where state_dicts are written; default /dev/shm
    log_dir: str | None = None  # server logs; default a temporary directory
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 300.0
    watchdog_interval_s: float = 5.0  # 0 disables the watchdog thread
    max_restarts: int = 3  # per replica, then the error is raised
    # How new weights reach the servers: in_place (safetensors + collective_rpc, CPU and GPU), or
    # vLLM's GPU weight transfer, nccl or cuda_ipc (transfer.py); auto: cuda_ipc for one
    # replica on a GPU, nccl for several, in_place on the CPU. The loop sets it from
    # backend.verl.weight_sync.
    weight_sync: Literal["auto", "in_place", "nccl", "cuda_ipc"] = "in_place"
    # Fault injection, for the canary's test (loop/canary.py): a weight update that leaves vLLM's
    # prefix cache as it was, so cached prefixes keep the old weights' KV. Never in a real run.
    fault_skip_prefix_cache_reset: bool = False

    def __post_init__(self) -> None:
        if not self.urls and not self.model:
            raise ValueError(
                "engine.vllm: set `model` (a model directory to serve) or `urls` (servers to attach to)"
            )
        if self.replicas < 1:
            raise ValueError(f"engine.vllm.replicas must be >= 1, got {self.replicas}")
        if self.ports and len(self.ports) != self.replicas:
            raise ValueError(
                f"engine.vllm.ports has {len(self.ports)} entries for {self.replicas} replicas: give one per replica or none"
            )
        for url in self.urls:
            if not url.startswith(("http://", "https://")) or url.rstrip("/").endswith("/v1"):
                raise ValueError(
                    f"engine.vllm.urls: {url!r} must be a base URL like http://host:8000 (no /v1)"
                )
        if self.sleep_level not in (1, 2):
            raise ValueError(f"engine.vllm.sleep_level must be 1 or 2, got {self.sleep_level}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError(f"engine.vllm.max_model_len must be >= 16, got {self.max_model_len}")
        check_device_step_ms(self.device_step_ms)
        if not 0 <= self.lora_rank <= 512:
            raise ValueError(
                f"engine.vllm.lora_rank must be in [0, 512] (0: no LoRA), got {self.lora_rank}"
            )
        lora_flags = {"--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank"}
        if self.lora_rank and lora_flags & {arg.split("=", 1)[0] for arg in self.extra_args}:
            raise ValueError(
                "engine.vllm.extra_args: the engine sets vLLM's LoRA flags itself when lora_rank > 0; remove "
                f"{', '.join(sorted(lora_flags))} from extra_args"
            )


def check_device_step_ms(milliseconds: float) -> float:
    if not 0.0 <= milliseconds <= MAX_DEVICE_STEP_MS:
        raise ValueError(f"engine.vllm.device_step_ms must be in [0, {MAX_DEVICE_STEP_MS:g}], got {milliseconds}")
    return milliseconds


def vllm_config(settings: Mapping[str, object]) -> VLLMConfig:
    """A VLLMConfig from plain settings (YAML, `engine.options`); unknown keys and wrong types are
    errors that name the key."""
    known = set(VLLMConfig.__struct_fields__)
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(
            f"engine.vllm: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    try:
        return msgspec.convert(dict(settings), VLLMConfig)
    except msgspec.ValidationError as error:
        message = str(error)
        raise ValueError(
            message if message.startswith("engine.vllm") else f"engine.vllm: {message}"
        ) from None


class VLLMError(RuntimeError):
    """A server failed to start, died, or refused a control call; the message carries the log tail."""



def resolve_python(configured: str | None) -> str:
    """The interpreter that has vllm: config, $AGL_VLLM_PYTHON, this checkout's .venv-vllm, us."""
    for candidate in (configured, os.environ.get("AGL_VLLM_PYTHON")):
        if candidate:
            if not Path(candidate).exists() and shutil.which(candidate) is None:
                raise VLLMError(
                    f"engine.vllm.python: {candidate!r} does not exist (run scripts/setup_vllm_venv.sh)"
                )
            return candidate
    return str(DEFAULT_VENV_PYTHON) if DEFAULT_VENV_PYTHON.exists() else sys.executable


def resolve_device(device: str) -> Literal["cpu", "cuda"]:
    if device != "auto":
        return device  # type: ignore[return-value]
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def resolve_weight_sync(config: VLLMConfig, device: str) -> Literal["in_place", "nccl", "cuda_ipc"]:
    """The weight path for `device`; a GPU path that cannot work is refused here, before any start."""
    sync = config.weight_sync
    if sync == "auto":
        if device != "cuda":
            return "in_place"
        return "cuda_ipc" if config.replicas == 1 and not config.urls else "nccl"
    if sync == "in_place":
        return sync
    if device != "cuda":
        raise ValueError(
            f"engine.vllm.weight_sync: {sync} is vLLM's GPU weight transfer, but the engine runs on the CPU "
            "(the CPU build of vLLM answers /init_weight_transfer_engine with 500 'not configured'); use "
            "in_place (backend.verl.weight_sync: in_place or auto)"
        )
    if sync == "cuda_ipc":
        if config.replicas > 1 or len(config.urls) > 1:
            raise ValueError(
                "engine.vllm.weight_sync: cuda_ipc shares this process's GPU memory with one server; with "
                f"{max(config.replicas, len(config.urls))} replicas use nccl"
            )
        remote = [u for u in config.urls if not u.split("://", 1)[-1].startswith(("127.0.0.1", "localhost", "[::1]"))]
        if remote:
            raise ValueError(
                f"engine.vllm.weight_sync: cuda_ipc needs the server on this machine, but {remote[0]} is not "
                "loopback; use nccl"
            )
    return sync


def workers_per_server(extra_args: list[str]) -> int:
    """vLLM workers of one server (tensor x pipeline parallel): the NCCL group's other ranks."""
    size = 1
    for flags in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        for i, arg in enumerate(extra_args):
            value = None
            if arg in flags and i + 1 < len(extra_args):
                value = extra_args[i + 1]
            elif arg.startswith(tuple(f + "=" for f in flags)):
                value = arg.split("=", 1)[1]
            if value is not None:
                size *= int(value)
    return size
