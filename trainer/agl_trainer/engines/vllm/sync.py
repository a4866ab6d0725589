"""The weight-sync paths of the vLLM engine, one small class each behind one protocol: how new
weights reach a server's workers while the engine holds the server paused.

- InPlaceSync: a safetensors directory, read by every worker through vLLM's reload_weights
  (`agl_load_weights` over /collective_rpc, worker.py); the CPU build's only path.
- AdapterSync: a LoRA adapter's directory (peft's format, lora.py) loaded in place of the served
  adapter under its vLLM id (`agl_load_adapter`); the id is learned at start (`find`).
- NcclSync, CudaIpcSync: vLLM's own weight-transfer engines (transfer.py): the tensors broadcast
  over NCCL, or shared by CUDA IPC handles with one local replica.

The engine (engine.py) owns the order: pause, the path's load, prefix cache emptied, version set,
resume; and which path a sync takes (full weights or an adapter, weight_sync).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from agl_trainer.engines.vllm.admin import AdminClient
from agl_trainer.engines.vllm.config import (
    ADAPTER_IDS_METHOD,
    LOAD_METHOD,
    LORA_LOGITS_METHOD,
    LORA_METHOD,
    VLLMError,
)
from agl_trainer.engines.vllm.lora import AdapterFiles
from agl_trainer.engines.vllm.lora import server_arguments as lora_arguments
from agl_trainer.engines.vllm.transfer import (
    GpuSync,
    GpuWeightTransfer,
    WeightTransferError,
    server_arguments,
    server_environment,
)
from agl_trainer.weights.files import write_safetensors
from agl_trainer.weights.update import WeightUpdate


class SyncPath(Protocol):
    """What the engine asks of every path: the server flags and environment it needs."""

    def server_arguments(self) -> list[str]: ...

    def server_environment(self) -> dict[str, str]: ...


def worker_results(results: list[Any]) -> list[dict]:
    """The workers' answers that are reports (a dict each), as agl_load_weights returns them."""
    return [r for r in results if isinstance(r, dict)]


class InPlaceSync:
    """Full weights from a directory every server can read (same machine or a shared filesystem):
    a given save_pretrained directory, or a state_dict written as safetensors under the engine's
    weights directory (its older versions deleted once a newer one is loaded)."""

    def __init__(self, admin: AdminClient) -> None:
        self._admin = admin
        self.written: list[Path] = []  # the directories this path wrote (and may delete)

    def write(self, update: WeightUpdate, root: Path) -> tuple[Path, float]:
        """The update's directory, and the seconds writing it took (0 for a given directory)."""
        if update.directory is not None:
            directory = Path(update.directory).resolve()
            if not any(directory.glob("*.safetensors")):
                raise VLLMError(f"weight update v{update.version}: no *.safetensors in {directory}")
            return directory, 0.0
        if update.state_dict is None:
            raise VLLMError(f"weight update v{update.version} has neither state_dict nor directory")
        started = time.perf_counter()
        directory = write_safetensors(update.state_dict, root / f"v{update.version}")
        if directory not in self.written:
            self.written.append(directory)
        return directory, time.perf_counter() - started

    def prune(self, keep: Path) -> None:
        """Drop the directories written for older versions (a restart needs only the latest)."""
        for old in [path for path in self.written if path != keep]:
            shutil.rmtree(old, ignore_errors=True)
            self.written.remove(old)

    def server_arguments(self) -> list[str]:
        return []

    def server_environment(self) -> dict[str, str]:
        return {}

    def load(self, url: str, directory: Path) -> list[dict]:
        return worker_results(self._admin.rpc(url, LOAD_METHOD, str(directory)))


class AdapterSync:
    """A LoRA adapter loaded in place of the one a server serves under `adapter_name` (lora.py)."""

    def __init__(self, admin: AdminClient, files: AdapterFiles, adapter_name: str) -> None:
        self._admin = admin
        self.files = files
        self.adapter_name = adapter_name
        self.ids: dict[str, int] = {}  # vLLM's id of the served adapter, by server URL

    def server_arguments(self) -> list[str]:
        """The base under an internal name, the adapter under the harness's model name."""
        return lora_arguments(self.files.rank, self.adapter_name, self.files.current)

    def server_environment(self) -> dict[str, str]:
        return {}

    def find(self, url: str) -> None:
        """Check the server serves the adapter under the model's name and learn its vLLM id."""
        cards = self._admin.models(url)
        if not any(card.get("id") == self.adapter_name and card.get("parent") for card in cards):
            raise VLLMError(
                f"vLLM {url} does not serve the LoRA adapter {self.adapter_name!r} (it serves "
                f"{[card.get('id') for card in cards]}): start it with {' '.join(self.server_arguments())}"
            )
        held = {tuple(ids) for ids in self._admin.rpc(url, ADAPTER_IDS_METHOD)}
        if len(held) != 1 or len(next(iter(held))) != 1:
            raise VLLMError(
                f"vLLM {url}: its workers hold adapters {sorted(held)}, agl serves exactly one "
                f"({self.adapter_name!r}, --max-loras 1)"
            )
        self.ids[url] = next(iter(held))[0]
        self._admin.rpc(url, LORA_LOGITS_METHOD)

    def load(self, url: str, directory: Path) -> list[dict]:
        """Every worker of the server loads the adapter in `directory` in place of the served one."""
        return worker_results(self._admin.rpc(url, LORA_METHOD, str(directory), self.ids[url]))


class GpuTransferSync:
    """vLLM's weight-transfer engines (transfer.py), one per server, from this process's GPU."""

    sync: GpuSync

    def __init__(self, *, workers_per_server: int, host: str, timeout_s: float) -> None:
        self.transfer = GpuWeightTransfer(
            self.sync, workers_per_server=workers_per_server, host=host, timeout_s=timeout_s
        )

    def server_arguments(self) -> list[str]:
        return server_arguments(self.sync)

    def server_environment(self) -> dict[str, str]:
        return server_environment(self.sync)

    def send(self, urls: list[str], state_dict: Mapping[str, Any], version: int) -> None:
        try:
            self.transfer.send(urls, state_dict, version)
        except WeightTransferError as error:
            raise VLLMError(str(error)) from error

    def forget(self, url: str) -> None:
        """A restarted server: its NCCL group or IPC engine died with it."""
        self.transfer.forget(url)

    def close(self) -> None:
        self.transfer.close()


class NcclSync(GpuTransferSync):
    """The tensors broadcast from this process's GPU to every server's workers over NCCL."""

    sync: GpuSync = "nccl"


class CudaIpcSync(GpuTransferSync):
    """The tensors' CUDA memory shared with one local server's workers by IPC handles (no copy)."""

    sync: GpuSync = "cuda_ipc"


GPU_PATHS: dict[str, type[GpuTransferSync]] = {"nccl": NcclSync, "cuda_ipc": CudaIpcSync}
