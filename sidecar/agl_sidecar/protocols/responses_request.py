"""An OpenAI Responses request as the sidecar reads it: a msgspec Struct for each part it interprets.

A known field with a wrong type or an impossible value is refused with a 400 naming it in `param`
(`tool_choice: "bogus"`, `input: ""`, `reasoning.effort: "bogus"`, a `function_call` without its
`call_id`), rather than let a rewrite of it reach the engine. What the sidecar does not know (a
field, an item type, a content part type, a tool type, a role) is not refused: harnesses add fields
faster than any schema follows. The Structs ignore unknown keys; the translation
(responses_input.py, responses_tools.py) names each one in the call's span as dropped or passed
(docs/protocols.md, "What the sidecar does not know").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from agl_sidecar.protocols._checks import check, refuse

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
FunctionName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]

KNOWN_ROLES = ("user", "assistant", "system", "developer")
# Every effort value OpenAI's API or Codex 0.169.0's model catalog names; vLLM 0.32 takes all but
# "ultra" (responses_tools.py drops what the engine would refuse).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra")


# --- content parts ---------------------------------------------------------------------------
class InputText(msgspec.Struct):
    text: str
    type: str = "input_text"


class OutputText(msgspec.Struct):
    text: str
    type: str = "output_text"
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(msgspec.Struct):
    type: str = "input_image"
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] | None = None


class InputFile(msgspec.Struct):
    type: str = "input_file"
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class Refusal(msgspec.Struct):
    refusal: str
    type: str = "refusal"


PARTS: dict[str, type[msgspec.Struct]] = {
    "input_text": InputText,
    "output_text": OutputText,
    "input_image": InputImage,
    "input_file": InputFile,
    "refusal": Refusal,
}


# --- input items -----------------------------------------------------------------------------
class Message(msgspec.Struct):
    role: NonEmpty  # one of KNOWN_ROLES, or a role the sidecar passes on as written
    content: str | list[dict[str, Any]]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCall(msgspec.Struct):
    call_id: NonEmpty
    name: FunctionName
    arguments: str
    type: str = "function_call"
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(msgspec.Struct):
    call_id: NonEmpty
    output: str | list[dict[str, Any]]
    type: str = "function_call_output"
    id: str | None = None
    status: str | None = None


class CustomToolCall(msgspec.Struct):
    call_id: NonEmpty
    name: FunctionName
    input: str
    type: str = "custom_tool_call"
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class CustomToolCallOutput(msgspec.Struct):
    call_id: NonEmpty
    output: str | list[dict[str, Any]]
    type: str = "custom_tool_call_output"
    id: str | None = None
    status: str | None = None


class Reasoning(msgspec.Struct):
    type: str = "reasoning"
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None


class Compaction(msgspec.Struct):
    encrypted_content: str
    type: str = "compaction"
    id: str | None = None


class CompactionTrigger(msgspec.Struct):
    type: str = "compaction_trigger"


ITEMS: dict[str, type[msgspec.Struct]] = {
    "message": Message,
    "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput,
    "custom_tool_call": CustomToolCall,
    "custom_tool_call_output": CustomToolCallOutput,
    "reasoning": Reasoning,
    "compaction": Compaction,
    "compaction_trigger": CompactionTrigger,
}


# --- tools -----------------------------------------------------------------------------------
class FunctionTool(msgspec.Struct):
    name: FunctionName
    type: str = "function"
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class CustomTool(msgspec.Struct):
    name: FunctionName
    type: str = "custom"
    description: str | None = None
    format: dict[str, Any] | None = None


class NamespaceTool(msgspec.Struct):
    name: FunctionName
    tools: list[dict[str, Any]]
    type: str = "namespace"
    description: str | None = None


TOOLS: dict[str, type[msgspec.Struct]] = {
    "function": FunctionTool,
    "custom": CustomTool,
    "namespace": NamespaceTool,
}


class ToolChoiceFunction(msgspec.Struct):
    name: FunctionName
    type: str = "function"
    namespace: str | None = None


class ToolChoiceAllowed(msgspec.Struct):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]
    type: str = "allowed_tools"


# --- options ---------------------------------------------------------------------------------
class ReasoningOptions(msgspec.Struct):
    effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]
    summary: Literal["auto", "concise", "detailed", "none"] | None = None
    generate_summary: Literal["auto", "concise", "detailed", "none"] | None = None


class JsonSchemaFormat(msgspec.Struct):
    name: NonEmpty
    schema: dict[str, Any]
    type: str = "json_schema"
    strict: bool | None = None
    description: str | None = None


class TextOptions(msgspec.Struct):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


FORMATS = ("text", "json_object", "json_schema")


class ResponsesRequest(msgspec.Struct):
    model: NonEmpty
    input: Annotated[str, msgspec.Meta(min_length=1)] | list[dict[str, Any]]  # items: one by one
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    tools: list[dict[str, Any]] | None = None  # tools: one by one
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    max_tool_calls: Annotated[int, msgspec.Meta(ge=1)] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: bool | None = None
    prompt_cache_retention: str | None = None
    context_management: Any = None
    client_metadata: dict[str, Any] | None = None
    # Server-side state the sidecar does not hold: refused by name rather than answered from a
    # context the harness did not mean.
    conversation: Any = None
    prompt: Any = None


def check_request(body: dict[str, Any]) -> ResponsesRequest:
    """`body`'s top level, checked: ProtocolError(400) naming the field that is wrong."""
    request: ResponsesRequest = check(body, ResponsesRequest)
    if request.conversation is not None:
        raise refuse("the sidecar keeps no conversations: send the items in `input` (or `previous_response_id`)",
                     "conversation")  # fmt: skip
    if request.prompt is not None:
        raise refuse("the sidecar keeps no prompt templates: send `instructions` and `input`", "prompt")
    if isinstance(request.tool_choice, str) and request.tool_choice not in ("none", "auto", "required"):
        raise refuse(f"tool_choice {request.tool_choice!r} is not one of none, auto, required", "tool_choice")
    if request.text is not None and request.text.format is not None:
        kind = request.text.format.get("type")
        if kind not in FORMATS:
            raise refuse(f"text format type {kind!r} is not one of {', '.join(FORMATS)}", "text.format.type")
        if kind == "json_schema":
            check(request.text.format, JsonSchemaFormat, "text.format")
    return request
