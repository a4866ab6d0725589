"""A scripted engine with a real tokenizer and chat template, in vLLM 0.32's chat wire format.

For tests where the exact tokens matter across calls (a harness's consecutive calls must extend each
other token for token; reasoning must render back as it was written): each request's prompt is the
tokenizer's chat template applied to its messages and tools, as vLLM renders it, and each answer is
scripted as an assistant message (reasoning, content, tool calls), rendered by the same template, so
its token IDs are the ones the template would give that message in the next prompt, EOS included.
The answer goes back as vLLM's parsers would give it: `reasoning`, `content`, `tool_calls`
(`chatcmpl-tool-<hex>` ids), `finish_reason` `tool_calls` or `stop`; with `return_token_ids` and
`logprobs`, streamed (one token per chunk, `prompt_token_ids` in the first) or not.

    engine = TemplateEngine(tokenizer, lambda request, n: Answer(content="hi"))
    with engine:
        engine.base_url                  # "http://127.0.0.1:PORT"; the API is under /v1
        engine.calls                     # each Call: request, prompt_ids, completion_ids, answer

Logprobs are the `scorer`'s when one is given (an engine's /v1/completions with `prompt_logprobs`,
e.g. the embedded engine serving a model of this tokenizer), else -1.0 per token.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from agl_trainer.background_loop import BackgroundLoop

SYSTEM_FINGERPRINT = "vllm-0.32.0-87018c84"

# Qwen3-style ChatML: tools listed in a system block, reasoning in <think>, tool calls as <tool_call>
# JSON; an assistant turn renders the same in history as when generated. Newlines are written as
# {{ NL }} expressions: transformers renders templates with trim_blocks, which eats a newline after a tag.
_NL = "{{ '\\n' }}"
REASONING_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system" + _NL + "# Tools" + _NL + "<tools>"
    "{% for tool in tools %}" + _NL + "{{ tool | tojson }}{% endfor %}" + _NL + "</tools><|im_end|>" + _NL + "{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}" + _NL +
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "<think>" + _NL + "{{ message['reasoning_content'] }}" + _NL + "</think>" + _NL + _NL + "{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}" + _NL + "<tool_call>" + _NL +
    '{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": {{ call[\'function\'][\'arguments\'] }}}'
    + _NL + "</tool_call>{% endfor %}<|im_end|>" + _NL + "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant" + _NL + "{% endif %}"
)


@dataclass(frozen=True)
class Answer:
    content: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[tuple[str, str], ...] = ()  # (name, arguments JSON)


@dataclass
class Call:
    request: dict[str, Any]
    prompt_ids: list[int]
    completion_ids: list[int]
    answer: Answer
    message: dict[str, Any] = field(default_factory=dict)  # the answer as the response's message


Script = Callable[[dict[str, Any], int], Answer]


class TemplateEngine:
    def __init__(self, tokenizer: Any, script: Script, model: str = "tiny", scorer: str | None = None) -> None:
        self.tokenizer, self.script, self.model, self.scorer = tokenizer, script, model, scorer
        self.calls: list[Call] = []
        self.port = 0
        self._serving = BackgroundLoop("template-engine")
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> TemplateEngine:
        self._serving.start(self._start, self._cleanup, timeout_s=30)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._serving.stop(timeout_s=30)

    async def _start(self) -> None:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._session = aiohttp.ClientSession()

    async def _cleanup(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "vllm"}]})

    # --- rendering -------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _answer_message(self, answer: Answer) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if answer.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = answer.reasoning
        if answer.tool_calls:
            message["tool_calls"] = [
                {"id": f"chatcmpl-tool-{secrets.token_hex(8)}", "type": "function",
                 "function": {"name": name, "arguments": arguments}}
                for name, arguments in answer.tool_calls
            ]  # fmt: skip
        return message

    def _completion_text(self, messages: list[dict[str, Any]], tools: Any, prefix: str, message: dict[str, Any]) -> str:
        full = self.render([*messages, message], tools, generation=False)
        if not full.startswith(prefix):
            raise AssertionError("the template renders history and generation differently: no exact answer possible")
        text = full[len(prefix) :]
        return text[:-1] if text.endswith("\n") else text  # the separator after EOS is the next prompt's

    async def _logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        if self.scorer is None:
            return [-1.0] * len(completion)
        assert self._session is not None
        body = {"model": self.model, "prompt": prompt + completion, "max_tokens": 1, "prompt_logprobs": 0}
        async with self._session.post(self.scorer + "/v1/completions", json=body) as response:
            scored = (await response.json())["choices"][0]["prompt_logprobs"]
        return [scored[len(prompt) + j][str(token)]["logprob"] for j, token in enumerate(completion)]

    # --- the endpoint ----------------------------------------------------------------------------
    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        messages, tools = body["messages"], body.get("tools")
        prefix = self.render(messages, tools, generation=True)
        prompt = self.encode(prefix)
        answer = self.script(body, len(self.calls))
        message = self._answer_message(answer)
        completion = self.encode(self._completion_text(messages, tools, prefix, message))
        self.calls.append(Call(body, prompt, completion, answer, message))
        logprobs = await self._logprobs(prompt, completion)
        finish = "tool_calls" if answer.tool_calls else "stop"
        with_ids, with_logprobs = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
        head = {"id": "chatcmpl-" + secrets.token_hex(8), "created": int(time.time()), "model": self.model}
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(completion),
                 "completion_tokens": len(completion)}  # fmt: skip
        if not body.get("stream"):
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": answer.content if answer.content else None,
                            "refusal": None, "annotations": None, "audio": None, "function_call": None,
                            "tool_calls": message.get("tool_calls", []), "reasoning": answer.reasoning},
                "logprobs": {"content": [self._logprob(t, lp) for t, lp in zip(completion, logprobs)]} if with_logprobs else None,
                "finish_reason": finish, "stop_reason": None,
                "token_ids": completion if with_ids else None,
            }  # fmt: skip
            return web.json_response({**head, "object": "chat.completion", "choices": [choice], "usage": usage,
                                      "system_fingerprint": SYSTEM_FINGERPRINT, "prompt_logprobs": None,
                                      "prompt_token_ids": prompt if with_ids else None})  # fmt: skip
        return await self._stream(request, body, head, prompt, completion, logprobs, message, finish, usage)

    def _logprob(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}

    async def _stream(self, request: web.Request, body: dict[str, Any], head: dict[str, Any], prompt: list[int],
                      completion: list[int], logprobs: list[float], message: dict[str, Any], finish: str,
                      usage: dict[str, Any]) -> web.StreamResponse:  # fmt: skip
        head = {**head, "object": "chat.completion.chunk"}
        with_ids, with_logprobs = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
        deltas: list[dict[str, Any]] = []
        if message.get("reasoning"):
            deltas.append({"reasoning": message["reasoning"]})
        if message.get("content"):
            deltas.append({"content": message["content"]})
        for index, call in enumerate(message.get("tool_calls") or ()):
            arguments = call["function"]["arguments"]
            deltas.append({"tool_calls": [{"id": call["id"], "type": "function", "index": index,
                                           "function": {"name": call["function"]["name"], "arguments": ""}}]})  # fmt: skip
            half = len(arguments) // 2
            for piece in (arguments[:half], arguments[half:]):
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        if len(deltas) > len(completion):
            raise AssertionError(f"an answer of {len(completion)} tokens cannot carry {len(deltas)} deltas")
        chunks = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None}], "prompt_token_ids": prompt if with_ids else None}]  # fmt: skip
        for j, token in enumerate(completion):
            last = j == len(completion) - 1
            choice: dict[str, Any] = {"index": 0, "delta": deltas[j] if j < len(deltas) else {"content": ""}}
            choice["logprobs"] = {"content": [self._logprob(token, logprobs[j])]} if with_logprobs else None
            choice["finish_reason"] = finish if last else None
            if last:
                choice["stop_reason"] = None
            choice["token_ids"] = [token] if with_ids else None
            chunks.append({**head, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "choices": [], "usage": usage, "system_fingerprint": SYSTEM_FINGERPRINT})
        response = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        await asyncio.sleep(0)
        return response
