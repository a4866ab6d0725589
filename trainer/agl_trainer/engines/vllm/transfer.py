"""GPU weight transfer into vLLM servers: vLLM's own NCCL or CUDA-IPC weight-transfer engines.

    transfer = GpuWeightTransfer("nccl", urls, workers_per_server=1, host="127.0.0.1")
    transfer.send(state_dict, version=3)      # every server, through vLLM's trainer-side engine
    transfer.forget(url)                      # a restarted server: its next send initialises again
    transfer.close()

`engine.options.weight_sync` (set from `backend.verl.weight_sync`) chooses it; `in_place` (the default)
is VLLMEngine's safetensors + collective_rpc path, the only one the CPU build of vLLM has.

- nccl: per server, vLLM's `NCCLTrainerWeightTransferEngine` opens a NCCL group with the server's
  workers (this process is rank 0, the workers follow) through `/init_weight_transfer_engine`,
  then each update broadcasts every tensor from this process's GPU while the server receives them
  in `/update_weights`. The server runs with `--weight-transfer-config '{"backend": "nccl"}'`.
- cuda_ipc: vLLM's `IPCTrainerWeightTransferEngine` shares the tensors' CUDA memory with the
  server's workers by IPC handles (no copy through the host); the server runs with
  `--weight-transfer-config '{"backend": "ipc"}'` and VLLM_ALLOW_INSECURE_SERIALIZATION=1 (the
  handles travel pickled over HTTP). The tensors must live on the GPU the server's worker uses, so
  this path serves one replica on this process's current GPU (the collocated single-GPU case).

The tensors come from the trainer's state dict (verl gathers the FSDP shards per tensor; rank 0's
copy arrives here) and are moved to this process's current CUDA device once per update. vLLM, with
its `requests`-based HTTP client, must be importable in this interpreter (the `gpu` extra).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from agl_trainer.addresses import free_port

if TYPE_CHECKING:
    import torch

GpuSync = Literal["nccl", "cuda_ipc"]
SERVER_BACKEND = {"nccl": "nccl", "cuda_ipc": "ipc"}  # agl's name -> vLLM's WeightTransferConfig.backend


class WeightTransferError(RuntimeError):
    """The GPU weight transfer cannot run here or failed; the message says which and the fix."""


def server_arguments(sync: GpuSync) -> list[str]:
    """The vLLM server flags that enable the weight-transfer endpoints for `sync`."""
    return ["--weight-transfer-config", '{"backend": "%s"}' % SERVER_BACKEND[sync]]


def server_environment(sync: GpuSync) -> dict[str, str]:
    # IPC handles are pickled into the /update_weights body; vLLM refuses to unpickle without this.
    return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if sync == "cuda_ipc" else {}


def unique_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors that share storage (tied embeddings) once, under their first name, as the in-place
    path writes them: vLLM ties them again when it loads."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def _vllm() -> Any:
    try:
        from vllm.distributed.weight_transfer import base, clients  # noqa: F401
    except ImportError as error:
        raise WeightTransferError(
            f"weight_sync nccl/cuda_ipc drives vLLM's weight-transfer engines from this process, but vllm "
            f"is not importable here ({error}); install the `gpu` extra (pip install 'agl[gpu]') or use "
            "weight_sync: in_place"
        ) from None
    import vllm.distributed.weight_transfer as transfer

    return transfer


def state_dict_source(tensors: dict[str, torch.Tensor]) -> Any:
    """A vLLM `WeightSource` over a dict of full tensors (metadata and iteration in the same order)."""
    import torch
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateDictSource(WeightSource):
        def __init__(self, weights: dict[str, torch.Tensor]) -> None:
            self.weights = weights

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.weights.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from self.weights.items()

    return StateDictSource(tensors)


class GpuWeightTransfer:
    """One vLLM trainer-side engine per server, initialised at its first send."""

    def __init__(self, sync: GpuSync, *, workers_per_server: int = 1, host: str = "127.0.0.1",
                 timeout_s: float = 300.0) -> None:  # fmt: skip
        if sync not in SERVER_BACKEND:
            raise WeightTransferError(f"weight_sync {sync!r} is not a GPU transfer (nccl or cuda_ipc)")
        self.sync = sync
        self.workers_per_server = workers_per_server
        self.host = host
        self.timeout_s = timeout_s
        self._engines: dict[str, Any] = {}
        self._source: Any = None

    def send(self, urls: list[str], state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        import torch

        if not torch.cuda.is_available():
            raise WeightTransferError(
                f"weight_sync {self.sync}: this process has no CUDA device to send from; use weight_sync: in_place"
            )
        _vllm()
        if self.sync == "cuda_ipc" and len(urls) != 1:
            raise WeightTransferError(
                f"weight_sync cuda_ipc shares this process's GPU memory with one server; got {len(urls)} "
                "servers (use weight_sync: nccl for several replicas)"
            )
        device = torch.device("cuda", torch.cuda.current_device())
        tensors = {name: t.detach().to(device, non_blocking=True) for name, t in unique_tensors(state_dict).items()}
        torch.cuda.synchronize(device)
        if self._source is None:
            self._source = state_dict_source(tensors)
        else:
            self._source.weights = tensors  # the engines hold the source: it is re-iterated each round
        for url in urls:
            engine = self._engines.get(url) or self._init(url)
            try:
                engine.send_weights()
            except Exception as error:
                self.forget(url)  # the group is unusable after a failed round; re-initialise next time
                raise WeightTransferError(f"weight transfer v{version} to {url} failed: {error}") from error
        del tensors

    def _init(self, url: str) -> Any:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        client = HTTPVLLMWeightSyncClient(url, timeout=self.timeout_s)
        if self.sync == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )

            info = NCCLTrainerInitInfo(
                master_address=self.host, master_port=free_port(self.host),
                world_size=1 + self.workers_per_server, rank=0,
            )  # fmt: skip
            engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=self._source)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import (
                IPCTrainerInitInfo,
                IPCTrainerWeightTransferEngine,
            )

            engine = IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0), client=client, source=self._source)
        self._engines[url] = engine
        return engine

    def forget(self, url: str) -> None:
        engine = self._engines.pop(url, None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - a dead server's group cannot be shut down cleanly
                pass

    def close(self) -> None:
        for url in list(self._engines):
            self.forget(url)
        self._source = None
