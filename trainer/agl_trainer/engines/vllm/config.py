"""The vLLM engine's settings: `VLLMOptions` (`engine.options` of `engine.name: vllm`, typed once: the
config's loader checks them, `agl train --help` lists them), `VLLMConfig` (the model, replicas and
those options; validated on construction), where the servers' Python is,
which device they run on and which weight path (in_place, nccl, cuda_ipc) that device allows.

Light to import (no httpx, no torch): `agl train --dry-run` checks these without starting anything.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from agl_trainer.engines.device_step import MAX_DEVICE_STEP_MS, check_device_step_ms

WORKER_MODULE = "agl_vllm_worker"
WORKER_CLASS = "WeightSyncExtension"
LOAD_METHOD = "agl_load_weights"
LORA_METHOD = "agl_load_adapter"  # (directory, vLLM's adapter id): LoRA sync, lora.py
ADAPTER_IDS_METHOD = "agl_adapter_ids"
LORA_LOGITS_METHOD = "agl_patch_lora_logits"  # vLLM 0.32's LoRA + prompt_logprobs crash: worker.py
PROGRESS_METHOD = "agl_request_progress"  # while paused with mode=keep: request id -> output tokens
STEP_DELAY_METHOD = "agl_set_step_delay"  # device_step_ms, in seconds
REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
LOG_TAIL_LINES = 40
KEEP_ALIVE_S = 3600


def _doc(text: str, **constraints: Any) -> Any:
    return msgspec.Meta(description=text, **constraints)


class VLLMOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """`engine.options` when `engine.name: vllm`: how to run (or reach) the servers. Types and ranges are
    checked as a config is read; `__post_init__` checks the rest (also for options built in code)."""

    urls: Annotated[list[str], _doc("attach to these servers (base URLs, no /v1) instead of starting any")] = []
    python: Annotated[
        str | None, _doc("interpreter with vllm installed (default: $AGL_VLLM_PYTHON, else .venv-vllm, else this one)")
    ] = None
    served_model_name: Annotated[str | None, _doc("the name served (default: model.name)")] = None
    host: Annotated[str, _doc("address the started servers listen on")] = "127.0.0.1"
    ports: Annotated[list[int], _doc("one port per replica (empty: free ports)")] = []
    device: Annotated[Literal["auto", "cpu", "cuda"], _doc("where the servers run (auto: cuda when torch sees one)")] = "auto"
    dtype: Annotated[str, _doc("vLLM's --dtype (auto: float32 on the CPU, for exact logprobs against the trainer)")] = "auto"
    max_model_len: Annotated[
        Annotated[int, msgspec.Meta(ge=16)] | None, _doc("longest prompt + completion (null: vLLM's, from the model)")
    ] = None
    enforce_eager: Annotated[bool | None, _doc("no CUDA graphs (null: true on the CPU, where there are none)")] = None
    kv_cache_space_gb: Annotated[
        int, _doc("CPU only: VLLM_CPU_KVCACHE_SPACE (vLLM's default takes 21 GB)", ge=1)
    ] = 1
    gpu_memory_utilization: Annotated[
        Annotated[float, msgspec.Meta(gt=0, le=1)] | None, _doc("GPU only: vLLM's share of GPU memory (null: vLLM's)")
    ] = None
    collocated: Annotated[
        bool, _doc("GPU: start with --enable-sleep-mode, so the servers sleep while the trainer trains")
    ] = False
    sleep_level: Annotated[Literal[1, 2], _doc("vLLM's sleep level (1: weights to CPU memory; 2: dropped)")] = 1
    pause_mode: Annotated[
        Literal["wait", "abort", "keep", "none"], _doc("vLLM's /pause mode for a weight update")
    ] = "wait"
    # recompute: vLLM preempts the frozen requests and recomputes their prefix (prompt + tokens so
    # far) with the new weights, and the prefix cache is emptied; keep: the old weights' KV stays,
    # and the prefix cache cannot be emptied while requests hold blocks (new requests may then reuse
    # the old weights' KV of a shared prefix: start vLLM with --no-enable-prefix-caching).
    switch_kv: Annotated[
        Literal["recompute", "keep"],
        _doc("loop.switch=keep: a frozen request's KV cache on thaw: recomputed with the new weights, or kept"),
    ] = "recompute"
    # For CPU benches that model an accelerator's batch-independent decode step, and for tests that
    # need a generation slower than a pause takes to land (as the embedded engine's option).
    device_step_ms: Annotated[
        float, _doc("simulated device time: each engine step first waits this long (0: off)", ge=0, le=MAX_DEVICE_STEP_MS)
    ] = 0.0
    # > 0 serves the base once and the trained adapter under the model name, and takes adapter-only
    # updates (lora.py, accepts_adapters).
    lora_rank: Annotated[
        int, _doc("LoRA adapters served (0: none); set from backend.lora.rank, set it only there", ge=0, le=512)
    ] = 0
    extra_args: Annotated[list[str], _doc("more vllm serve flags, e.g. [--tensor-parallel-size, 2]")] = []
    env: Annotated[dict[str, str], _doc("extra environment variables for the servers")] = {}
    weights_dir: Annotated[str | None, _doc("where weight updates are written (default: /dev/shm)")] = None
    log_dir: Annotated[str | None, _doc("the servers' logs (default: a temporary directory)")] = None
    startup_timeout_s: Annotated[float, _doc("how long a server may take to start", gt=0)] = 900.0
    request_timeout_s: Annotated[float, _doc("how long a control call may take", gt=0)] = 300.0
    watchdog_interval_s: Annotated[float, _doc("how often the watchdog checks the servers (0: no watchdog)", ge=0)] = 5.0
    max_restarts: Annotated[int, _doc("restarts per replica, then the error is raised", ge=0)] = 3
    # in_place: safetensors + collective_rpc (CPU and GPU); nccl, cuda_ipc: vLLM's GPU weight transfer
    # (transfer.py).
    weight_sync: Annotated[
        Literal["auto", "in_place", "nccl", "cuda_ipc"],
        _doc("how new weights reach the servers (auto: cuda_ipc for one GPU replica, nccl for several, in_place "
             "on the CPU); set from backend.verl.weight_sync when verl trains"),
    ] = "in_place"
    fault_skip_prefix_cache_reset: Annotated[
        bool, _doc("fault injection for the canary's test: an update leaves the prefix cache as it was")
    ] = False

    def __post_init__(self) -> None:
        for url in self.urls:
            if not url.startswith(("http://", "https://")) or url.rstrip("/").endswith("/v1"):
                raise ValueError(f"engine.options.urls: {url!r} must be a base URL like http://host:8000 (no /v1)")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"engine.options.sleep_level: must be 1 or 2, got {self.sleep_level}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError(f"engine.options.max_model_len: must be >= 16, got {self.max_model_len}")
        check_device_step_ms(self.device_step_ms)
        if not 0 <= self.lora_rank <= 512:
            raise ValueError(f"engine.options.lora_rank: must be in [0, 512] (0: no LoRA), got {self.lora_rank}")
        lora_flags = {"--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank"}
        if self.lora_rank and lora_flags & {arg.split("=", 1)[0] for arg in self.extra_args}:
            raise ValueError(
                "engine.options.extra_args: the engine sets vLLM's LoRA flags itself when lora_rank > 0 (fix: remove "
                f"{', '.join(sorted(lora_flags))} from extra_args)"
            )


class VLLMConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What the engine serves (model.path, engine.replicas) and its options (`engine.options`, taken as
    the config holds them). Validated on construction: errors name the key."""

    model: str | None = None  # model directory or name; required unless options.urls is given
    replicas: int = 1
    options: VLLMOptions = msgspec.field(default_factory=VLLMOptions)

    def __post_init__(self) -> None:
        if not self.options.urls and not self.model:
            raise ValueError(
                "engine.options.urls: none, and no model to serve (fix: set model.path, a model directory to serve, "
                "or engine.options.urls, servers to attach to)"
            )
        if self.replicas < 1:
            raise ValueError(f"engine.replicas: must be >= 1, got {self.replicas}")
        ports = self.options.ports
        if ports and len(ports) != self.replicas:
            raise ValueError(
                f"engine.options.ports: {len(ports)} entries for {self.replicas} replicas (fix: one per replica or none)"
            )


class VLLMError(RuntimeError):
    """A server failed to start, died, or refused a control call; the message carries the log tail."""



def resolve_python(configured: str | None) -> str:
    """The interpreter that has vllm: config, $AGL_VLLM_PYTHON, this checkout's .venv-vllm, us."""
    for candidate in (configured, os.environ.get("AGL_VLLM_PYTHON")):
        if candidate:
            if not Path(candidate).exists() and shutil.which(candidate) is None:
                raise VLLMError(
                    f"engine.options.python: {candidate!r} does not exist (run scripts/setup_vllm_venv.sh)"
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
    sync = config.options.weight_sync
    if sync == "auto":
        if device != "cuda":
            return "in_place"
        return "cuda_ipc" if config.replicas == 1 and not config.options.urls else "nccl"
    if sync == "in_place":
        return sync
    if device != "cuda":
        raise ValueError(
            f"engine.options.weight_sync: {sync} is vLLM's GPU weight transfer, but the engine runs on the CPU "
            "(the CPU build of vLLM answers /init_weight_transfer_engine with 500 'not configured'); use "
            "in_place (backend.verl.weight_sync: in_place or auto)"
        )
    if sync == "cuda_ipc":
        if config.replicas > 1 or len(config.options.urls) > 1:
            raise ValueError(
                "engine.options.weight_sync: cuda_ipc shares this process's GPU memory with one server; with "
                f"{max(config.replicas, len(config.options.urls))} replicas use nccl"
            )
        remote = [u for u in config.options.urls if not u.split("://", 1)[-1].startswith(("127.0.0.1", "localhost", "[::1]"))]
        if remote:
            raise ValueError(
                f"engine.options.weight_sync: cuda_ipc needs the server on this machine, but {remote[0]} is not "
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
