"""What a harness's request exercises, read from the request as it went out (the compatibility
table's "features exercised"), and which API a path speaks.

One reading for the three APIs agl fronts: OpenAI chat (messages of role `tool`), Anthropic Messages
(`tool_result` blocks, `thinking`), the Responses API (input items `function_call_output`,
`reasoning`). Features the spans declare (sub-agents, compaction) are added by report.py.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from agl import semconv

STREAMING = "streaming"
TOOLS = "tools"
TOOL_RESULTS = "tool results"
REASONING = "reasoning"
IMAGES = "images"
TOKEN_COUNTING = "token counting"
WEBSOCKET = "websocket"
SUB_AGENTS = "sub-agents"  # from the spans' declared agents (report.py)
COMPACTION = "compaction"  # from the spans' declared compaction (report.py)
ORDER = (STREAMING, TOOLS, TOOL_RESULTS, REASONING, IMAGES, TOKEN_COUNTING, WEBSOCKET, SUB_AGENTS, COMPACTION)

# A model-call path (after any /rollouts/{id}/... prefix) and the API the sidecar records it under.
_MODEL_PATHS = {
    "/v1/chat/completions": semconv.API_CHAT_COMPLETIONS,
    "/v1/completions": semconv.API_COMPLETIONS,
    "/v1/messages": semconv.API_ANTHROPIC_MESSAGES,
    "/v1/responses": semconv.API_RESPONSES,
}
_TOOL_OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output", "local_shell_call_output", "tool_result")
_IMAGE_PARTS = ("image", "image_url", "input_image")


def api_path(path: str) -> str:
    """`path` without its query and rollout prefix: what the harness asked for, as the docs name it."""
    plain = unquote(urlsplit(path).path)
    at = plain.find("/v1/")
    return plain[at:] if at >= 0 else plain


def model_api(path: str) -> str | None:
    """The API of a model-call path (a span is expected for it), None for any other path."""
    return _MODEL_PATHS.get(api_path(path).rstrip("/"))


def of_request(path: str, body: Any, websocket: bool = False) -> set[str]:
    """The features a request to `path` with the (decoded JSON) `body` exercises."""
    found: set[str] = set()
    if websocket:
        found.add(WEBSOCKET)
    if api_path(path).endswith("/count_tokens"):
        found.add(TOKEN_COUNTING)
    if not isinstance(body, dict):
        return found
    if body.get("stream") is True:
        found.add(STREAMING)
    if isinstance(body.get("tools"), list) and body["tools"]:
        found.add(TOOLS)
    thinking = body.get("thinking")
    if (isinstance(thinking, dict) and thinking.get("type") != "disabled") or body.get("reasoning") or body.get("reasoning_effort"):
        found.add(REASONING)
    for item in _items(body):
        if not isinstance(item, dict):
            continue
        if item.get("role") == "tool" or item.get("type") in _TOOL_OUTPUT_ITEMS:
            found.add(TOOL_RESULTS)
        for part in item.get("content") if isinstance(item.get("content"), list) else ():
            if isinstance(part, dict):
                if part.get("type") == "tool_result":
                    found.add(TOOL_RESULTS)
                elif part.get("type") in _IMAGE_PARTS:
                    found.add(IMAGES)
    return found


def _items(body: dict[str, Any]) -> list[Any]:
    """The conversation's entries: chat and Anthropic `messages`, Responses `input` items."""
    entries = body.get("messages")
    if isinstance(entries, list):
        return entries
    entries = body.get("input")
    return entries if isinstance(entries, list) else []


def ordered(features: set[str]) -> list[str]:
    return [name for name in ORDER if name in features] + sorted(features - set(ORDER))
