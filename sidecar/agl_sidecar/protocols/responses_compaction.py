"""Remote compaction, served by the policy: a Responses request whose input holds a
`compaction_trigger` item (Codex 0.169.0's `remote_compaction_v2`, with OpenAI's provider) asks the
server to compact the conversation and answer one `compaction` item, which the harness then sends
back in place of the history it replaces.

The sidecar asks the engine for the summary: the conversation, then COMPACTION_PROMPT as a user
message, tools still listed (the prompt's prefix stays the one the engine has cached) but not to be
called. The summary is the policy's own text, recorded in the call's span and trained like any
answer; the call is declared a compaction (`agl.call.compaction`). The `compaction` item's
`encrypted_content` is the sidecar's token of that text (responses_tokens.py); a later request
holding it gets the summary as a user message (SUMMARY_PREFIX + summary), and its first call is
declared a compaction too, so assembly starts a new sample there rather than report a break.
"""

from __future__ import annotations

from typing import Any

from agl_sidecar.protocols.responses_tokens import COMPACTION, seal

COMPACTION_PROMPT = (
    "Your context is about to be replaced by a summary that you write now. Write it for yourself, to "
    "carry on the task from it alone: the task and its constraints, what has been done and found so "
    "far (files, commands, results), decisions taken, and what remains to do next. Answer with the "
    "summary only; do not call tools."
)
SUMMARY_PREFIX = "Summary of the conversation so far, written by you to replace it:\n\n"


def summary_message(summary: str) -> dict[str, Any]:
    """The chat message that stands for a compaction whose summary is `summary`."""
    return {"role": "user", "content": SUMMARY_PREFIX + summary}


def compaction_chat(chat: dict[str, Any]) -> dict[str, Any]:
    """The chat request that asks the engine for the summary of `chat`'s conversation."""
    chat["messages"].append({"role": "user", "content": COMPACTION_PROMPT})
    if chat.get("tools"):
        chat["tool_choice"] = "none"
    chat.pop("parallel_tool_calls", None)
    chat.pop("response_format", None)
    return chat


def compaction_item(item_id: str, summary: str) -> dict[str, Any]:
    """The `compaction` output item for the engine's summary."""
    return {"type": "compaction", "id": item_id, "encrypted_content": seal(COMPACTION, summary)}
