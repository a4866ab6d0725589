"""The seam between the sidecar's chat-completions core and other front protocols.

A harness may speak Anthropic Messages or the OpenAI Responses API. An adapter translates its
request to an OpenAI chat-completions request; the core sends that to the engine exactly as for a
chat call (asking for token IDs and logprobs, recording the span, stripping what the harness did
not ask for) and hands the chat response, or each parsed stream chunk, back to the adapter, which
translates it to the harness's protocol. The core never knows which protocol the harness spoke,
beyond `api` (recorded as the span's agl.call.api).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class ProtocolError(Exception):
    """A request the adapter cannot translate: answered with `status` in the protocol's error format."""

    def __init__(
        self, status: int, message: str, error_type: str = "invalid_request_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param  # the field at fault (OpenAI's error `param`), when there is one


@dataclass(frozen=True, slots=True)
class Declared:
    """The structure a request's body declares (docs/spans.md "Declared structure"): the agent that
    made the call, the agent that started it, and whether the call is (or follows) a compaction of
    the harness's context. Headers that declare the same win (x-agl-*); `compaction` adds to them."""

    agent_id: str | None = None
    parent_agent_id: str | None = None
    compaction: bool = False


@dataclass(frozen=True, slots=True)
class Translation:
    """The chat request for a harness's request, and what became of the parts of that request the
    adapter does not interpret (docs/protocols.md "What the sidecar does not know"). Each entry of
    `dropped` and `passed` is "<JSON path>: <why>", indices collapsed where every item shares the
    fate (`tools[*].cache_control`); the span records both lists (agl.request.fields.*)."""

    chat: dict[str, Any]
    # Not sent to the engine: an option the engine cannot act on, a hosted tool it cannot run.
    dropped: tuple[str, ...] = field(default=())
    # Not interpreted by the adapter, sent to the engine as they were (an engine may use them).
    passed: tuple[str, ...] = field(default=())
    # What the body declares about the call's place in the rollout (Codex's client_metadata).
    declared: Declared | None = None
    # Edits the adapter applied to the prompt (Anthropic's context_management types, e.g.
    # "clear_thinking_20251015"): the span's agl.call.context_edits, so assembly names the break.
    context_edits: tuple[str, ...] = field(default=())
    # Work the core must do first (Step); `chat` is then a placeholder and the step's resume gives
    # the Translation to use.
    step: Step | None = None
    # The adapter's whole answer, sent without calling the engine: (body bytes, content type).
    reply: tuple[bytes, str] | None = None
    # The request the response is built for, when not the harness's own (an adapter's note to itself:
    # Anthropic's server-side compaction puts its compaction block first in the response).
    respond_to: dict[str, Any] | None = None

    @property
    def compaction(self) -> bool:
        """Whether the call is declared a compaction (its span's agl.call.compaction)."""
        return self.declared is not None and self.declared.compaction


STEP_COUNT = "count"
STEP_SUMMARIZE = "summarize"


@dataclass(frozen=True, slots=True)
class Step:
    """Engine work an adapter needs before it can translate a request, done by the core, whose
    result `resume` turns into the next Translation (which may ask for another step):
    STEP_COUNT: the prompt tokens of the chat request `chat` under the engine's chat template (its
    POST /tokenize), an int; STEP_SUMMARIZE: the policy's answer to `chat`, asked through the
    sidecar's own chat route so that it is a recorded call with its own span, declared a compaction
    (the chat.completion as a dict)."""

    kind: str  # STEP_COUNT | STEP_SUMMARIZE
    chat: dict[str, Any]
    resume: Callable[[Any], Translation]


class StreamTranslator(Protocol):
    """Turns a chat-completions chunk stream into the protocol's stream, one chunk at a time."""

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """SSE bytes to send for one chat.completion.chunk (already parsed), possibly none."""
        ...

    def finish(self) -> list[bytes]:
        """SSE bytes that close the stream after the last chunk."""
        ...


class ProtocolAdapter(Protocol):
    """One front protocol. `path` is relative to `/v1` (for instance "/messages")."""

    api: str  # one of agl.semconv.API_*
    path: str
    # True for requests that only count tokens (Anthropic's count_tokens): the core sends the chat
    # request to the engine's POST /tokenize instead of generating, records no call span, and
    # passes the tokenize response to from_chat_response.
    tokenize_only: bool

    def prepare(self) -> None:
        """Import what translating needs (litellm: seconds of CPU). Called once, in a worker
        thread, before the adapter's first request, so the event loop keeps serving meanwhile."""
        ...

    def to_chat_request(self, body: dict[str, Any]) -> Translation:
        """The chat-completions request for `body`, with what was dropped or passed on unread;
        raises ProtocolError for a malformed body (a known field with a wrong type or an impossible
        value), never for a field the adapter does not know."""
        ...

    def from_chat_response(self, chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        """The protocol's response for the chat response `chat` to the original request `body`."""
        ...

    def stream_translator(self, body: dict[str, Any]) -> StreamTranslator:
        """A translator for one streamed call of the original request `body`."""
        ...

    def error_body(self, status: int, message: str, error_type: str, param: str | None = None) -> dict[str, Any]:
        """An error in the protocol's own format (the sidecar sends it with `status`)."""
        ...
