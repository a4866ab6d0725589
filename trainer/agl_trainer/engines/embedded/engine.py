"""The embedded engine: an OpenAI-compatible server over a transformers model, for CPU machines.

    from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig, EmbeddedOptions

    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path="runs/demo/model", served_model_name="tiny",
                                                 options=EmbeddedOptions(max_model_len=512)))
    engine.start()                       # own thread + event loop, 127.0.0.1, a free port
    engine.urls                          # ["http://127.0.0.1:PORT"]; the API is under /v1
    seconds = engine.update_weights(WeightUpdate(version=1, state_dict=backend.state_dict_for_engine()))
    engine.stop()

It is the default engine for the demo and the tests, not a rival to vLLM: it speaks vLLM's wire
format (`return_token_ids`, `prompt_token_ids`, `logprobs`, `stop_reason`, streaming chunks,
errors) so the sidecar and the trainer cannot tell it from a vLLM server, and it batches
concurrent requests continuously (see batching.py), which is what makes a 2-core machine
usable. Routes: POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize;
GET /v1/models, /health, /ping, /version, /metrics (Prometheus text).

Its modules: this one (configuration, lifecycle, weight updates), routes.py (HTTP
handlers), requests.py (request validation), stream.py (following generation,
the one streaming loop), wire.py (vLLM's wire format), batching.py (continuous
batching and sampling), in_place.py (in-place state_dict loading).

Supported request fields: model, messages / prompt, max_tokens (max_completion_tokens), n, seed,
temperature, top_p, top_k, stop, stop_token_ids, ignore_eos, logprobs, top_logprobs, prompt_logprobs,
return_token_ids, return_tokens_as_token_ids, skip_special_tokens, stream,
stream_options.include_usage, logit_bias, tools, add_generation_prompt, continue_final_message,
chat_template_kwargs. Tool calls are not parsed out of the text (the model's text is returned
as content). Logprobs are the model's raw ones (vLLM's default `raw_logprobs`).

`update_weights` swaps a state_dict (Hugging Face names; tied weights may be given once) or a
save_pretrained directory into the model in place, between batching steps, and returns seconds.
There is no prefix cache, so no stale KV survives an update between requests; a sequence still
generating across an update (the loop drains the sidecar first, so normally none) keeps the KV of
its earlier tokens and continues with the new weights. `update_adapter` is the LoRA sync: only the
adapter comes (peft's format, weights/peft_files.py), merged into the base weights the engine loaded,
each adapter replacing the last (an adapter on a tied output head unties the served head first).
`last_update_bytes` is what the latest update of either kind moved.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from agl_trainer.background_loop import BackgroundLoop
from agl_trainer.engines.embedded.batching import BatchScheduler, Sequence
from agl_trainer.engines.embedded.in_place import load_in_place
from agl_trainer.engines.embedded.options import EmbeddedOptions
from agl_trainer.engines.embedded.requests import RequestReader
from agl_trainer.engines.embedded.routes import EngineRoutes
from agl_trainer.engines.embedded.stream import deliver
from agl_trainer.weights.files import read_safetensors
from agl_trainer.weights.merge import AdapterMerger
from agl_trainer.weights.update import AdapterState, WeightUpdate


@dataclass(frozen=True)
class EmbeddedEngineConfig:
    """What the engine serves (from model.path, model.name and engine.max_batch) and its options
    (`engine.options`, taken as the config holds them)."""

    model_path: str | Path
    served_model_name: str | tuple[str, ...] = "tiny"
    max_batch_size: int = 256
    options: EmbeddedOptions = EmbeddedOptions()


class EmbeddedEngine:
    """An InferenceEngine (engines/base.py) serving one transformers model from this process."""

    accepts_adapters = True  # a WeightUpdate with an adapter: merged into the pristine base (update_adapter)
    keeps_kv_at_switch = True  # thaw() continues a frozen call over the KV it had

    def __init__(self, config: EmbeddedEngineConfig) -> None:
        self.config = config
        self.options = config.options
        names = config.served_model_name
        self.served_names = [names] if isinstance(names, str) else list(names)
        if not self.served_names:
            raise ValueError("EmbeddedEngineConfig.served_model_name: give at least one name")
        self.policy_version = 0
        self.model: Any = None
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.created = int(time.time())
        self.reader: RequestReader | None = None  # set by start(), once the model is loaded
        self._scheduler: BatchScheduler | None = None
        self._http = BackgroundLoop("agl-embedded-http")
        self._runner: Any = None
        self._port = 0
        self._adapters = AdapterMerger()
        self.last_update_bytes = 0  # what the latest update_weights or update_adapter moved

    # --- InferenceEngine ---------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        if not self._port:
            raise RuntimeError("EmbeddedEngine.urls: call start() first")
        return [f"http://{self.options.host}:{self._port}"]

    @property
    def scheduler(self) -> BatchScheduler | None:
        """The batching scheduler while the engine runs (None before start() and after stop())."""
        return self._scheduler

    def start(self) -> None:
        if self._http.started:
            return
        self._load()
        self._scheduler = BatchScheduler(
            self.model,
            self.tokenizer,
            self.max_model_len,
            self._on_update,
            self.config.max_batch_size,
            device_step_s=self.options.device_step_ms / 1000.0,
        )
        self._scheduler.start()
        try:
            self._http.start(self._start_http, lambda: self._runner.cleanup())
        except BaseException as error:
            self.stop()
            if not isinstance(error, Exception):  # Ctrl-C while it started: not a listen failure
                raise
            raise RuntimeError(
                f"EmbeddedEngine: could not listen on {self.options.host}:{self.options.port}: {error}"
            ) from error

    def stop(self) -> None:
        if self._scheduler is not None:  # first, while the loop runs: requests in flight end aborted
            self._scheduler.stop()
        self._http.stop(timeout_s=30)
        self._scheduler, self._port = None, 0

    def update_weights(self, update: WeightUpdate) -> float:
        if update.adapter is not None:
            return self.update_adapter(update.version, update.adapter)
        started = time.perf_counter()
        if update.state_dict is not None:
            state = update.state_dict
        elif update.directory is not None:
            state = read_safetensors(Path(update.directory))
        else:
            raise ValueError("update_weights: the WeightUpdate has neither state_dict nor directory")
        with self._weights_lock():
            if not self.options.fault_skip_weight_load:
                load_in_place(self.model, state)
                self._adapters.forget()  # these weights are the base a later adapter merges into
            self.policy_version = update.version
        self.last_update_bytes = sum(t.numel() * t.element_size() for t in state.values())
        return time.perf_counter() - started

    def update_adapter(self, version: int, adapter: AdapterState) -> float:
        """The LoRA sync: serve base + this adapter from now on (it replaces the previous one; the base
        is the weights loaded at start or by the last update_weights). Returns seconds."""
        started = time.perf_counter()
        with self._weights_lock():
            if not self.options.fault_skip_weight_load:
                self._adapters.apply(self.model, adapter)
            self.policy_version = version
        self.last_update_bytes = adapter.nbytes
        return time.perf_counter() - started

    def _weights_lock(self) -> Any:
        return self._scheduler.weights_lock if self._scheduler is not None else threading.RLock()

    def freeze(self) -> dict[str, int]:
        """Freeze the requests in flight in place (a drain-free policy switch): no step runs until
        thaw(); their tokens and KV cache are kept. Returns, by request id (the response's `id`;
        `<id>-<i>` for choice i > 0), the completion tokens each had generated."""
        if self._scheduler is None:
            return {}
        return self._scheduler.freeze()

    def thaw(self) -> None:
        """Continue the frozen requests, now under the weights loaded meanwhile."""
        if self._scheduler is not None:
            self._scheduler.thaw()

    def sleep(self) -> bool:
        """Nothing to free: the model shares the process's memory with the trainer's."""
        return False

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- model ---------------------------------------------------------------------------------
    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(self.config.model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"EmbeddedEngine: {path} is not a model directory (no config.json); build one with "
                "agl_trainer.models.tiny or save_pretrained()"
            )
        if self.options.torch_threads:
            torch.set_num_threads(self.options.torch_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.options.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"engine.options.device: {self.options.device!r}, but torch sees no CUDA device here "
                "(fix: set engine.options.device: cpu)"
            )
        self.model = (
            AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.options.dtype))
            .to(self.options.device)
            .eval()
        )
        limit = getattr(self.model.config, "max_position_embeddings", 4096) or 4096
        self.max_model_len = self.options.max_model_len or min(limit, 4096)
        self.reader = RequestReader(self.model, self.tokenizer, self.served_names, self.max_model_len)

    def _on_update(self, updates: list[tuple[Sequence, int, bool]]) -> None:
        """Called on the scheduler thread after each step: hand the updates to the event loop."""
        loop = self._http.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(deliver, updates)

    # --- HTTP ----------------------------------------------------------------------------------
    async def _start_http(self) -> None:
        from aiohttp import web

        assert self.reader is not None  # _load() ran in start()
        app = EngineRoutes(self, self.reader).app()
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.options.host, self.options.port)
        await site.start()
        self._port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
