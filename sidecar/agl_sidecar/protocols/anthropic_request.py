"""An Anthropic Messages request as the API accepts it: what it refuses, the sidecar refuses with its
400 (`invalid_request_error`, the field named), rather than translating a body the harness could not
have sent to Anthropic (litellm drops a content block it does not know, with its message, and makes
a tool call of a `tool_use` without id or name). docs/protocols.md lists what is checked."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from agl_sidecar.protocols._checks import check, refuse

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
ToolName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Unit = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]  # temperature and top_p are 0..1 in this API


class _Strict(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", kw_only=True):
    cache_control: dict[str, Any] | None = None


class Text(_Strict, tag="text"):
    text: str
    citations: list[dict[str, Any]] | None = None


class Image(_Strict, tag="image"):
    source: dict[str, Any]
    transformations: Any = None


class Document(_Strict, tag="document"):
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None


class SearchResult(_Strict, tag="search_result"):
    source: str
    title: str
    content: list[Text]
    citations: dict[str, Any] | None = None


class ToolUse(_Strict, tag="tool_use"):
    id: NonEmpty
    name: ToolName
    input: dict[str, Any]
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResult(_Strict, tag="tool_result"):
    tool_use_id: NonEmpty
    content: str | list[Text | Image | Document | SearchResult] | None = None
    is_error: bool | None = None
    toolset_name: str | None = None


class Thinking(_Strict, tag="thinking"):
    thinking: str
    signature: str


class RedactedThinking(_Strict, tag="redacted_thinking"):
    data: str


Block = Text | Image | Document | SearchResult | ToolUse | ToolResult | Thinking | RedactedThinking


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct):
    """A client tool (name, input_schema), or a server tool (a versioned `type` with its own options)."""

    name: ToolName
    type: str | None = None
    input_schema: dict[str, Any] | None = None
    description: str | None = None


class ToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, msgspec.Meta(ge=1024)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class CountTokensRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: NonEmpty
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    system: str | list[Text] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    context_management: dict[str, Any] | None = None
    # Options the API takes that change nothing an engine behind the sidecar does (dropped on the way)
    cache_control: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 0  # required: checked in check_messages
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: Unit | None = None
    top_p: Unit | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: str | dict[str, Any] | None = None
    diagnostics: Any = None
    inference_geo: str | None = None


def check_messages(body: dict[str, Any], request_type: type[CountTokensRequest]) -> None:
    """ProtocolError(400) for what the Messages API refuses in `body` (already a JSON object)."""
    request = check(body, request_type)
    if isinstance(request, MessagesRequest) and "max_tokens" not in body:
        raise refuse("Field required", "max_tokens")
    for i, tool in enumerate(request.tools or ()):
        if tool.type in (None, "custom") and tool.input_schema is None:
            raise refuse("Field required (a client tool needs its input_schema)", f"tools[{i}].input_schema")
    choice = request.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise refuse('Field required (tool_choice {"type": "tool"} names the tool)', "tool_choice.name")
    if request.thinking is not None and request.thinking.type == "enabled" and request.thinking.budget_tokens is None:
        raise refuse("Field required", "thinking.budget_tokens")
