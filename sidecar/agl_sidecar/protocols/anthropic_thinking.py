"""Thinking blocks: the engine's reasoning out to the harness, and back into the prompt exactly.

Out: vLLM returns a reasoning model's thinking as `reasoning` (older servers: `reasoning_content`)
beside the answer; the harness gets it as a `thinking` block whose `signature` carries that text
whole (`agl1.` + URL-safe base64 of its UTF-8). With `thinking.display: "omitted"` the block's
`thinking` is empty, as Anthropic's is (a stream then sends only the `signature_delta`); the
signature still carries the text, as Anthropic's encrypted one does.

Back: a thinking block the harness returns is read from its signature when the sidecar made it
(the engine's exact text, whatever the block's `thinking` says, and whether it was shown or
omitted), else from its `thinking` text. The text becomes the assistant message's `reasoning`
(vLLM's input name) and `reasoning_content` (what chat templates read), so the next prompt renders
the model's reasoning where it generated it, and consecutive calls merge token-exactly.
A block signed by another provider with no text (Anthropic's own, omitted) cannot be read: it is
dropped, and the span says so.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any


PREFIX = "agl1."


def sign(reasoning: str) -> str:
    """The signature of a thinking block holding `reasoning`."""
    return PREFIX + base64.urlsafe_b64encode(reasoning.encode()).decode()


def unsign(signature: str) -> str | None:
    """The reasoning a signature made by `sign` carries; None for any other signature."""
    if not signature.startswith(PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(signature[len(PREFIX) :].encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def omitted(thinking: Any) -> bool:
    """Whether the request's `thinking` config asks for the text to be left out of the response."""
    return isinstance(thinking, dict) and thinking.get("display") == "omitted"


def block(reasoning: str, hide: bool) -> dict[str, Any]:
    """The response's thinking block for the engine's `reasoning`."""
    return {"type": "thinking", "thinking": "" if hide else reasoning, "signature": sign(reasoning)}


def readable(thinking: str, signature: str) -> str | None:
    """The reasoning a returned thinking block stands for: from its signature when the sidecar
    made it, else its text; None when neither can be read (another provider's, omitted)."""
    text = unsign(signature)
    if text is None:
        text = thinking or None
    return text
