"""An OpenAI Responses request as the API accepts it: what it refuses (an unknown parameter, an
input item without its call_id, a function tool without a name, a temperature outside 0..2), the
sidecar refuses with a 400 naming the field in `param`, rather than letting litellm's bridge drop or
blank it. Tools and input items the engine cannot be given (hosted tools: web search, file search,
computer use) are refused too, never silently left out. docs/protocols.md lists what is checked."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from agl_sidecar.protocols._checks import check, refuse

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
FunctionName = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class _Part(msgspec.Struct, tag_field="type", kw_only=True):
    pass


class InputText(_Part, tag="input_text"):
    text: str


class OutputText(_Part, tag="output_text"):
    text: str


class InputImage(_Part, tag="input_image"):
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto"] | None = None


class InputFile(_Part, tag="input_file"):
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None


class Refusal(_Part, tag="refusal"):
    refusal: str


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | OutputText | InputImage | InputFile | Refusal]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function_call"]
    call_id: NonEmpty
    name: FunctionName
    arguments: str
    id: str | None = None
    status: str | None = None
    caller: dict[str, Any] | None = None
    namespace: str | None = None


class FunctionCallOutput(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    caller: dict[str, Any] | None = None
    name: str | None = None
    namespace: str | None = None


class Reasoning(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]]
    id: str | None = None
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


_ITEMS: dict[str, type[msgspec.Struct]] = {
    "message": Message,
    "function_call": FunctionCall,
    "function_call_output": FunctionCallOutput,
    "reasoning": Reasoning,
}


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: FunctionName
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None
    allowed_callers: list[str] | None = None
    defer_loading: bool | None = None
    output_schema: dict[str, Any] | None = None


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: NonEmpty
    input: str | list[dict[str, Any]]  # items: checked one by one (a message may omit its type)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    tools: list[dict[str, Any]] | None = None  # checked one by one: hosted tool types are named
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
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


def check_responses(body: dict[str, Any]) -> None:
    """ProtocolError(400) for what the Responses API (or an engine behind it) refuses in `body`."""
    request = check(body, ResponsesRequest)
    if isinstance(request.input, list):
        for i, item in enumerate(request.input):
            kind = item.get("type", "message" if "role" in item else None)
            struct = _ITEMS.get(kind) if isinstance(kind, str) else None
            if struct is None:
                known = ", ".join(_ITEMS)
                raise refuse(f"input item type {kind!r} is not one the sidecar can pass on ({known})", f"input[{i}].type")
            check(item, struct, f"input[{i}]")
    for i, tool in enumerate(request.tools or ()):
        if tool.get("type") != "function":
            raise refuse(
                f"tool type {tool.get('type')!r} is not supported: an engine behind the sidecar calls functions "
                'only ({"type": "function", "name": ...})',
                f"tools[{i}].type",
            )
        check(tool, FunctionTool, f"tools[{i}]")
