"""What the real-harness tests share (Claude Code here; Codex's tests can take the same pieces):

- `ScriptedEngine`: an engine in vLLM's wire format (chat completions streamed or not, /tokenize,
  /v1/models) over a real tokenizer and chat template, whose answers a test scripts as `Turn`s
  (reasoning, text, tool calls). An answer's token IDs are the template's own rendering of that
  turn, so the next call's prompt extends this call's prompt + completion exactly when the harness
  and the sidecar carry the turn back faithfully: a merge failure is a real one. It renders messages
  as vLLM 0.32 does before its template (text parts joined by newlines, tool-call arguments parsed
  into objects, `reasoning` read as the template's `reasoning_content`) and answers as vLLM's parsers
  do (reasoning apart, `tool_calls` with `chatcmpl-tool-` ids, `content: null` beside them; streams
  one chunk per token, tool-call deltas in the hermes parser's shape). Its logprobs come from
  `scorer` (the policy's, for a training step) or are a fixed -1.0.
- `agent_tokenizer(corpus)`: a byte-level BPE trained in-process on the texts a harness sends, its
  merges spanning words (tiny.build_bpe_tokenizer `whole_lines`), so Claude Code's 48k-character
  prompt is about 1,200 tokens a tiny model trains on in seconds; tiny.AGENT_CHAT_TEMPLATE.
- `harness_env(home)`: the environment a headless CLI run gets: a scratch HOME and TMPDIR, no
  telemetry, no update checks, no non-essential traffic (as the Claude Code docs advise for headless runs).
"""

from __future__ import annotations

import json
import lzma
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from agl_trainer.background_loop import BackgroundLoop

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "claude-code-2.1.328"


@dataclass
class Turn:
    """One scripted answer: what a reasoning model with a tool parser would return."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (name, arguments)


@dataclass
class Served:
    """One generation the engine answered: the request and the exact token IDs of both sides."""

    request: dict[str, Any]
    prompt_ids: list[int]
    completion_ids: list[int]
    turn: Turn


Script = Callable[[list[dict[str, Any]], dict[str, Any]], Turn]
Scorer = Callable[[list[int], list[int]], list[float]]


def captured(scenario: str) -> list[dict[str, Any]]:
    """The requests Claude Code 2.1.328 sent in a captured scenario (tests/fixtures/claude-code-2.1.328)."""
    with lzma.open(CAPTURES / f"{scenario}.jsonl.xz") as f:
        return [json.loads(line) for line in f]


def agent_tokenizer(corpus: list[str], vocab_size: int = 16384) -> Any:
    from agl_trainer.models.tiny import AGENT_CHAT_TEMPLATE, build_bpe_tokenizer

    return build_bpe_tokenizer(list(dict.fromkeys(corpus)), vocab_size, AGENT_CHAT_TEMPLATE, whole_lines=True)


def harness_env(home: Path, **extra: str) -> dict[str, str]:
    for sub in ("home", "tmp"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home / "home"),
        "TMPDIR": str(home / "tmp"),
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        **extra,
    }


def vllm_conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to a string-content chat template."""
    out = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = "\n".join(p.get("text", "") for p in content if p.get("type") == "text")
        if message.get("role") == "assistant":
            if message.get("reasoning") is not None:
                message["reasoning_content"] = message["reasoning"]
            calls = []
            for call in message.get("tool_calls") or ():
                arguments = call["function"].get("arguments")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except ValueError:
                        arguments = {}
                calls.append({**call, "function": {**call["function"], "arguments": arguments}})
            if calls:
                message["tool_calls"] = calls
        out.append(message)
    return out


class ScriptedEngine:
    def __init__(self, tokenizer: Any, script: Script, model: str = "tiny", scorer: Scorer | None = None) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.model = model
        self.scorer = scorer
        self.served: list[Served] = []
        self.tokenized: list[dict[str, Any]] = []  # /tokenize requests
        self.port = 0
        self._loop = BackgroundLoop("scripted-engine")
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ScriptedEngine:
        self._loop.start(self._start, self._stop, timeout_s=10)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.stop(timeout_s=10)

    async def _start(self) -> None:
        app = web.Application(client_max_size=256 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", lambda request: web.Response())
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # --- rendering -----------------------------------------------------------------------------
    def render(self, body: dict[str, Any], extra: list[dict[str, Any]] = ()) -> str:  # type: ignore[assignment]
        conversation = vllm_conversation(body["messages"]) + list(extra)
        continue_final = bool(body.get("continue_final_message")) and not extra
        return self.tokenizer.apply_chat_template(
            conversation,
            tools=body.get("tools") or None,
            tokenize=False,
            add_generation_prompt=body.get("add_generation_prompt", True) and not continue_final and not extra,
            continue_final_message=continue_final,
            **(body.get("chat_template_kwargs") or {}),
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def answer(self, body: dict[str, Any]) -> Served:
        """The scripted turn for `body`, with the prompt's and the turn's exact token IDs."""
        prompt_text = self.render(body)
        prompt_ids = self.encode(prompt_text)
        turn = self.script(body["messages"], body)
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if turn.reasoning is not None:
            message["reasoning_content"] = turn.reasoning
        if turn.tool_calls:
            message["tool_calls"] = [
                {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
                for i, (name, arguments) in enumerate(turn.tool_calls)
            ]
        full = self.render({**body, "add_generation_prompt": False}, [message])
        # the turn's text: the template's rendering of it, up to its end-of-turn token (EOS)
        assert full.startswith(prompt_text), "the template renders the prompt differently with the answer after it"
        completion_text = full[len(prompt_text) :]
        completion_text = completion_text[: completion_text.rindex("<|im_end|>") + len("<|im_end|>")]
        ids = self.encode(prompt_text + completion_text)
        assert ids[: len(prompt_ids)] == prompt_ids, "the template's rendering splits differently"
        served = Served(body, prompt_ids, ids[len(prompt_ids) :], turn)
        self.served.append(served)
        return served

    # --- endpoints -----------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": self.model, "object": "model", "owned_by": "vllm", "max_model_len": 131072}]
        return web.json_response({"object": "list", "data": data})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized.append(body)
        tokens = self.encode(self.render(body))
        return web.json_response({"count": len(tokens), "max_model_len": 131072, "tokens": tokens, "token_strs": None})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("model") != self.model:
            error = {"message": f"The model `{body.get('model')}` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}
            return web.json_response({"error": error}, status=404)
        served = self.answer(body)
        logprobs = self.scorer(served.prompt_ids, served.completion_ids) if self.scorer else [-1.0] * len(served.completion_ids)
        calls = [
            {"id": "chatcmpl-tool-" + secrets.token_hex(8), "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for name, arguments in served.turn.tool_calls
        ]  # fmt: skip
        finish = "tool_calls" if calls else "stop"
        head = {"id": "chatcmpl-" + secrets.token_hex(8), "created": int(time.time()), "model": self.model}
        if body.get("stream"):
            return await self._stream(request, body, head, served, calls, logprobs, finish)
        turn = served.turn
        message = {"role": "assistant", "content": turn.content if (turn.content or not calls) else None,
                   "refusal": None, "annotations": None, "audio": None, "function_call": None,
                   "tool_calls": calls, "reasoning": turn.reasoning}  # fmt: skip
        choice = {"index": 0, "message": message, "finish_reason": finish, "stop_reason": None,
                  "token_ids": served.completion_ids if body.get("return_token_ids") else None,
                  "logprobs": self._logprobs(served.completion_ids, logprobs) if body.get("logprobs") else None}  # fmt: skip
        usage = {"prompt_tokens": len(served.prompt_ids), "completion_tokens": len(served.completion_ids),
                 "total_tokens": len(served.prompt_ids) + len(served.completion_ids)}  # fmt: skip
        return web.json_response({
            **head, "object": "chat.completion", "choices": [choice], "usage": usage,
            "prompt_token_ids": served.prompt_ids if body.get("return_token_ids") else None,
        })  # fmt: skip

    def _logprobs(self, ids: list[int], values: list[float]) -> dict[str, Any]:
        return {"content": [self._logprob(token, value) for token, value in zip(ids, values, strict=True)]}

    def _logprob(self, token: int, value: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []}

    async def _stream(self, request: web.Request, body: dict[str, Any], head: dict[str, Any], served: Served,
                      calls: list[dict[str, Any]], logprobs: list[float], finish: str) -> web.StreamResponse:  # fmt: skip
        with_ids, with_logprobs = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
        head = {**head, "object": "chat.completion.chunk"}
        response = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)

        async def send(delta: dict[str, Any], **choice: Any) -> None:
            chunk = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **choice}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}], "prompt_token_ids": served.prompt_ids if with_ids else None}  # fmt: skip
        await response.write(b"data: " + json.dumps(first).encode() + b"\n\n")
        ids = served.completion_ids
        for k, (token, delta) in enumerate(zip(ids, self._deltas(served, calls), strict=True)):
            last = k == len(ids) - 1
            await send(
                delta,
                token_ids=[token] if with_ids else None,
                logprobs={"content": [self._logprob(token, logprobs[k])]} if with_logprobs else None,
                finish_reason=finish if last else None,
                **({"stop_reason": None} if last else {}),
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(served.prompt_ids), "completion_tokens": len(ids),
                     "total_tokens": len(served.prompt_ids) + len(ids)}  # fmt: skip
            await response.write(b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _deltas(self, served: Served, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One delta per completion token, as vLLM's incremental detokenizer and parsers send them:
        the reasoning's text, the answer's text, each tool call opened (id, name) where its text
        starts and its arguments where it ends; the markup's own tokens carry no text."""
        turn = served.turn
        regions: list[tuple[int, int, str, int]] = []  # [start, end) in the completion text, kind, call index
        at = 0
        if turn.reasoning is not None:
            at += len("<think>")
            regions.append((at, at + len(turn.reasoning), "reasoning", -1))
            at += len(turn.reasoning) + len("</think>")
        regions.append((at, at + len(turn.content), "content", -1))
        at += len(turn.content)
        for i, (name, arguments) in enumerate(turn.tool_calls):
            text = '<tool_call>{"name": ' + json.dumps(name) + ', "arguments": ' + json.dumps(arguments, ensure_ascii=False) + "}</tool_call>"
            regions.append((at, at + len(text), "tool_call", i))
            at += len(text)
        deltas, before = [], ""
        ids = served.completion_ids
        for k in range(len(ids)):
            text = self.tokenizer.decode(ids[: k + 1])
            start, end = len(before), len(text)
            before = text
            delta: dict[str, Any] = {}
            for lo, hi, kind, index in regions:
                if kind == "tool_call":
                    call = calls[index]
                    opened = [] if not (start <= lo < end) else [{"index": index, "id": call["id"], "type": "function",
                                                                  "function": {"name": call["function"]["name"], "arguments": ""}}]  # fmt: skip
                    closed = [] if not (start < hi <= end) else [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]
                    if opened or closed:
                        delta.setdefault("tool_calls", []).extend(opened + closed)
                    continue
                piece = text[max(lo, start) : min(hi, end)]
                if piece:
                    delta[kind] = delta.get(kind, "") + piece
            deltas.append(delta)
        return deltas
