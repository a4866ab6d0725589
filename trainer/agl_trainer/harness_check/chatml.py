"""The scripted engine's tokenizer and chat template.

Tokens are bytes (id = byte + 3) plus two specials, `<|im_start|>` (1) and `<|im_end|>` (2, EOS):
any text encodes, and the encoding of a concatenation is the concatenation of the encodings, so a
merge break the check reports comes from the messages the harness sent, never from the tokenizer.
The template is ChatML, as Qwen's: tools listed in the system turn, tool calls as
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` in the assistant's text, reasoning as a
`<think>` block before it, tool results as turns of role `tool`. The completion the engine generates
for an answer is exactly how the template renders that answer when the harness sends it back, so a
harness that returns the conversation as it got it extends the previous call token for token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

IM_START = 1
IM_END = 2  # also EOS: ends every completion
BYTE_OFFSET = 3
SPECIALS = {IM_START: "<|im_start|>", IM_END: "<|im_end|>"}
VOCAB_SIZE = 256 + BYTE_OFFSET
TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"
THINK_OPEN = "<think>\n"
THINK_CLOSE = "\n</think>\n\n"
_TEXT_PARTS = ("text", "input_text", "output_text")
_IMAGE_PARTS = ("image", "image_url", "input_image")


def encode(text: str) -> list[int]:
    return [byte + BYTE_OFFSET for byte in text.encode("utf-8", "surrogatepass")]


class ByteTokenizer:
    """What assembly's break classifier and the report need of a tokenizer (`decode`)."""

    eos_token_id = IM_END
    all_special_ids = sorted(SPECIALS)

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        out, run = [], bytearray()
        for token in ids:
            token = int(token)
            if token >= BYTE_OFFSET:
                run.append(token - BYTE_OFFSET if token < VOCAB_SIZE else 0x3F)  # out of the vocabulary: "?"
                continue
            out.append(run.decode("utf-8", "replace"))
            run.clear()
            if not skip_special_tokens:
                out.append(SPECIALS.get(token, ""))
        out.append(run.decode("utf-8", "replace"))
        return "".join(out)


TOKENIZER = ByteTokenizer()


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text of its parts (an image as `[image]`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, str):
                pieces.append(part)
            elif isinstance(part, dict):
                kind = part.get("type")
                if kind in _TEXT_PARTS or (kind is None and isinstance(part.get("text"), str)):
                    pieces.append(str(part.get("text", "")))
                elif kind in _IMAGE_PARTS:
                    pieces.append("[image]")
        return "".join(pieces)
    return json.dumps(content, ensure_ascii=False)


def tool_call_text(name: str, arguments: Any) -> str:
    """One tool call as the template writes it; `arguments` a JSON string (as OpenAI sends it back:
    parsed, so spacing does not matter) or an object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # not JSON: rendered as the string it is
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + TOOL_CALL_CLOSE


def assistant_text(content: str, reasoning: str | None = None, tool_calls: Iterable[tuple[str, Any]] = ()) -> str:
    """An assistant turn's text (what the engine generates, before EOS): reasoning, content, tool calls."""
    text = f"{THINK_OPEN}{reasoning}{THINK_CLOSE}" if reasoning else ""
    text += content
    for name, arguments in tool_calls:
        text += ("\n" if text and not text.endswith("\n") else "") + tool_call_text(name, arguments)
    return text


def _assistant_message_text(message: dict[str, Any]) -> str:
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            calls.append((str(function.get("name", "")), function.get("arguments", "")))
    return assistant_text(content_text(message.get("content")), reasoning if isinstance(reasoning, str) else None, calls)


def tools_text(tools: list[Any]) -> str:
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return f"# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>\n{lines}\n</tools>"


def render(messages: list[Any], tools: list[Any] | None = None, add_generation_prompt: bool = True) -> list[int]:
    """The prompt's token IDs for a chat request's messages (and tools)."""
    turns: list[tuple[str, str]] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = str(message.get("role", "user"))
        text = _assistant_message_text(message) if role == "assistant" else content_text(message.get("content"))
        turns.append((role, text))
    if tools:
        if turns and turns[0][0] in ("system", "developer"):
            turns[0] = (turns[0][0], f"{turns[0][1]}\n\n{tools_text(tools)}")
        else:
            turns.insert(0, ("system", tools_text(tools)))
    ids: list[int] = []
    for role, text in turns:
        ids += [IM_START, *encode(f"{role}\n{text}"), IM_END, *encode("\n")]
    if add_generation_prompt:
        ids += [IM_START, *encode("assistant\n")]
    return ids
