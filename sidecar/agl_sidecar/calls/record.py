"""What one model call observed, filled in by the proxy and read by the span builder: the call's
identity and trace parent, its choices (the engine's token arrays kept as their JSON bytes until the
builder decodes them), the switch log it ran under, and how it ended."""

from __future__ import annotations

from dataclasses import dataclass, field

from msgspec import Raw

from agl import semconv
from agl_sidecar.calls.attribution import Identity, TraceParent
from agl_sidecar.calls.switches import SwitchLog


@dataclass(slots=True)
class Choice:
    # Raw: the engine's JSON array as it arrived (a unary response), decoded by the span builder.
    token_ids: list[int] | Raw = field(default_factory=list)
    logprobs: list[float] | Raw = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class CallRecord:
    """What one model call observed, filled in by the proxy. Not to be changed once
    `SpanRecorder.finish` has taken it: its span is built from it later."""

    api: str
    operation: str
    identity: Identity
    trace_parent: TraceParent | None
    start_ns: int
    model: str = ""
    stream: bool = False
    seq: int | None = None
    provider: str = semconv.PROVIDER_VLLM
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    n: int | None = None
    # What a translating front did not interpret (protocols/base.Translation): each "<path>: <why>".
    fields_dropped: tuple[str, ...] = ()
    fields_passed: tuple[str, ...] = ()
    # Edits a translating front applied to the prompt (Anthropic's context_management types).
    context_edits: tuple[str, ...] = ()
    policy_version: int | None = None
    held_ms: float = 0.0
    upstream: str | None = None
    response_id: str | None = None
    response_model: str | None = None
    prompt_ids: list[int] | Raw | None = None  # Raw: the engine's JSON array, decoded off the hot path
    choices: dict[int, Choice] = field(default_factory=dict)
    input_tokens: int | None = None
    output_tokens: int | None = None
    end_reason: str = semconv.END_COMPLETED
    error_type: str | None = None
    error_message: str = ""
    input_messages: str | None = None
    output_messages: str | None = None
    tokens_absent: bool = False
    # Drain-free switches (calls/switches.py): the gate's log, set when the call enters, and for a
    # stream the choice-0 tokens received when each switch (by serial) was first seen.
    switches: SwitchLog | None = None
    switch_marks: dict[int, int] | None = None
    finished: bool = False  # handed to the recorder (a call is recorded once, whatever path ends it)
    end_ns: int = 0
    origin: str | None = None  # semconv.ORIGIN_*, set when the call is finished

    def choice(self, index: int) -> Choice:
        found = self.choices.get(index)
        if found is None:
            found = self.choices[index] = Choice()
        return found

    def fail(self, end_reason: str, error_type: str, message: str | None = None) -> None:
        """Why the call did not complete (`message` left as it was when None)."""
        self.end_reason = end_reason
        self.error_type = error_type
        if message is not None:
            self.error_message = message
