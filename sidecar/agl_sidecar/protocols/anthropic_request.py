"""An Anthropic Messages request read as the API reads it, and what becomes of each part of it.

The rule (docs/protocols.md "What the sidecar does not know"): a known field with a wrong type or an
impossible value is refused with the API's 400 naming the field (a `tool_use` without an id, a
temperature of 1.5, a message without content); a field, block type or role the sidecar does not know
is accepted and handled as faithfully as it can: passed on where the engine can use it, otherwise
dropped, and either way written down (FieldFates -> the span's agl.request.fields.*). Harnesses
move faster than any schema; the sidecar must not be the reason one stops.

`read_request` checks the body and returns a `Read`: the typed request, the field fates, and the
messages prepared for translation (known blocks with their unknown keys left out, an unknown block
rendered as its text or dropped, thinking read back (anthropic_thinking.py), `system` entries as one
string, a final empty assistant turn gone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from agl_sidecar.protocols._checks import FieldFates, check, refuse, unknown_keys, wire_names
from agl_sidecar.protocols.anthropic_thinking import readable

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
ToolName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]  # temperature and top_p are 0..1 in this API
Count = Annotated[int, msgspec.Meta(ge=0)]

CACHING = "a prompt-caching mark: the engine caches prefixes by itself"


# --- content blocks --------------------------------------------------------------------------


class _Block(msgspec.Struct, kw_only=True):
    type: str
    cache_control: dict[str, Any] | None = None


class Text(_Block):
    text: str
    citations: list[dict[str, Any]] | None = None


class Image(_Block):
    source: dict[str, Any]


class Document(_Block):
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None


class SearchResult(_Block):
    source: str
    title: str
    content: list[dict[str, Any]]
    citations: dict[str, Any] | None = None


class ToolUse(_Block):
    id: NonEmpty
    name: ToolName
    input: dict[str, Any]


class ToolResult(_Block):
    tool_use_id: NonEmpty
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class Thinking(_Block):
    thinking: str
    signature: str


class RedactedThinking(_Block):
    data: str


class Compaction(_Block):
    content: NonEmpty | None = None  # None: a compaction that failed (a no-op, as the API treats it)
    encrypted_content: str | None = None


BLOCKS: dict[str, type[_Block]] = {
    "text": Text, "image": Image, "document": Document, "search_result": SearchResult, "tool_use": ToolUse,
    "tool_result": ToolResult, "thinking": Thinking, "redacted_thinking": RedactedThinking,
    "compaction": Compaction,
}  # fmt: skip
TOOL_RESULT_BLOCKS = ("text", "image", "document", "search_result")
# Fields the API documents on these blocks that an engine has no use for.
BLOCK_OPTIONS = {
    "cache_control": CACHING,
    "citations": "citations: the engine does not cite",
    "caller": "programmatic tool calling: the engine runs no code",
    "toolset_name": "an MCP toolset name: the engine reaches no MCP server",
    "transformations": "image transformations: the engine gets the image as sent",
    "encrypted_content": "a compaction's opaque data from another provider",
}


# --- the request -----------------------------------------------------------------------------


class Tool(msgspec.Struct):
    """A client tool (name, input_schema), or a server tool (a versioned `type` with its own options)."""

    name: ToolName
    type: str | None = None
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    defer_loading: bool | None = None


class ToolChoice(msgspec.Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, msgspec.Meta(ge=1024)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class Message(msgspec.Struct):
    role: NonEmpty
    content: str | list[dict[str, Any]]


class CountTokensRequest(msgspec.Struct):
    model: NonEmpty
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    context_management: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 0  # required: checked in read_request
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: Unit | None = None
    top_p: Unit | None = None
    top_k: Count | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: str | dict[str, Any] | None = None


# Top-level options the API takes that change nothing an engine behind the sidecar does.
DROPPED_OPTIONS = {
    "mcp_servers": "remote MCP servers: the engine reaches none",
    "service_tier": "Anthropic's capacity tier",
    "container": "Anthropic's code-execution container",
    "cache_control": CACHING,
    "speed": "Anthropic's inference speed mode",
    "inference_geo": "Anthropic's inference region",
    "diagnostics": "Anthropic's request diagnostics",
    "user_profile_id": "an Anthropic user profile",
    "workspace_id": "an Anthropic workspace",
    "betas": "beta names (the SDK sends them as the anthropic-beta header)",
}
# Names a harness may add that an OpenAI-compatible engine (vLLM) takes as sampling parameters.
ENGINE_PARAMETERS = frozenset({
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "seed", "min_tokens",
    "stop_token_ids", "ignore_eos", "logit_bias",
})  # fmt: skip
READ_BY_ADAPTER = frozenset({"model", "messages", "system", "max_tokens", "stream", "stop_sequences", "temperature",
                             "top_p", "top_k", "tools", "tool_choice", "thinking", "context_management",
                             "metadata", "output_config"})  # fmt: skip


@dataclass
class Read:
    """A checked request: the typed view, the body for litellm (translated parts only, messages
    prepared), the engine parameters passed on, and the fates of what is not translated."""

    request: CountTokensRequest
    body: dict[str, Any]
    engine_parameters: dict[str, Any] = field(default_factory=dict)
    fates: FieldFates = field(default_factory=FieldFates)


def read_request(body: dict[str, Any], request_type: type[CountTokensRequest]) -> Read:
    """`body` (a JSON object) checked as the API checks it; ProtocolError(400) names the field."""
    request = check(body, request_type)
    if request_type is MessagesRequest and "max_tokens" not in body:
        raise refuse("Field required", "max_tokens")
    read = Read(request, {k: v for k, v in body.items() if k in READ_BY_ADAPTER})
    fates = read.fates
    for key, value in body.items():
        if key in READ_BY_ADAPTER:
            continue
        if key in DROPPED_OPTIONS:
            fates.drop(key, DROPPED_OPTIONS[key])
        elif key in ENGINE_PARAMETERS:
            read.engine_parameters[key] = value
            fates.pass_on(key, "an engine sampling parameter, not Anthropic's: sent to the engine as is")
        else:
            fates.drop(key, "not a field of the Messages API the sidecar knows")
    _read_tools(request, body, read)
    _read_options(request, body, read)
    read.body["messages"] = _read_messages(body["messages"], fates)
    if "system" in body:
        read.body["system"] = _read_system(body["system"], fates)
    return read


# Claude Code puts this line first in its system prompt: Anthropic's API reads it and removes it (other
# providers refuse it as a reserved keyword); it changes from call to call, so kept it would split
# one thread's calls into samples that share no prefix.
BILLING_HEADER = "x-anthropic-billing-header:"
BILLING_DROPPED = "Claude Code's x-anthropic-billing-header, which Anthropic's API reads and removes"


def _read_system(system: str | list[dict[str, Any]], fates: FieldFates) -> str | list[dict[str, Any]]:
    if isinstance(system, str):
        if not system.startswith(BILLING_HEADER):
            return system
        fates.drop("system", BILLING_DROPPED + " (its first line)")
        return system.partition("\n")[2]
    blocks = _read_blocks(system, "system", fates, allowed=("text",))
    kept = [b for b in blocks if not b["text"].startswith(BILLING_HEADER)]
    if len(kept) < len(blocks):
        at = [j for j, b in enumerate(system) if str(b.get("text", "")).startswith(BILLING_HEADER)]
        fates.drop(f"system[{at[0]}]" if len(at) == 1 else "system", BILLING_DROPPED)
    return kept


def _read_tools(request: CountTokensRequest, body: dict[str, Any], read: Read) -> None:
    fates = read.fates
    tools = body.get("tools") or []
    fates.sized("tools", len(tools))
    kept = []
    for i, (tool, raw) in enumerate(zip(request.tools or (), tools, strict=True)):
        if tool.type in (None, "custom") and tool.input_schema is None:
            raise refuse("Field required (a client tool needs its input_schema)", f"tools[{i}].input_schema")
        if tool.defer_loading:
            fates.drop(f"tools[{i}]", "defer_loading: not in the model's context until a tool search loads it")
            continue
        if tool.type not in (None, "custom") and tool.input_schema is None:
            fates.drop(f"tools[{i}]", f"a server tool ({tool.type}): the engine cannot run it")
            continue
        for key in unknown_keys(raw, Tool):
            fates.drop(f"tools[{i}].{key}", CACHING if key == "cache_control" else "a tool option the engine has no use for")
        kept.append({k: v for k, v in raw.items() if k in ("name", "type", "input_schema", "description")})
    if "tools" in body:
        read.body["tools"] = kept
    choice = request.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise refuse('Field required (tool_choice {"type": "tool"} names the tool)', "tool_choice.name")
    _drop_unknown(body.get("tool_choice"), ToolChoice, "tool_choice", fates)


def _read_options(request: CountTokensRequest, body: dict[str, Any], read: Read) -> None:
    fates = read.fates
    if request.thinking is not None:
        if request.thinking.type == "enabled" and request.thinking.budget_tokens is None:
            raise refuse("Field required", "thinking.budget_tokens")
        _drop_unknown(body["thinking"], ThinkingConfig, "thinking", fates)
        if request.thinking.budget_tokens is not None:
            fates.drop("thinking.budget_tokens", "a thinking budget: the engine's template only switches thinking on")
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        for key in metadata:
            if key != "user_id":
                fates.drop(f"metadata.{key}", "request metadata the engine has no use for")
    output = body.get("output_config")
    if isinstance(output, dict):
        read.body.pop("output_config")
        for key, value in output.items():
            if key == "format":
                read.body["output_format"] = value  # litellm's name: the engine's response_format
            else:
                fates.drop(f"output_config.{key}", "an output option with no engine equivalent")


def _drop_unknown(value: Any, struct: type[msgspec.Struct], at: str, fates: FieldFates) -> None:
    if isinstance(value, dict):
        for key in unknown_keys(value, struct):
            fates.drop(f"{at}.{key}", "not a field the sidecar knows")


# --- messages --------------------------------------------------------------------------------

KNOWN_ROLES = ("user", "assistant", "system")


def _read_messages(messages: list[dict[str, Any]], fates: FieldFates) -> list[dict[str, Any]]:
    fates.sized("messages", len(messages))
    out = []
    for i, message in enumerate(messages):
        at = f"messages[{i}]"
        for key in unknown_keys(message, Message):
            fates.drop(f"{at}.{key}", "not a field of a message")
        role, content = message["role"], message["content"]
        last = i == len(messages) - 1
        if not content:
            if last and role == "assistant":  # an empty prefill is no prefill
                fates.drop(at, "an empty final assistant message: no prefill")
                continue
            raise refuse(
                "all messages must have non-empty content except for the optional final assistant message",
                f"{at}.content",
            )
        if role not in KNOWN_ROLES:
            fates.pass_on(f"{at}.role", f"{role!r} is not an Anthropic role: sent to the engine as a {role!r} message")
        if isinstance(content, list):
            content = _read_blocks(content, f"{at}.content", fates)
            if not content:  # every block was one the engine cannot be given
                fates.drop(at, "none of its content blocks can reach the engine")
                continue
        if role not in ("user", "assistant"):
            content = as_text(content)  # one spelling, so list and string render the same tokens
        out.append({"role": role, "content": content})
    if not out:
        raise refuse("no message has content the engine can be given (blocks of unknown types without text)", "messages")
    return out


def as_text(content: str | list[dict[str, Any]]) -> str:
    """A `system` entry's content as one string: its text blocks joined by newlines, as an
    OpenAI-compatible engine joins a message's text parts for a string template (vLLM)."""
    if isinstance(content, str):
        return content
    return "\n".join(block["text"] for block in content if block.get("type") == "text")


def _read_blocks(
    blocks: list[dict[str, Any]], at: str, fates: FieldFates, allowed: tuple[str, ...] | None = None
) -> list[dict[str, Any]]:
    """Known blocks checked and stripped of what the engine cannot use; an unknown block (a newer
    API's, a server tool's result) rendered as its `text` where it has one, else dropped."""
    fates.sized(at, len(blocks))
    out = []
    for j, block in enumerate(blocks):
        where = f"{at}[{j}]"
        if not isinstance(block, dict):
            raise refuse("Input should be an object", where)
        kind = block.get("type")
        if not isinstance(kind, str):
            raise refuse("Field required (a content block names its type)", f"{where}.type")
        struct = BLOCKS.get(kind)
        if struct is None or (allowed is not None and kind not in allowed):
            text = block.get("text")
            if isinstance(text, str) and text:
                fates.pass_on(where, f"a {kind!r} block the sidecar does not know: sent as its text")
                out.append({"type": "text", "text": text})
            else:
                fates.drop(where, f"a {kind!r} block the sidecar does not know, without text")
            continue
        check(block, struct, where)
        kept = {}
        for key, value in block.items():
            if key in BLOCK_OPTIONS:
                fates.drop(f"{where}.{key}", BLOCK_OPTIONS[key])
            elif key in wire_names(struct):
                kept[key] = value
            else:
                fates.drop(f"{where}.{key}", f"not a field of a {kind!r} block")
        if kind == "tool_result" and isinstance(kept.get("content"), list):
            kept["content"] = _read_blocks(kept["content"], f"{where}.content", fates, TOOL_RESULT_BLOCKS)
        if kind == "redacted_thinking":
            fates.drop(where, "redacted thinking: encrypted by another provider, unreadable to the engine")
            continue
        if kind == "thinking":
            text = readable(kept["thinking"], kept["signature"])
            if text is None:
                fates.drop(where, "a thinking block another provider signed, its text omitted: unreadable")
                continue
            kept["thinking"] = text
        out.append(kept)
    return out
