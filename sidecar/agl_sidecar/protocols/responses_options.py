"""A Responses request's options (everything but `input` and `tools`) as chat request fields.

Each top-level field is interpreted (sampling, `max_output_tokens`, `text.format`, `reasoning.effort`,
`stream`, `store`, `include`, `previous_response_id`, ...), dropped with its reason (an option the
engine cannot act on: `prompt_cache_key`, `service_tier`, `reasoning.summary`, ...), or, when the
sidecar does not know it: passed to the engine if it is one of the engine's own sampling fields
(`ENGINE_FIELDS`: a harness written for vLLM's Responses server may send them), else dropped.
"""

from __future__ import annotations

from typing import Any

from agl_sidecar.protocols.responses_fates import NOT_FOR_ENGINE, PASSED_AS_WRITTEN, UNKNOWN, Fates
from agl_sidecar.protocols.responses_request import ResponsesRequest

ENCRYPTED_REASONING = "reasoning.encrypted_content"
# vLLM 0.32's chat `reasoning_effort` values (it refuses others).
ENGINE_EFFORTS = frozenset(("none", "minimal", "low", "medium", "high", "xhigh", "max"))
# Chat request fields of vLLM's the Responses API does not have: passed on when a harness sends them.
ENGINE_FIELDS = frozenset((
    "seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logit_bias", "min_tokens", "stop_token_ids", "chat_template_kwargs",
))  # fmt: skip
# Known fields the sidecar reads itself (not an engine option, nothing to record).
_READ = frozenset(("model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "stream",
                   "store", "include", "reasoning", "text", "max_output_tokens", "temperature", "top_p",
                   "parallel_tool_calls", "user", "conversation", "prompt"))  # fmt: skip
# Known fields the engine cannot act on, and why.
_IGNORED = {
    "prompt_cache_key": "the engine caches prompt prefixes by itself",
    "prompt_cache_retention": "the engine caches prompt prefixes by itself",
    "service_tier": NOT_FOR_ENGINE,
    "safety_identifier": NOT_FOR_ENGINE,
    "metadata": NOT_FOR_ENGINE,
    "client_metadata": "read for the call's declared structure; the engine has no use for it",
    "stream_options": NOT_FOR_ENGINE,
    "background": "the sidecar answers in the foreground",
    "max_tool_calls": "the engine cannot limit tool calls",
    "top_logprobs": "the sidecar returns no logprobs in Responses output",
    "context_management": "the sidecar compacts only on a compaction_trigger item",
    "truncation": "the sidecar never truncates the input",
}
_REASONING_KEYS = frozenset(("effort", "summary", "generate_summary"))
_TEXT_KEYS = frozenset(("format", "verbosity"))
_ENCRYPTED = frozenset((ENCRYPTED_REASONING,))


def translate_options(body: dict[str, Any], request: ResponsesRequest, fates: Fates) -> dict[str, Any]:
    """The chat fields for `request`'s options (`body`: the request as sent), messages and tools apart."""
    chat: dict[str, Any] = {"model": request.model}
    if request.max_output_tokens is not None:
        chat["max_tokens"] = request.max_output_tokens
    for key in ("temperature", "top_p", "user", "parallel_tool_calls"):
        value = getattr(request, key)
        if value is not None:
            chat[key] = value
    if request.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    _reasoning(body, request, chat, fates)
    _text(body, request, chat, fates)
    for i, entry in enumerate(request.include or ()):
        if entry not in _ENCRYPTED:
            fates.drop("include[{}]", f"{entry}: the sidecar does not add it to the output", i)
    for key, value in body.items():
        if key in _READ:
            continue
        if key in _IGNORED:
            if value is not None and not (key == "truncation" and value == "disabled"):
                fates.drop(key, _IGNORED[key])
        elif key in ENGINE_FIELDS:
            chat[key] = value
            fates.passed(key, PASSED_AS_WRITTEN)
        else:
            fates.drop(key, UNKNOWN)
    return chat


def _reasoning(body: dict[str, Any], request: ResponsesRequest, chat: dict[str, Any], fates: Fates) -> None:
    options = request.reasoning
    if options is None:
        return
    if options.effort is not None:
        if options.effort in ENGINE_EFFORTS:
            chat["reasoning_effort"] = options.effort
        else:
            fates.drop("reasoning.effort", f"{options.effort}: beyond the efforts the engine takes")
    for key in ("summary", "generate_summary"):
        if getattr(options, key) not in (None, "none"):
            fates.drop(f"reasoning.{key}", "the engine writes no reasoning summaries")
    for key in body["reasoning"]:
        if key not in _REASONING_KEYS:
            fates.drop(f"reasoning.{key}", UNKNOWN)


def _text(body: dict[str, Any], request: ResponsesRequest, chat: dict[str, Any], fates: Fates) -> None:
    options = request.text
    if options is None:
        return
    form = options.format
    if form is not None and form.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif form is not None and form.get("type") == "json_schema":
        schema = {k: form[k] for k in ("name", "schema", "strict", "description") if form.get(k) is not None}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    if options.verbosity is not None:
        fates.drop("text.verbosity", "the engine has no verbosity setting")
    for key in body["text"]:
        if key not in _TEXT_KEYS:
            fates.drop(f"text.{key}", UNKNOWN)
