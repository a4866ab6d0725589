"""Compaction: a harness's context replaced by a summary the policy wrote.

Two kinds reach the sidecar, and both are declared on the call's span (agl.call.compaction), so
assembly starts a new sample where the context stops being its thread's continuation, instead of
finding a merge failure:

- Claude Code's own auto-compaction (and `/compact`): it asks the model for the summary in an
  ordinary call whose last user turn is its summarization prompt, then continues from a first user
  message that holds the summary. Both calls are recognised by Claude Code's texts (2.1.328,
  tests/fixtures/claude-code-2.1.328): the summary call always, the continuation the first time
  its summary is seen (later calls of the compacted thread extend it and merge as usual).
- Anthropic's server-side compaction (`context_management` edit `compact_20260112`): when the prompt
  exceeds `trigger` (input tokens, default 150,000), the sidecar asks the policy itself for the
  summary (`instructions` replace the default prompt) in a call of its own (its own span, declared a
  compaction; the summary is the policy's and is trained), then answers from the compacted context
  (the system prompt and the summary as the user's turn), its response opening with the `compaction`
  block; with `pause_after_compaction` the compaction block is the whole response (stop reason
  `compaction`). A request that carries a compaction block is read as the API reads it: every
  message before the block is dropped and the summary stands in their place, so the next call's
  prompt extends the compacted call's tokens exactly.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

# Claude Code 2.1.328's texts (its summarization prompt begins so; its continuation message too).
CLAUDE_CODE_SUMMARY_PROMPT = "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools."
CLAUDE_CODE_SUMMARY_TASK = "Your task is to create a detailed summary of"
CLAUDE_CODE_CONTINUATION = "This session is being continued from a previous conversation that ran out of context."

DEFAULT_INSTRUCTIONS = (
    "Your context is about to be replaced by a summary you write now. Summarize the conversation so far "
    "so that you can continue the work from the summary alone: the task and every request of the user, "
    "what has been done and found (files, commands, results, decisions, errors and their fixes), what "
    "remains to do, and the next step. Write only the summary, inside <summary></summary> tags."
)


def _texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    return [b["text"] for b in content or () if b.get("type") == "text" and isinstance(b.get("text"), str)]


def is_claude_code_summary_call(messages: list[dict[str, Any]]) -> bool:
    """Whether the request is Claude Code asking the model for its compaction summary."""
    users = [m for m in messages if m["role"] == "user"]
    return bool(users) and any(
        text.startswith(CLAUDE_CODE_SUMMARY_PROMPT) and CLAUDE_CODE_SUMMARY_TASK in text for text in _texts(users[-1])
    )


def claude_code_continuation(messages: list[dict[str, Any]]) -> str | None:
    """The summary message Claude Code continues a compacted conversation from, if this is one."""
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        return None
    return next((text for text in _texts(users[0]) if text.startswith(CLAUDE_CODE_CONTINUATION)), None)


class SeenSummaries:
    """Which continuations have been seen (bounded, least recently seen forgotten first): the first
    call on a compacted context is declared, the ones extending it are not. A sidecar restarted
    between two calls of one compacted thread declares the next one again (one more sample)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def first_time(self, text: str) -> bool:
        key = hashlib.blake2b(text.encode(), digest_size=16).digest()
        if key in self._seen:
            self._seen.move_to_end(key)
            return False
        self._seen[key] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return True


# --- server-side compaction ------------------------------------------------------------------


def after_last_compaction(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as the API reads them: from the last compaction block with a summary on, the
    summary standing as the user's turn in place of everything before it. A compaction block without
    a summary (a failed compaction) is a no-op."""
    at = None
    for i, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, list):
            for j, block in enumerate(content):
                if block["type"] == "compaction" and block.get("content"):
                    at = (i, j)
    out = [_without_compaction_blocks(m) for m in messages]
    if at is None:
        return [m for m in out if m["content"]]
    i, j = at
    summary = summary_turn(messages[i]["content"][j]["content"])
    rest = [b for b in messages[i]["content"][j + 1 :] if b["type"] != "compaction"]
    kept = [{**messages[i], "content": rest}] if rest else []
    return [summary, *kept, *(m for m in out[i + 1 :] if m["content"])]


def _without_compaction_blocks(message: dict[str, Any]) -> dict[str, Any]:
    content = message["content"]
    if isinstance(content, list) and any(b["type"] == "compaction" for b in content):
        return {**message, "content": [b for b in content if b["type"] != "compaction"]}
    return message


def summary_turn(summary: str) -> dict[str, Any]:
    """The compacted context's one message: the summary as the user's turn."""
    return {"role": "user", "content": summary}


def summary_request(chat: dict[str, Any], instructions: str | None) -> dict[str, Any]:
    """The chat request asking the policy for the summary of `chat`'s conversation."""
    request = {k: v for k, v in chat.items() if k not in ("stream", "stream_options")}
    request["messages"] = [*chat["messages"], {"role": "user", "content": instructions or DEFAULT_INSTRUCTIONS}]
    return request


def summary_of(answer: dict[str, Any]) -> str | None:
    """The summary in the policy's answer (its text; None when it wrote none)."""
    choices = answer.get("choices") or []
    message = (choices[0].get("message") or {}) if choices else {}
    content = message.get("content")
    return content if isinstance(content, str) and content.strip() else None


def compaction_block(summary: str | None) -> dict[str, Any]:
    return {"type": "compaction", "content": summary}
