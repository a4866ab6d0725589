"""The embedded engine's HTTP routes (aiohttp), vLLM's API over one `EmbeddedEngine`:
POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize;
GET /v1/models, /health, /ping, /version, /metrics (Prometheus text).

A handler reads its request (requests.py), submits sequences to the engine's scheduler,
and answers with a body (wire.py) or a stream (stream.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from agl_trainer.engines.embedded import stream
from agl_trainer.engines.embedded import wire
from agl_trainer.engines.embedded.batching import BatchScheduler, Sequence
from agl_trainer.engines.embedded.prompt_logprobs import prompt_logprobs
from agl_trainer.engines.embedded.requests import RequestReader
from agl_trainer.engines.embedded.requests import sequences as sequences_of
from agl_trainer.engines.embedded.wire import RequestError

if TYPE_CHECKING:
    from aiohttp import web

_json = msgspec.json.Encoder()


def respond(body: Any, status: int = 200) -> web.Response:
    from aiohttp import web

    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


class _ModelConfig(Protocol):
    @property
    def model_path(self) -> str | Path: ...


class ServedEngine(Protocol):
    """What the routes read of the engine they serve (embedded.EmbeddedEngine), named here so the
    routes need not import the engine that mounts them."""

    served_names: list[str]
    policy_version: int
    model: Any
    max_model_len: int
    created: int

    @property
    def config(self) -> _ModelConfig: ...

    @property
    def scheduler(self) -> BatchScheduler | None: ...


class EngineRoutes:
    """The handlers, and the request counters /metrics reports."""

    def __init__(self, engine: ServedEngine, reader: RequestReader) -> None:
        self.engine = engine
        self.reader = reader
        self.requests = 0
        self.errors = 0
        self.tokens_out = 0

    def app(self) -> web.Application:
        from aiohttp import web

        app = web.Application(middlewares=[self._errors_middleware()], client_max_size=64 * 1024**2)
        wire.add_routes(app, self)
        app.router.add_get("/metrics", self.metrics)
        return app

    def _errors_middleware(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
            try:
                return await handler(request)
            except RequestError as error:
                self.errors += 1
                return respond(error.body(), error.code)
            except web.HTTPMethodNotAllowed:
                return respond({"detail": "Method Not Allowed"}, 405)
            except web.HTTPNotFound:
                return respond({"detail": "Not Found"}, 404)

        return middleware

    def _count_tokens(self, completion_tokens: int) -> None:
        self.tokens_out += completion_tokens

    # --- small routes ----------------------------------------------------------------------------
    async def empty(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(status=200)

    async def version(self, request: Any) -> Any:
        return respond({"version": wire.SYSTEM_FINGERPRINT})

    async def models(self, request: Any) -> Any:
        engine = self.engine
        return respond(
            wire.models_response(
                engine.served_names, str(engine.config.model_path), engine.max_model_len, engine.created
            )
        )

    async def metrics(self, request: Any) -> Any:
        from aiohttp import web

        scheduler = self.engine.scheduler
        lines = [
            "# TYPE agl_engine_requests_total counter",
            f"agl_engine_requests_total {self.requests}",
            "# TYPE agl_engine_request_errors_total counter",
            f"agl_engine_request_errors_total {self.errors}",
            "# TYPE agl_engine_generated_tokens_total counter",
            f"agl_engine_generated_tokens_total {self.tokens_out}",
            "# TYPE agl_engine_steps_total counter",
            f"agl_engine_steps_total {scheduler.steps if scheduler else 0}",
            "# TYPE agl_engine_busy_seconds_total counter",
            f"agl_engine_busy_seconds_total {scheduler.busy_s if scheduler else 0.0}",
            "# TYPE agl_engine_policy_version gauge",
            f"agl_engine_policy_version {self.engine.policy_version}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _body(self, request: Any) -> bytes:
        if "json" not in request.headers.get("content-type", ""):
            raise RequestError(
                "1 validation error: Unsupported Media Type: Only 'application/json' is allowed",
                type="Bad Request",
            )
        return await request.read()

    def _submit(self, sequences: list[Sequence], id_prefix: str) -> tuple[str, int]:
        """Hand the sequences to the scheduler under a new response id; returns (that id, created)."""
        request_id, created = f"{id_prefix}-{secrets.token_hex(8)}", int(time.time())
        self.requests += 1
        for index, sequence in enumerate(sequences):  # choice 0 under the response's own id
            sequence.request_id = request_id if index == 0 else f"{request_id}-{index}"
        scheduler = self.engine.scheduler
        assert scheduler is not None  # routes are served only between start() and stop()
        scheduler.submit(sequences)
        return request_id, created

    async def _generated(self, sequences: list[Sequence], queue: asyncio.Queue[Any]) -> int:
        """Wait for every sequence to end (cancelled when the client goes away first); a failed one
        fails the request. The tokens generated, counted for /metrics."""
        with stream.cancel_on_exit(sequences):
            await stream.wait_all(sequences, queue)
        for sequence in sequences:
            stream.raise_if_failed(sequence)
        completion_tokens = sum(len(s.token_ids) for s in sequences)
        self._count_tokens(completion_tokens)
        return completion_tokens

    async def _stream(
        self,
        request: Any,
        req: wire.ChatCompletionRequest | wire.CompletionRequest,
        head: dict[str, Any],
        sequences: list[Sequence],
        queue: asyncio.Queue[Any],
        choice_of: stream.ChoiceBuilder,
        prompt_tokens: int,
        preludes: Iterable[dict[str, Any]] = (),
    ) -> Any:
        """Either endpoint's stream (its chunks are `choice_of`'s), the sequences cancelled when the
        client goes away first; a usage chunk when the request asks for one."""
        with stream.cancel_on_exit(sequences):
            return await stream.stream_choices(
                request,
                head,
                self.reader.tokenizer,
                sequences,
                queue,
                choice_of,
                prompt_tokens=prompt_tokens,
                include_usage=bool(req.stream_options and req.stream_options.include_usage),
                count_tokens=self._count_tokens,
                preludes=preludes,
            )

    # --- chat ------------------------------------------------------------------------------------
    async def chat(self, request: Any) -> Any:
        reader = self.reader
        req = wire.decode_request(await self._body(request), wire.ChatCompletionRequest)
        model = reader.model_name(req.model)
        prompt_ids = reader.render(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.tools,
            req.chat_template_kwargs,
        )
        reader.check_prompt(prompt_ids)
        top = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= wire.MAX_LOGPROBS:
            raise RequestError(
                f"top_logprobs must be between 0 and {wire.MAX_LOGPROBS}.", param="top_logprobs"
            )
        params = reader.sampling(req, req.max_completion_tokens or req.max_tokens, top, len(prompt_ids))
        queue: asyncio.Queue = asyncio.Queue()
        sequences = sequences_of(prompt_ids, params, req.n, req.stream, queue)
        request_id, created = self._submit(sequences, "chatcmpl")
        if req.stream:
            return await self._chat_stream(
                request, req, model, request_id, created, prompt_ids, sequences, queue
            )
        completion_tokens = await self._generated(sequences, queue)
        choices = [self._chat_choice(req, index, sequence) for index, sequence in enumerate(sequences)]
        body = wire.chat_response(
            request_id, created, model, choices, prompt_ids, completion_tokens, req.return_token_ids
        )
        return respond(body)

    def _chat_choice(self, req: wire.ChatCompletionRequest, index: int, sequence: Sequence) -> dict[str, Any]:
        tokenizer = self.reader.tokenizer
        logprobs = None
        if req.logprobs:
            end = len(sequence.token_ids)
            logprobs = wire.chat_logprobs(tokenizer, sequence, 0, end, req.return_tokens_as_token_ids)
        text = stream.visible_text(tokenizer, sequence)
        return wire.chat_choice(index, text, logprobs, sequence, req.return_token_ids)

    async def _chat_stream(
        self,
        request: Any,
        req: wire.ChatCompletionRequest,
        model: str,
        request_id: str,
        created: int,
        prompt_ids: list[int],
        sequences: list[Sequence],
        queue: asyncio.Queue[Any],
    ) -> Any:
        tokenizer = self.reader.tokenizer

        def choice_of(
            index: int, sequence: Sequence, position: int, delta: str, done: bool
        ) -> dict[str, Any]:
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"content": delta},
                "logprobs": wire.chat_logprobs(
                    tokenizer, sequence, position, position + 1, req.return_tokens_as_token_ids
                )
                if req.logprobs
                else None,
                "finish_reason": sequence.finish_reason if done else None,
            }
            if done:
                choice["stop_reason"] = sequence.stop_reason
            choice["token_ids"] = [sequence.token_ids[position]] if req.return_token_ids else None
            return choice

        # Each choice opens with the assistant role (and the prompt's ids), as vLLM's do.
        preludes = [
            {
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
            }
            for index in range(len(sequences))
        ]
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        return await self._stream(request, req, head, sequences, queue, choice_of, len(prompt_ids), preludes)

    # --- completions -------------------------------------------------------------------------------
    async def completions(self, request: Any) -> Any:
        reader = self.reader
        req = wire.decode_request(await self._body(request), wire.CompletionRequest)
        model = reader.model_name(req.model)
        if req.echo:
            raise RequestError("echo is not supported by the embedded engine", param="echo")
        prompts = [reader.encode_prompt(p) for p in wire.prompts_of(req.prompt)]
        for prompt_ids in prompts:
            reader.check_prompt(prompt_ids)
        scored = await self._prompt_logprobs(req, prompts)
        queue: asyncio.Queue = asyncio.Queue()
        sequences: list[Sequence] = []
        for prompt_ids in prompts:
            params = reader.sampling(req, req.max_tokens or 16, req.logprobs, len(prompt_ids))
            sequences += sequences_of(prompt_ids, params, req.n, req.stream, queue)
        request_id, created = self._submit(sequences, "cmpl")
        prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, whatever n is (as vLLM)
        if req.stream:
            return await self._completions_stream(
                request, req, model, request_id, created, sequences, queue, prompt_tokens
            )
        completion_tokens = await self._generated(sequences, queue)
        choices = [self._completion_choice(req, index, sequence) for index, sequence in enumerate(sequences)]
        if scored is not None:
            for index, choice in enumerate(choices):
                choice["prompt_logprobs"] = scored[index // req.n]  # n choices per prompt, in order
        return respond(
            wire.completion_response(request_id, created, model, choices, prompt_tokens, completion_tokens)
        )

    def _completion_choice(
        self, req: wire.CompletionRequest, index: int, sequence: Sequence
    ) -> dict[str, Any]:
        tokenizer = self.reader.tokenizer
        logprobs = None
        if req.logprobs is not None:
            end, as_ids = len(sequence.token_ids), req.return_tokens_as_token_ids
            logprobs, _ = wire.completion_logprobs(tokenizer, sequence, 0, end, 0, as_ids)
        text = stream.visible_text(tokenizer, sequence)
        return wire.completion_choice(index, text, logprobs, sequence, req.return_token_ids)

    async def _prompt_logprobs(self, req: wire.CompletionRequest, prompts: list[list[int]]) -> list[Any] | None:
        """Each prompt's logprobs when asked (`prompt_logprobs`: how many top tokens besides the prompt's)."""
        k = req.prompt_logprobs
        if k is None:
            return None
        if not 0 <= k <= wire.MAX_LOGPROBS:
            raise RequestError(
                f"prompt_logprobs must be between 0 and {wire.MAX_LOGPROBS}, got {k}.", param="prompt_logprobs"
            )
        if req.stream:
            raise RequestError(
                "prompt_logprobs with stream is not supported by the embedded engine; ask without stream",
                param="prompt_logprobs",
            )
        engine, reader = self.engine, self.reader
        lock = engine.scheduler.weights_lock if engine.scheduler is not None else contextlib.nullcontext()
        return await asyncio.to_thread(
            prompt_logprobs, engine.model, reader.tokenizer, lock, prompts, k, req.return_tokens_as_token_ids
        )

    async def _completions_stream(
        self,
        request: Any,
        req: wire.CompletionRequest,
        model: str,
        request_id: str,
        created: int,
        sequences: list[Sequence],
        queue: asyncio.Queue[Any],
        prompt_tokens: int,
    ) -> Any:
        tokenizer = self.reader.tokenizer
        offsets = [0] * len(sequences)  # each choice's text offset, for the legacy logprobs form

        def choice_of(
            index: int, sequence: Sequence, position: int, delta: str, done: bool
        ) -> dict[str, Any]:
            logprobs = None
            if req.logprobs is not None:
                logprobs, offsets[index] = wire.completion_logprobs(
                    tokenizer,
                    sequence,
                    position,
                    position + 1,
                    offsets[index],
                    req.return_tokens_as_token_ids,
                )
            return {
                "index": index,
                "text": delta,
                "logprobs": logprobs,
                "finish_reason": sequence.finish_reason if done else None,
                "stop_reason": sequence.stop_reason if done else None,
                "prompt_token_ids": sequence.prompt_ids if (req.return_token_ids and position == 0) else None,
                "token_ids": [sequence.token_ids[position]] if req.return_token_ids else None,
            }

        head = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        return await self._stream(request, req, head, sequences, queue, choice_of, prompt_tokens)

    # --- tokenizer endpoints -----------------------------------------------------------------------
    async def tokenize(self, request: Any) -> Any:
        reader = self.reader
        req = wire.decode_request(await self._body(request), wire.TokenizeRequest)
        reader.model_name(req.model)
        if req.messages is not None:
            tokens = reader.render(req.messages, req.add_generation_prompt, False, req.tools, None)
        elif req.prompt is not None:
            tokens = reader.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        else:
            raise RequestError("give either 'prompt' or 'messages'", param="prompt")
        body = {"count": len(tokens), "max_model_len": reader.max_model_len, "tokens": tokens}
        return respond({**body, "token_strs": None})

    async def detokenize(self, request: Any) -> Any:
        reader = self.reader
        req = wire.decode_request(await self._body(request), wire.DetokenizeRequest)
        reader.model_name(req.model)
        reader.check_tokens(req.tokens)
        return respond({"prompt": reader.tokenizer.decode(req.tokens)})
