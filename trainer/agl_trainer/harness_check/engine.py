"""The scripted engine: vLLM's OpenAI-compatible API answering from a script instead of a model.

Why not the embedded engine with a tiny model: a random model's text is noise, and a harness needs
plausible answers (a tool call it can run, then text that ends its turn) to go through its loop as it
would in training. This engine answers each call with the script's next turn (script.py), tokenized
and templated by chatml.py, in vLLM 0.32's wire format (embedded/wire.py builds the bodies): prompt
and completion token IDs when asked (`return_token_ids`), a logprob per token, tool calls as vLLM's
hermes parser returns them (`tool_calls`, finish_reason `tool_calls`), reasoning in `reasoning`.
Streams send one chunk per token (markup tokens ride with the next chunk; a tool call's arguments
in one chunk). Any model name is served: the harness's own (`claude-sonnet-4-5`, `gpt-5`) reaches
the engine unchanged. /tokenize answers with the same template, so counted tokens are exact.
"""

from __future__ import annotations

import codecs
import json
import secrets
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from agl_trainer.background_loop import AppServer
from agl_trainer.engines.embedded import wire
from agl_trainer.harness_check import chatml
from agl_trainer.harness_check.script import Script, Turn

FINGERPRINT = "agl-harness-check-scripted"
MAX_MODEL_LEN = 1 << 20  # a byte per token: room for a coding agent's long system prompt
_json = msgspec.json.Encoder()
_SSE = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}


def logprob(token: int, position: int) -> float:
    """A plausible, deterministic logprob in [-2.45, -0.05], as float32 (vLLM reports float32)."""
    value = -(0.05 + ((token * 31 + position * 17) % 97) / 40)
    return struct.unpack("f", struct.pack("f", value))[0]


@dataclass
class Piece:
    """A run of completion text and what a stream chunk says for its tokens: `kind` is "content",
    "reasoning", "markup" (template text the harness never sees, carried by the next chunk), or
    "tool" (a tool call: the tokens of `text[:head]` name it in one chunk, the rest, its arguments
    and closing markup, go with a chunk holding the arguments)."""

    kind: str
    text: str
    tool_index: int = 0
    head: int = 0


@dataclass
class Answer:
    """One choice: its pieces, token IDs (EOS included unless cut) and what the message says."""

    pieces: list[Piece]
    token_ids: list[int]
    finish_reason: str
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def arguments_text(arguments: dict[str, Any]) -> str:
    """A tool call's arguments as vLLM's hermes parser returns them (and as the template writes them)."""
    return json.dumps(arguments, ensure_ascii=False)


def answer(turn: Turn, max_tokens: int | None) -> Answer:
    """The completion for `turn`, cut to `max_tokens` (a cut answer is its text, finish `length`)."""
    pieces: list[Piece] = []
    if turn.reasoning:
        pieces += [Piece("markup", chatml.THINK_OPEN), Piece("reasoning", turn.reasoning), Piece("markup", chatml.THINK_CLOSE)]
    if turn.content:
        pieces.append(Piece("content", turn.content))
    calls = []
    for index, call in enumerate(turn.tool_calls):
        arguments = arguments_text(call.arguments)
        spelled = chatml.tool_call_text(call.name, call.arguments)  # its exact text in the template
        if pieces and not pieces[-1].text.endswith("\n"):
            spelled = "\n" + spelled
        pieces.append(Piece("tool", spelled, index, head=spelled.rindex(arguments)))
        calls.append({"id": f"chatcmpl-tool-{secrets.token_hex(8)}", "type": "function",
                      "function": {"name": call.name, "arguments": arguments}})  # fmt: skip
    text = "".join(piece.text for piece in pieces)
    ids = [*chatml.encode(text), chatml.IM_END]
    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[:max_tokens]
        cut = chatml.TOKENIZER.decode(ids, skip_special_tokens=True)
        return Answer([Piece("content", cut)], ids, "length", cut, None)
    finish = "tool_calls" if calls else "stop"
    return Answer(pieces, ids, finish, turn.content or None, turn.reasoning, calls)


def _logprobs(ids: list[int], start: int, top: int | None) -> dict[str, Any]:
    content = []
    for position, token in enumerate(ids, start):
        text, raw = wire.token_text(chatml.TOKENIZER, token, False)
        value = logprob(token, position)
        content.append({"token": text, "logprob": value, "bytes": raw,
                        "top_logprobs": [{"token": text, "logprob": value, "bytes": raw}][: top or 0]})  # fmt: skip
    return {"content": content}


def _message(a: Answer) -> dict[str, Any]:
    message = wire.chat_message(a.content)  # type: ignore[arg-type]
    message["tool_calls"] = a.tool_calls
    message["reasoning"] = a.reasoning
    return message


class ScriptedEngine(AppServer):
    """The engine on 127.0.0.1:<free port>, in a thread of its own: `start()`, `url`, `stop()`.
    `answered` holds, per generation request, the script turn that answered it (None: the default)."""

    def __init__(self, script: Script | None = None) -> None:
        super().__init__("agl-scripted-engine", self.app)
        self.script = script or Script()
        self.answered: list[int | None] = []
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=256 * 1024**2)
        wire.add_routes(app, self)
        return app

    # --- small routes ---------------------------------------------------------------------------
    async def empty(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return _reply({"version": FINGERPRINT})

    async def models(self, request: web.Request) -> web.Response:
        return _reply(wire.models_response(["scripted"], "scripted", MAX_MODEL_LEN, self.created))

    async def tokenize(self, request: web.Request) -> web.Response:
        req = wire.decode_request(await request.read(), wire.TokenizeRequest)
        if req.messages is not None:
            tokens = chatml.render(req.messages, req.tools, req.add_generation_prompt)
        else:
            tokens = chatml.encode(req.prompt or "")
        return _reply({"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        req = wire.decode_request(await request.read(), wire.DetokenizeRequest)
        return _reply({"prompt": chatml.TOKENIZER.decode(req.tokens)})

    def _next(self) -> Turn:
        index, turn = self.script.next_turn()
        self.answered.append(index)
        return turn

    # --- chat -----------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = wire.decode_request(await request.read(), wire.ChatCompletionRequest)
        prompt = chatml.render(req.messages, req.tools, req.add_generation_prompt)
        turn = self._next()
        answers = [answer(turn, req.max_completion_tokens or req.max_tokens) for _ in range(max(1, req.n))]
        request_id, model = f"chatcmpl-{secrets.token_hex(8)}", req.model or "scripted"
        if req.stream:
            return await _send(request, self._chat_events(req, request_id, model, prompt, answers))
        choices = [
            {
                "index": index,
                "message": _message(a),
                "logprobs": _logprobs(a.token_ids, 0, req.top_logprobs) if req.logprobs else None,
                "finish_reason": a.finish_reason,
                "stop_reason": None,
                "token_ids": a.token_ids if req.return_token_ids else None,
                "routed_experts": None,
            }
            for index, a in enumerate(answers)
        ]
        body = wire.chat_response(request_id, int(time.time()), model, choices, prompt,
                                  sum(len(a.token_ids) for a in answers), req.return_token_ids)  # fmt: skip
        body["system_fingerprint"] = FINGERPRINT
        return _reply(body)

    def _chat_events(
        self, req: Any, request_id: str, model: str, prompt: list[int], answers: list[Answer]
    ) -> Iterator[dict[str, Any]]:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
        for index in range(len(answers)):
            first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield {**head, "choices": [first], "prompt_token_ids": prompt if req.return_token_ids else None, "prompt_text": None}
        for index, a in enumerate(answers):
            position = 0
            for delta, ids, last in _chunks(a):
                choice: dict[str, Any] = {"index": index, "delta": delta}
                choice["logprobs"] = _logprobs(ids, position, req.top_logprobs) if req.logprobs else None
                choice["finish_reason"] = a.finish_reason if last else None
                if last:
                    choice["stop_reason"] = None
                choice["token_ids"] = ids if req.return_token_ids else None
                position += len(ids)
                yield {**head, "choices": [choice]}
        if req.stream_options and req.stream_options.include_usage:
            completion = sum(len(a.token_ids) for a in answers)
            yield {**head, "choices": [], "usage": wire.usage(len(prompt), completion, details=False),
                   "system_fingerprint": FINGERPRINT}  # fmt: skip

    # --- completions ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = wire.decode_request(await request.read(), wire.CompletionRequest)
        prompts = [chatml.encode(p) if isinstance(p, str) else p for p in wire.prompts_of(req.prompt)]
        turn = self._next()
        text = chatml.assistant_text(turn.content, turn.reasoning, [(c.name, c.arguments) for c in turn.tool_calls])
        answers = [answer(Turn(content=text), req.max_tokens if req.max_tokens is not None else 16) for _ in prompts]
        request_id, model = f"cmpl-{secrets.token_hex(8)}", req.model or "scripted"
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
        if req.stream:
            return await _send(request, self._completion_events(req, head, prompts, answers))
        choices = []
        for index, (prompt, a) in enumerate(zip(prompts, answers, strict=True)):
            choices.append({
                "index": index, "text": a.content or "",
                "logprobs": _legacy_logprobs(a.token_ids, 0, 0) if req.logprobs is not None else None,
                "finish_reason": a.finish_reason, "stop_reason": None,
                "token_ids": a.token_ids if req.return_token_ids else None, "prompt_logprobs": None,
                "prompt_token_ids": prompt if req.return_token_ids else None, "routed_experts": None,
            })  # fmt: skip
        body = wire.completion_response(request_id, head["created"], model, choices,  # type: ignore[arg-type]
                                        sum(map(len, prompts)), sum(len(a.token_ids) for a in answers))  # fmt: skip
        body["system_fingerprint"] = FINGERPRINT
        return _reply(body)

    def _completion_events(
        self, req: Any, head: dict[str, Any], prompts: list[list[int]], answers: list[Answer]
    ) -> Iterator[dict[str, Any]]:
        for index, (prompt, a) in enumerate(zip(prompts, answers, strict=True)):
            position, offset = 0, 0
            for delta, ids, last in _chunks(a):
                text = delta.get("content", "")
                yield {**head, "choices": [{
                    "index": index, "text": text,
                    "logprobs": _legacy_logprobs(ids, position, offset) if req.logprobs is not None else None,
                    "finish_reason": a.finish_reason if last else None, "stop_reason": None,
                    "prompt_token_ids": prompt if req.return_token_ids and position == 0 else None,
                    "token_ids": ids if req.return_token_ids else None,
                }]}  # fmt: skip
                position, offset = position + len(ids), offset + len(text)
        if req.stream_options and req.stream_options.include_usage:
            p, c = sum(map(len, prompts)), sum(len(a.token_ids) for a in answers)
            yield {**head, "choices": [], "usage": wire.usage(p, c, details=False), "system_fingerprint": FINGERPRINT}


def _legacy_logprobs(ids: list[int], start: int, offset: int) -> dict[str, Any]:
    tokens, offsets, values, tops = [], [], [], []
    for position, token in enumerate(ids, start):
        text = wire.token_text(chatml.TOKENIZER, token, False)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(logprob(token, position))
        tops.append({text: values[-1]})
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}


def _chunks(a: Answer) -> Iterator[tuple[dict[str, Any], list[int], bool]]:
    """(delta, token IDs, last?) per stream chunk: a chunk per content or reasoning token (its text
    as it completes: a UTF-8 character split over tokens shows with its last byte), a tool call's
    name then its arguments, markup tokens carried by the next chunk, EOS in the last."""
    ids = a.token_ids
    out: list[tuple[dict[str, Any], list[int]]] = []
    carried: list[int] = []
    at = 0
    for piece in a.pieces:
        count = min(len(chatml.encode(piece.text)), len(ids) - at)
        tokens, at = ids[at : at + count], at + count
        if piece.kind == "markup":
            carried += tokens
        elif piece.kind == "tool":
            call = a.tool_calls[piece.tool_index]
            head = len(chatml.encode(piece.text[: piece.head]))
            named = {"index": piece.tool_index, "id": call["id"], "type": "function",
                     "function": {"name": call["function"]["name"], "arguments": ""}}  # fmt: skip
            out.append(({"tool_calls": [named]}, carried + tokens[:head]))
            arguments = {"index": piece.tool_index, "function": {"arguments": call["function"]["arguments"]}}
            out.append(({"tool_calls": [arguments]}, tokens[head:]))
            carried = []
        else:
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            for token in tokens:
                out.append(({piece.kind: decoder.decode(bytes([token - chatml.BYTE_OFFSET]))}, carried + [token]))
                carried = []
    final = {} if a.finish_reason == "tool_calls" else {"content": ""}
    out.append((final, carried + ids[at:]))  # EOS (none when the answer was cut: an empty last chunk)
    for index, (delta, tokens) in enumerate(out):
        yield delta, tokens, index == len(out) - 1


async def _send(request: web.Request, events: Iterator[dict[str, Any]]) -> web.StreamResponse:
    response = web.StreamResponse(headers=_SSE)
    await response.prepare(request)
    for event in events:
        await response.write(b"data: " + _json.encode(event) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _reply(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except wire.RequestError as error:
        return _reply(error.body(), error.code)
