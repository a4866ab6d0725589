"""The embedded engine: an OpenAI-compatible server over a transformers model, for CPU machines.

    from agl_trainer.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig

    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path="runs/demo/model", served_model_name="tiny"))
    engine.start()                       # own thread + event loop, 127.0.0.1, a free port
    engine.urls                          # ["http://127.0.0.1:PORT"]; the API is under /v1
    seconds = engine.update_weights(WeightUpdate(version=1, state_dict=backend.state_dict_for_engine()))
    engine.stop()

It is the default engine for the demo and the tests, not a rival to vLLM: it speaks vLLM's wire
format (`return_token_ids`, `prompt_token_ids`, `logprobs`, `stop_reason`, streaming chunks,
errors) so the sidecar and the trainer cannot tell it from a vLLM server, and it batches
concurrent requests continuously (see embedded_batching.py), which is what makes a 2-core machine
usable. Routes: POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize;
GET /v1/models, /health, /ping, /version, /metrics (Prometheus text).

Supported request fields: model, messages / prompt, max_tokens (max_completion_tokens), n, seed,
temperature, top_p, top_k, stop, stop_token_ids, ignore_eos, logprobs, top_logprobs,
return_token_ids, return_tokens_as_token_ids, skip_special_tokens, stream,
stream_options.include_usage, logit_bias, tools, add_generation_prompt, continue_final_message,
chat_template_kwargs. Tool calls are not parsed out of the text (the model's text is returned
as content). Logprobs are the model's raw ones (vLLM's default `raw_logprobs`).

`update_weights` swaps a state_dict (Hugging Face names; tied weights may be given once) or a
save_pretrained directory into the model in place, between batching steps, and returns seconds.
There is no prefix cache, so no stale KV survives an update between requests; a sequence still
generating across an update (the loop drains the sidecar first, so normally none) keeps the KV of
its earlier tokens and continues with the new weights.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any, Self

import msgspec

from agl_trainer.engines import embedded_wire as wire
from agl_trainer.engines.base import WeightUpdate
from agl_trainer.engines.embedded_batching import BatchScheduler, SamplingParams, Sequence
from agl_trainer.engines.embedded_wire import RequestError

_json = msgspec.json.Encoder()
SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}


@dataclass(frozen=True)
class EmbeddedEngineConfig:
    model_path: str | Path
    served_model_name: str | tuple[str, ...] = "tiny"
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    max_model_len: int | None = None  # default: the model's max_position_embeddings, at most 4096
    max_batch_size: int = 256
    dtype: str = "float32"
    # Process-wide torch.set_num_threads. 1 by default: on a tiny model intra-op threads cost more in
    # synchronisation than they save, and on a loaded 2-core machine they were 8x slower (2.3 s vs
    # 0.28 s for a 12-token request). None leaves torch's setting alone (bigger models).
    torch_threads: int | None = 1


class EmbeddedEngine:
    """An InferenceEngine (engines/base.py) serving one transformers model from this process."""

    def __init__(self, config: EmbeddedEngineConfig) -> None:
        self.config = config
        names = config.served_model_name
        self.served_names = [names] if isinstance(names, str) else list(names)
        if not self.served_names:
            raise ValueError("EmbeddedEngineConfig.served_model_name: give at least one name")
        self.policy_version = 0
        self.model: Any = None
        self.tokenizer: Any = None
        self.max_model_len = 0
        self._scheduler: BatchScheduler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None
        self._port = 0
        self._created = int(time.time())
        self._requests = 0
        self._errors = 0
        self._tokens_out = 0

    # --- InferenceEngine ---------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        if not self._port:
            raise RuntimeError("EmbeddedEngine.urls: call start() first")
        return [f"http://{self.config.host}:{self._port}"]

    def start(self) -> None:
        if self._thread is not None:
            return
        self._load()
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start_http())
            except BaseException as error:  # noqa: BLE001 (reported to start()'s caller)
                failure.append(error)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._scheduler = BatchScheduler(
            self.model, self.tokenizer, self.max_model_len, self._on_update, self.config.max_batch_size
        )
        self._scheduler.start()
        self._thread = threading.Thread(target=serve, name="agl-embedded-http", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self.stop()
            raise RuntimeError(
                f"EmbeddedEngine: could not listen on {self.config.host}:{self.config.port}: {failure[0]}"
            )

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._scheduler is not None:
            self._scheduler.stop()
        self._thread, self._loop, self._scheduler, self._port = None, None, None, 0

    def update_weights(self, update: WeightUpdate) -> float:
        started = time.perf_counter()
        if update.state_dict is not None:
            state = update.state_dict
        elif update.directory is not None:
            state = _read_safetensors(Path(update.directory))
        else:
            raise ValueError("update_weights: the WeightUpdate has neither state_dict nor directory")
        lock = self._scheduler.weights_lock if self._scheduler is not None else threading.RLock()
        with lock:
            _load_in_place(self.model, state)
            self.policy_version = update.version
        return time.perf_counter() - started

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
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, self.config.dtype)
        ).eval()
        limit = getattr(self.model.config, "max_position_embeddings", 4096) or 4096
        self.max_model_len = self.config.max_model_len or min(limit, 4096)

    def _on_update(self, updates: list[tuple[Sequence, int, bool]]) -> None:
        """Called on the scheduler thread after each step: hand the updates to the event loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_deliver, updates)

    # --- HTTP ----------------------------------------------------------------------------------
    async def _start_http(self) -> None:
        from aiohttp import web

        app = web.Application(middlewares=[self._errors_middleware()], client_max_size=64 * 1024**2)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/health", self._empty)
        app.router.add_get("/ping", self._empty)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self._port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    @staticmethod
    def _respond(body: Any, status: int = 200) -> Any:
        from aiohttp import web

        return web.Response(body=_json.encode(body), status=status, content_type="application/json")

    def _errors_middleware(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
            try:
                return await handler(request)
            except RequestError as error:
                self._errors += 1
                return self._respond(error.body(), error.code)
            except web.HTTPMethodNotAllowed:
                return self._respond({"detail": "Method Not Allowed"}, 405)
            except web.HTTPNotFound:
                return self._respond({"detail": "Not Found"}, 404)

        return middleware

    async def _empty(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(status=200)

    async def _version(self, request: Any) -> Any:
        return self._respond({"version": wire.SYSTEM_FINGERPRINT})

    async def _models(self, request: Any) -> Any:
        return self._respond(
            wire.models_response(
                self.served_names, str(self.config.model_path), self.max_model_len, self._created
            )
        )

    async def _metrics(self, request: Any) -> Any:
        from aiohttp import web

        scheduler = self._scheduler
        lines = [
            "# TYPE agl_engine_requests_total counter",
            f"agl_engine_requests_total {self._requests}",
            "# TYPE agl_engine_request_errors_total counter",
            f"agl_engine_request_errors_total {self._errors}",
            "# TYPE agl_engine_generated_tokens_total counter",
            f"agl_engine_generated_tokens_total {self._tokens_out}",
            "# TYPE agl_engine_steps_total counter",
            f"agl_engine_steps_total {scheduler.steps if scheduler else 0}",
            "# TYPE agl_engine_busy_seconds_total counter",
            f"agl_engine_busy_seconds_total {scheduler.busy_s if scheduler else 0.0}",
            "# TYPE agl_engine_policy_version gauge",
            f"agl_engine_policy_version {self.policy_version}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _body(self, request: Any) -> bytes:
        if "json" not in request.headers.get("content-type", ""):
            raise RequestError(
                "1 validation error: Unsupported Media Type: Only 'application/json' is allowed",
                type="Bad Request",
            )
        return await request.read()

    def _check_model(self, model: str | None) -> str:
        if model is None:
            return self.served_names[0]
        if model not in self.served_names:
            raise RequestError(
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.served_names)}.",
                code=404,
                type="NotFoundError",
                param="model",
            )
        return model

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        vocab = self.model.get_input_embeddings().num_embeddings
        for token in prompt_ids:
            if not 0 <= token < vocab:
                raise RequestError(f"Token id {token} is out of vocabulary")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains {len(prompt_ids)} input tokens, which leaves no room for output tokens. Please "
                "reduce the length of the input prompt.",
                param="input_tokens",
            )
        if not prompt_ids:
            raise RequestError("The prompt is empty", param="prompt")

    def _sampling(
        self, req: wire.SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_len: int
    ) -> SamplingParams:
        if max_tokens is not None:
            if max_tokens < 1:
                raise RequestError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
            if max_tokens > self.max_model_len:
                raise RequestError(
                    f"max_tokens={max_tokens} cannot be greater than max_model_len={self.max_model_len}. "
                    f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
                    param="max_tokens",
                )
        temperature = 1.0 if req.temperature is None else req.temperature
        if temperature < 0:
            raise RequestError(f"temperature must be non-negative, got {temperature}.", param="temperature")
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0 < top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
        if req.n < 1:
            raise RequestError(f"n must be at least 1, got {req.n}.", param="n")
        if logprobs is not None and not 0 <= logprobs <= wire.MAX_LOGPROBS:
            raise RequestError(
                f"logprobs must be between 0 and {wire.MAX_LOGPROBS}, got {logprobs}.", param="logprobs"
            )
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        vocab = self.model.get_input_embeddings().num_embeddings
        bias = []
        for key, value in (req.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
                raise RequestError(
                    f"logit_bias: {key!r} is not a token id of this model (0..{vocab - 1})",
                    param="logit_bias",
                )
            bias.append((int(key), max(-100.0, min(100.0, float(value)))))
        return SamplingParams(
            max_tokens=max_tokens or (self.max_model_len - prompt_len),
            temperature=temperature,
            top_p=top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            stop=tuple(s for s in stop if s),
            stop_token_ids=frozenset(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=tuple(bias),
        )

    def _sequences(
        self, prompt_ids: list[int], params: SamplingParams, n: int, stream: bool, queue: Any
    ) -> list[Sequence]:
        sequences = []
        for choice in range(n):
            seed = params.seed if (params.seed is None or choice == 0) else _choice_seed(params.seed, choice)
            choice_params = params if seed == params.seed else _replace_seed(params, seed)
            sequences.append(Sequence(list(prompt_ids), choice_params, stream=stream, sink=queue))
        return sequences

    def _text(self, sequence: Sequence, count: int | None = None) -> str:
        """The text of the first `count` tokens as vLLM shows it: without a stop token, cut before a
        stop string, and (until the end) holding back incomplete UTF-8 and a possible stop prefix."""
        count = len(sequence.token_ids) if count is None else count
        final = sequence.finished and count >= len(sequence.token_ids)
        if final and sequence.stop_text is not None:
            return sequence.stop_text
        stopped_on_token = final and isinstance(sequence.stop_reason, int)
        ids = sequence.token_ids[: count - 1 if stopped_on_token else count]
        text = self.tokenizer.decode(ids, skip_special_tokens=sequence.params.skip_special_tokens)
        if not final or stopped_on_token:
            text = text.rstrip("\ufffd")  # incomplete UTF-8 waits for its next bytes
        if not final and sequence.params.stop:
            hold = max(len(s) for s in sequence.params.stop) - 1
            text = text[: max(0, len(text) - hold)]
        return text

    # --- chat ----------------------------------------------------------------------------------
    async def _chat(self, request: Any) -> Any:
        req = wire.decode_request(await self._body(request), wire.ChatCompletionRequest)
        model = self._check_model(req.model)
        prompt_ids = self._render(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.tools,
            req.chat_template_kwargs,
        )
        self._check_prompt(prompt_ids)
        top = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= wire.MAX_LOGPROBS:
            raise RequestError(
                f"top_logprobs must be between 0 and {wire.MAX_LOGPROBS}.", param="top_logprobs"
            )
        params = self._sampling(req, req.max_completion_tokens or req.max_tokens, top, len(prompt_ids))
        self._requests += 1
        queue: asyncio.Queue = asyncio.Queue()
        sequences = self._sequences(prompt_ids, params, req.n, req.stream, queue)
        request_id, created = f"chatcmpl-{secrets.token_hex(8)}", int(time.time())
        self._scheduler.submit(sequences)  # type: ignore[union-attr]
        if req.stream:
            with _cancel_on_exit(sequences):
                return await self._chat_stream(
                    request, req, model, request_id, created, prompt_ids, sequences, queue
                )
        with _cancel_on_exit(sequences):
            await _wait_all(sequences, queue)
        choices = []
        for index, sequence in enumerate(sequences):
            self._raise_if_failed(sequence)
            logprobs = (
                wire.chat_logprobs(
                    self.tokenizer, sequence, 0, len(sequence.token_ids), req.return_tokens_as_token_ids
                )
                if req.logprobs
                else None
            )
            choices.append(
                wire.chat_choice(index, self._text(sequence), logprobs, sequence, req.return_token_ids)
            )
        completion_tokens = sum(len(s.token_ids) for s in sequences)
        self._tokens_out += completion_tokens
        body = wire.chat_response(
            request_id, created, model, choices, prompt_ids, completion_tokens, req.return_token_ids
        )
        return self._respond(body)

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final: bool,
        tools: Any,
        kwargs: Any,
    ) -> list[int]:
        for position, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise RequestError(
                    f"messages[{position}] has no string 'role'",
                    type="Bad Request",
                    param=f"body.messages.{position}.role",
                )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final,
                continue_final_message=continue_final,
                **(kwargs or {}),
            )
        except Exception as error:  # noqa: BLE001 (a template that cannot render them: the client's problem)
            raise RequestError(
                f"The chat template could not render these messages: {error}", param="messages"
            ) from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def _chat_stream(
        self, request, req, model, request_id, created, prompt_ids, sequences, queue
    ) -> Any:
        from aiohttp import web

        response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        response.enable_chunked_encoding()
        await response.prepare(request)
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        for index in range(len(sequences)):
            await _send(
                response,
                {
                    **head,
                    "choices": [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "prompt_token_ids": prompt_ids if req.return_token_ids else None,
                    "prompt_text": None,
                },
            )
        async for index, sequence, position, delta, done in self._deltas(sequences, queue):
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"content": delta},
                "logprobs": wire.chat_logprobs(
                    self.tokenizer, sequence, position, position + 1, req.return_tokens_as_token_ids
                )
                if req.logprobs
                else None,
                "finish_reason": sequence.finish_reason if done else None,
            }
            if done:
                choice["stop_reason"] = sequence.stop_reason
            choice["token_ids"] = [sequence.token_ids[position]] if req.return_token_ids else None
            chunk = {**head, "choices": [choice]}
            if done and not include_usage:
                chunk["system_fingerprint"] = wire.SYSTEM_FINGERPRINT
            await _send(response, chunk)
        completion_tokens = sum(len(s.token_ids) for s in sequences)
        self._tokens_out += completion_tokens
        if include_usage:
            await _send(
                response,
                {
                    **head,
                    "choices": [],
                    "usage": wire.usage(len(prompt_ids), completion_tokens, details=False),
                    "system_fingerprint": wire.SYSTEM_FINGERPRINT,
                },
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # --- completions ---------------------------------------------------------------------------
    async def _completions(self, request: Any) -> Any:
        req = wire.decode_request(await self._body(request), wire.CompletionRequest)
        model = self._check_model(req.model)
        if req.echo:
            raise RequestError("echo is not supported by the embedded engine", param="echo")
        prompts = [
            p if isinstance(p, list) else self.tokenizer(p, add_special_tokens=True)["input_ids"]
            for p in wire.prompts_of(req.prompt)
        ]
        for prompt_ids in prompts:
            self._check_prompt(prompt_ids)
        self._requests += 1
        queue: asyncio.Queue = asyncio.Queue()
        sequences: list[Sequence] = []
        for prompt_ids in prompts:
            params = self._sampling(req, req.max_tokens or 16, req.logprobs, len(prompt_ids))
            sequences += self._sequences(prompt_ids, params, req.n, req.stream, queue)
        request_id, created = f"cmpl-{secrets.token_hex(8)}", int(time.time())
        self._scheduler.submit(sequences)  # type: ignore[union-attr]
        if req.stream:
            with _cancel_on_exit(sequences):
                return await self._completions_stream(
                    request, req, model, request_id, created, sequences, queue
                )
        with _cancel_on_exit(sequences):
            await _wait_all(sequences, queue)
        choices = []
        for index, sequence in enumerate(sequences):
            self._raise_if_failed(sequence)
            logprobs = None
            if req.logprobs is not None:
                logprobs, _ = wire.completion_logprobs(
                    self.tokenizer, sequence, 0, len(sequence.token_ids), 0, req.return_tokens_as_token_ids
                )
            choices.append(
                wire.completion_choice(index, self._text(sequence), logprobs, sequence, req.return_token_ids)
            )
        completion_tokens = sum(len(s.token_ids) for s in sequences)
        self._tokens_out += completion_tokens
        prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, whatever n is (as vLLM)
        return self._respond(
            wire.completion_response(request_id, created, model, choices, prompt_tokens, completion_tokens)
        )

    async def _completions_stream(self, request, req, model, request_id, created, sequences, queue) -> Any:
        from aiohttp import web

        response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        response.enable_chunked_encoding()
        await response.prepare(request)
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offsets = [0] * len(sequences)
        async for index, sequence, position, delta, done in self._deltas(sequences, queue):
            logprobs = None
            if req.logprobs is not None:
                logprobs, offsets[index] = wire.completion_logprobs(
                    self.tokenizer,
                    sequence,
                    position,
                    position + 1,
                    offsets[index],
                    req.return_tokens_as_token_ids,
                )
            choice = {
                "index": index,
                "text": delta,
                "logprobs": logprobs,
                "finish_reason": sequence.finish_reason if done else None,
                "stop_reason": sequence.stop_reason if done else None,
                "prompt_token_ids": sequence.prompt_ids
                if (req.return_token_ids and position == 0)
                else None,
                "token_ids": [sequence.token_ids[position]] if req.return_token_ids else None,
            }
            chunk = {**head, "choices": [choice]}
            if done and not include_usage:
                chunk["system_fingerprint"] = wire.SYSTEM_FINGERPRINT
            await _send(response, chunk)
        completion_tokens = sum(len(s.token_ids) for s in sequences)
        self._tokens_out += completion_tokens
        if include_usage:
            prompt_tokens = sum(len(s.prompt_ids) for s in sequences[:: req.n])  # once per prompt
            await _send(
                response,
                {
                    **head,
                    "choices": [],
                    "usage": wire.usage(prompt_tokens, completion_tokens, details=False),
                    "system_fingerprint": wire.SYSTEM_FINGERPRINT,
                },
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _deltas(
        self, sequences: list[Sequence], queue: asyncio.Queue[Any]
    ) -> AsyncIterator[tuple[int, Sequence, int, str, bool]]:
        """Each new token of a stream as (choice index, sequence, position, text delta, last?), in
        the order the scheduler produced them; stops early when a sequence failed."""
        index_of = {id(s): i for i, s in enumerate(sequences)}
        sent = [0] * len(sequences)
        shown = [""] * len(sequences)
        while any(sent[i] < len(s.token_ids) or not s.finished for i, s in enumerate(sequences)):
            sequence, count, _ = await queue.get()
            index = index_of[id(sequence)]
            if sequence.finish_reason == "error":
                return
            for position in range(sent[index], count):
                done = sequence.finished and position + 1 == len(sequence.token_ids)
                text = self._text(sequence, position + 1)
                # Detokenizing a prefix can shorten the text (a byte-level token completes later):
                # what was shown stays shown.
                delta, shown[index] = (
                    text[len(shown[index]) :],
                    text if len(text) >= len(shown[index]) else shown[index],
                )
                yield index, sequence, position, delta, done
            sent[index] = max(sent[index], count)

    def _raise_if_failed(self, sequence: Sequence) -> None:
        if sequence.finish_reason == "error":
            raise RequestError(
                f"generation failed: {sequence.stop_reason}", code=500, type="InternalServerError"
            )

    # --- tokenizer endpoints -------------------------------------------------------------------
    async def _tokenize(self, request: Any) -> Any:
        req = wire.decode_request(await self._body(request), wire.TokenizeRequest)
        self._check_model(req.model)
        if req.messages is not None:
            tokens = self._render(req.messages, req.add_generation_prompt, False, req.tools, None)
        elif req.prompt is not None:
            tokens = self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        else:
            raise RequestError("give either 'prompt' or 'messages'", param="prompt")
        return self._respond(
            {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens, "token_strs": None}
        )

    async def _detokenize(self, request: Any) -> Any:
        req = wire.decode_request(await self._body(request), wire.DetokenizeRequest)
        self._check_model(req.model)
        vocab = self.model.get_input_embeddings().num_embeddings
        if any(not 0 <= token < vocab for token in req.tokens):
            raise RequestError("a token id is out of vocabulary", param="tokens")
        return self._respond({"prompt": self.tokenizer.decode(req.tokens)})


# --- helpers ------------------------------------------------------------------------------------
class _cancel_on_exit:
    """Cancel the sequences still generating when the handler ends early (the client went away)."""

    def __init__(self, sequences: list[Sequence]) -> None:
        self.sequences = sequences

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        for sequence in self.sequences:
            if not sequence.finished:
                sequence.cancelled = True


def _deliver(updates: list[tuple[Sequence, int, bool]]) -> None:
    for update in updates:
        update[0].sink.put_nowait(update)


async def _wait_all(sequences: list[Sequence], queue: asyncio.Queue) -> None:
    while not all(s.finished for s in sequences):
        await queue.get()


async def _send(response: Any, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + _json.encode(chunk) + b"\n\n")


def _choice_seed(seed: int, choice: int) -> int:
    """Choice 0 uses the request's seed (so n=1 and n=2 share it); the others a derived one."""
    return (seed * 1_000_003 + choice * 7_919) % (2**63)


def _replace_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def _read_safetensors(directory: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"update_weights: no *.safetensors files in {directory}")
    state: dict[str, Any] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def _load_in_place(model: Any, state: Any) -> None:
    """Copy `state` into the model's parameters: every parameter must be given once (a tied weight
    under either of its names), with its shape, and no unknown name is accepted. Everything is
    checked before anything is copied, so a refused update leaves the old weights whole."""
    import torch

    params = dict(model.named_parameters())  # tied weights appear once here
    tied_aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    unknown = [name for name in state if name not in params and name not in tied_aliases]
    if unknown:
        raise KeyError(
            f"update_weights: names the model does not have: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )
    alias_of = _tied_aliases(model)
    missing = [
        name for name in params if name not in state and not any(a in state for a in alias_of.get(name, ()))
    ]
    if missing:
        raise KeyError(
            f"update_weights: the state_dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    target = {**params, **{alias: params[name] for name, aliases in alias_of.items() for alias in aliases}}
    for name, source in state.items():
        if tuple(source.shape) != tuple(target[name].shape):
            raise ValueError(
                f"update_weights: {name} has shape {tuple(source.shape)}, the model {tuple(target[name].shape)}"
            )
    pairs = [
        (param, state[name] if name in state else next(state[a] for a in alias_of[name] if a in state))
        for name, param in params.items()
    ]
    with torch.no_grad():
        for param, source in pairs:
            param.copy_(source.to(dtype=param.dtype))


def _tied_aliases(model: Any) -> dict[str, list[str]]:
    by_tensor: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first = by_tensor.setdefault(id(param), name)
        if first != name:
            aliases.setdefault(first, []).append(name)
    return aliases


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
