"""Responses tools as the engine's chat tools, and the engine's tool names back to the harness's.

- `function` tools go to the engine as chat functions.
- `namespace` tools (a group of functions a harness addresses as `(namespace, name)`: Codex puts its
  sub-agent tools in `multi_agent_v1`) are flattened: each function reaches the engine as
  `{namespace}__{name}` (the convention of MCP tool names, and of litellm's bridge), and a call of
  that name comes back to the harness as `{"name": name, "namespace": namespace}`, as it sent them.
- `custom` tools (free-form input, no JSON schema) reach the engine as a function of one string
  parameter `input`; a call comes back as a `custom_tool_call` with that string.
- Hosted tools (`web_search`, `file_search`, `computer_use_preview`, `code_interpreter`,
  `image_generation`, `mcp`, ...) run inside OpenAI's servers; the engine cannot run them, so they
  are dropped, and the span says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agl_sidecar.protocols._checks import check, refuse
from agl_sidecar.protocols.base import ProtocolError
from agl_sidecar.protocols.responses_fates import HOSTED_TOOL, NOT_FOR_ENGINE, UNKNOWN, Fates
from agl_sidecar.protocols.responses_request import (
    TOOLS,
    CustomTool,
    FunctionTool,
    NamespaceTool,
    ToolChoiceAllowed,
    ToolChoiceFunction,
)

SEPARATOR = "__"
# OpenAI's built-in tools: known, and dropped as tools the engine cannot run.
HOSTED = frozenset((
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
    "file_search", "computer_use_preview", "computer", "code_interpreter", "image_generation", "mcp",
    "local_shell", "shell", "apply_patch", "tool_search",
))  # fmt: skip
_KNOWN_TOOL_KEYS = {kind: frozenset(struct.__struct_fields__) for kind, struct in TOOLS.items()}
CUSTOM_INPUT = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's free-form input."}},
    "required": ["input"],
}


@dataclass(frozen=True, slots=True)
class HarnessName:
    """A tool as the harness names it."""

    name: str
    namespace: str | None = None
    custom: bool = False


def engine_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{SEPARATOR}{name}" if namespace else name


@dataclass(slots=True)
class ToolTable:
    """The engine's chat tools and, for each engine name that is not the harness's, the harness's."""

    chat_tools: list[dict[str, Any]] = field(default_factory=list)
    renamed: dict[str, HarnessName] = field(default_factory=dict)
    _names: set[str] = field(default_factory=set)

    def harness_name(self, name: str) -> HarnessName:
        return self.renamed.get(name) or HarnessName(name)

    def _add(self, chat_name: str, harness: HarnessName, tool: dict[str, Any], at: str) -> None:
        if chat_name in self._names:
            raise refuse(f"two tools reach the engine as {chat_name!r}", at)
        self._names.add(chat_name)
        self.chat_tools.append({"type": "function", "function": tool})
        if harness.namespace or harness.custom:
            self.renamed[chat_name] = harness


def translate_tools(tools: list[dict[str, Any]] | None, fates: Fates) -> ToolTable:
    """`tools` as the engine's chat tools; ProtocolError(400) for a malformed one."""
    table = ToolTable()
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind in HOSTED:
            fates.drop("tools[{}]", f"{kind}: {HOSTED_TOOL}", i)
        elif kind in TOOLS:
            _unknown_keys(tool, kind, f"tools[{i}]", fates)
            if kind == "namespace":
                _namespace(tool, i, table, fates)
            else:
                _one(tool, None, f"tools[{i}]", table)
        elif not isinstance(kind, str):
            raise refuse("a tool needs a string `type`", f"tools[{i}].type")
        else:
            fates.drop("tools[{}]", f"{kind}: {UNKNOWN}", i)
    return table


def _namespace(tool: dict[str, Any], i: int, table: ToolTable, fates: Fates) -> None:
    namespace: NamespaceTool = check(tool, NamespaceTool, f"tools[{i}]")
    for j, inner in enumerate(namespace.tools):
        kind = inner.get("type", "function")
        at = f"tools[{i}].tools[{j}]"
        if kind in ("function", "custom"):
            _unknown_keys(inner, kind, at, fates)
            _one(inner, namespace.name, at, table)
        else:
            fates.drop(f"tools[{i}].tools[{{}}]", f"{kind}: {UNKNOWN}", j)
    if namespace.description:  # the engine sees each function's own description
        fates.drop(f"tools[{i}].description", "a namespace's description has no place in chat tools")


def _one(tool: dict[str, Any], namespace: str | None, at: str, table: ToolTable) -> None:
    if tool.get("type", "function") == "custom":
        custom: CustomTool = check(tool, CustomTool, at)
        function: dict[str, Any] = {"name": engine_name(custom.name, namespace), "parameters": CUSTOM_INPUT}
        if custom.description is not None:
            function["description"] = custom.description
        table._add(function["name"], HarnessName(custom.name, namespace, custom=True), function, f"{at}.name")
        return
    plain: FunctionTool = check(tool, FunctionTool, at)
    function = {"name": engine_name(plain.name, namespace)}
    if plain.description is not None:
        function["description"] = plain.description
    no_parameters = {"type": "object", "properties": {}}
    function["parameters"] = plain.parameters if plain.parameters is not None else no_parameters
    if plain.strict is not None:
        function["strict"] = plain.strict
    table._add(function["name"], HarnessName(plain.name, namespace), function, f"{at}.name")


def _unknown_keys(tool: dict[str, Any], kind: str, at: str, fates: Fates) -> None:
    known = _KNOWN_TOOL_KEYS[kind]
    for key in tool:
        if key not in known:
            fates.drop(f"{at}.{key}", NOT_FOR_ENGINE if key in ("defer_loading", "output_schema") else UNKNOWN)


def translate_tool_choice(choice: str | dict[str, Any] | None, table: ToolTable, fates: Fates) -> Any:
    """The chat `tool_choice` for the Responses one (None: leave the engine's default)."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind in ("function", "custom"):
        named: ToolChoiceFunction = check(choice, ToolChoiceFunction, "tool_choice")
        return {"type": "function", "function": {"name": engine_name(named.name, named.namespace)}}
    if kind == "allowed_tools":
        allowed: ToolChoiceAllowed = check(choice, ToolChoiceAllowed, "tool_choice")
        fates.drop("tool_choice.tools", "the engine cannot limit its calls to some of the tools")
        return allowed.mode
    fates.drop("tool_choice", f"{kind}: {HOSTED_TOOL if kind in HOSTED else UNKNOWN}")
    return None


def tool_table(body: dict[str, Any]) -> ToolTable:
    """The tool table of a request already checked (for building its response)."""
    try:
        return translate_tools(body.get("tools"), Fates())
    except (ProtocolError, AttributeError, TypeError):
        return ToolTable()
