"""The span contract: every span name, attribute, header and environment variable agl uses.

docs/spans.md is the prose version of this module. The sidecar, the SDK and the trainer import these
constants; no other module spells an attribute name. `gen_ai.*` names follow the OpenTelemetry GenAI
semantic conventions; `agl.*` names are agl's own.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import quote

# --- Span names -------------------------------------------------------------------------------
SPAN_ROLLOUT: Final = "agl.rollout"
SPAN_REWARD: Final = "agl.reward"
# A model call's span is named "{operation} {model}", as the GenAI conventions ask.
OPERATION_CHAT: Final = "chat"
OPERATION_TEXT_COMPLETION: Final = "text_completion"


def call_span_name(operation: str, model: str) -> str:
    """The name of a model call's span: `chat tiny`, `text_completion tiny`."""
    return f"{operation} {model}" if model else operation


# --- OpenTelemetry GenAI semantic conventions -------------------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_STREAM: Final = "gen_ai.request.stream"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P: Final = "gen_ai.request.top_p"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_CHOICE_COUNT: Final = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
# Opt-in message capture (the conventions make content opt-in): JSON strings.
GEN_AI_INPUT_MESSAGES: Final = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES: Final = "gen_ai.output.messages"
ERROR_TYPE: Final = "error.type"

PROVIDER_VLLM: Final = "vllm"

# --- Rollout identity (on call, rollout and reward spans) -------------------------------------
ROLLOUT_ID: Final = "agl.rollout.id"
TASK_ID: Final = "agl.task.id"
ATTEMPT: Final = "agl.attempt"
ROLLOUT_MODE: Final = "agl.rollout.mode"  # "train" | "val"
ROLLOUT_STATUS: Final = "agl.rollout.status"  # "succeeded" | "failed"

MODE_TRAIN: Final = "train"
MODE_VAL: Final = "val"
MODES: Final = (MODE_TRAIN, MODE_VAL)
STATUS_SUCCEEDED: Final = "succeeded"
STATUS_FAILED: Final = "failed"

# --- Model call spans (made by the sidecar) ---------------------------------------------------
# int: a call's identity and order in its rollout (unique, increasing in arrival order; the sidecar's is
# a clock reading, docs/spans.md "Call numbers"). On a reward: the call's position (0 = first) or its seq.
CALL_SEQ: Final = "agl.call.seq"
CALL_API: Final = "agl.call.api"  # which front protocol the harness spoke, see API_*
CALL_END_REASON: Final = "agl.call.end_reason"  # see END_*
CALL_HELD_MS: Final = "agl.call.held_ms"  # double: time held while training paused the sidecar
CALL_UPSTREAM: Final = "agl.call.upstream"  # the replica that served the call
PROMPT_TOKEN_IDS: Final = "agl.prompt.token_ids"  # int[]: the prompt, or its suffix (see PROMPT_REF_*)
# A prompt sent as a reference: prompt = full_sequence(call PROMPT_REF_CALL_SEQ)[:PROMPT_REF_LENGTH]
# + PROMPT_TOKEN_IDS, where full_sequence is that call's prompt + choice-0 completion tokens.
PROMPT_REF_CALL_SEQ: Final = "agl.prompt.ref.call_seq"  # int
PROMPT_REF_LENGTH: Final = "agl.prompt.ref.length"  # int
PROMPT_LENGTH: Final = "agl.prompt.length"  # int: the full prompt's length in tokens
COMPLETION_TOKEN_IDS: Final = "agl.completion.token_ids"  # int[]: choice 0
COMPLETION_LOGPROBS: Final = "agl.completion.logprobs"  # double[]: choice 0, one per token
COMPLETION_CHOICES: Final = "agl.completion.choices"  # int: number of choices (n)
POLICY_VERSION: Final = "agl.policy.version"  # int: the weights that served the call
# int[]: only on a call generated across a drain-free policy switch (loop.switch: keep): run-length
# pairs over choice 0's completion tokens, [start, version, start, version, ...]: the tokens from
# each start up to the next start (or the end) were sampled by that policy version. Starts strictly
# increase from 0 and lie inside the completion; versions are int64 >= 0. Absent: every token of
# the call was sampled by agl.policy.version.
COMPLETION_POLICY_VERSIONS: Final = "agl.completion.policy_versions"
TOKENS_SOURCE: Final = "agl.tokens.source"  # "engine" | "absent"

TOKENS_FROM_ENGINE: Final = "engine"
TOKENS_ABSENT: Final = "absent"

API_CHAT_COMPLETIONS: Final = "openai.chat_completions"
API_COMPLETIONS: Final = "openai.completions"
API_RESPONSES: Final = "openai.responses"
API_ANTHROPIC_MESSAGES: Final = "anthropic.messages"

END_COMPLETED: Final = "completed"
END_CLIENT_DISCONNECTED: Final = "client_disconnected"
END_UPSTREAM_ERROR: Final = "upstream_error"
END_HELD_TIMEOUT: Final = "held_timeout"
# Ends whose response never reached the harness: assembly does not train such a call.
ENDS_UNDELIVERED: Final = (END_CLIENT_DISCONNECTED, END_UPSTREAM_ERROR, END_HELD_TIMEOUT)
# A span recovered from a killed sidecar's durable log whose last bytes it cannot say went out
# (CALL_DELIVERY = DELIVERY_UNKNOWN); the receiver stores its end as END_DELIVERY_UNKNOWN, which
# assembly trains only when a later call of the rollout builds on the answer.
CALL_DELIVERY: Final = "agl.call.delivery"
DELIVERY_UNKNOWN: Final = "unknown"
END_DELIVERY_UNKNOWN: Final = "delivery_unknown"

# Whether the call came from inside the harness's trace (see docs/spans.md). The rollout's trace is
# the trace of its first call that carried a W3C traceparent.
CALL_ORIGIN: Final = "agl.call.origin"  # see ORIGIN_*
ORIGIN_HARNESS: Final = "harness"  # in the rollout's trace (or the rollout has no trace to compare)
ORIGIN_UNTRACED: Final = "untraced"  # no traceparent while the rollout has a trace
ORIGIN_FOREIGN_TRACE: Final = "foreign_trace"  # a traceparent of another trace
ORIGINS: Final = (ORIGIN_HARNESS, ORIGIN_UNTRACED, ORIGIN_FOREIGN_TRACE)

# The structure a harness declares (docs/spans.md "Declared structure"): which agent made the call,
# the agent that spawned it, and a compaction (the harness rewrote its context: a new sample starts).
CALL_AGENT_ID: Final = "agl.call.agent_id"  # string
CALL_PARENT_AGENT_ID: Final = "agl.call.parent_agent_id"  # string
CALL_COMPACTION: Final = "agl.call.compaction"  # bool: present (true) only on a declared compaction
# string[]: edits the sidecar applied to this call's prompt (Anthropic's context_management types:
# "clear_thinking_20251015", "clear_tool_uses_20250919", "compact_20260112"); present only when one
# changed it. Assembly names a break after such a call a context edit, not a merge failure.
CALL_CONTEXT_EDITS: Final = "agl.call.context_edits"

# What a translating front (Anthropic Messages, Responses) did with the parts of the harness's request
# it does not interpret (docs/protocols.md "What the sidecar does not know"); present only when not
# empty. string[]: each "<JSON path>: <why>", e.g. "context_management: not an engine option".
REQUEST_FIELDS_DROPPED: Final = "agl.request.fields.dropped"  # not sent to the engine
REQUEST_FIELDS_PASSED: Final = "agl.request.fields.passed"  # sent to the engine as the harness wrote them


def completion_token_ids_key(choice: int) -> str:
    """Attribute holding choice `choice`'s completion token IDs (choice 0 has no index)."""
    return COMPLETION_TOKEN_IDS if choice == 0 else f"agl.completion.{choice}.token_ids"


def completion_logprobs_key(choice: int) -> str:
    """Attribute holding choice `choice`'s per-token logprobs (choice 0 has no index)."""
    return COMPLETION_LOGPROBS if choice == 0 else f"agl.completion.{choice}.logprobs"


def completion_finish_reason_key(choice: int) -> str:
    """Attribute holding the finish reason of choice `choice` > 0 (choice 0's is the first of
    gen_ai.response.finish_reasons)."""
    return f"agl.completion.{choice}.finish_reason"


# --- Reward spans (made by the SDK, the sidecar's reward endpoint, or a grader) ---------------
REWARD_VALUE: Final = "agl.reward.value"  # double
REWARD_NAME: Final = "agl.reward.name"  # str; the trainer trains on DEFAULT_REWARD_NAME by default
DEFAULT_REWARD_NAME: Final = "reward"

# --- OpenTelemetry GenAI evaluation results, read as rewards (docs/spans.md "Rewards") ----------
# The GenAI semconv's event gen_ai.evaluation.result, carrying agl.rollout.id, is a reward: as an
# OTLP log record (POST /v1/logs; the record's event_name, or its EVENT_NAME attribute) or as a span
# of that name (as instrumentations without log events emit it). Its name is gen_ai.evaluation.name,
# its value gen_ai.evaluation.score.value, else the label mapped by EVALUATION_LABELS.
SPAN_EVALUATION_RESULT: Final = "gen_ai.evaluation.result"
EVENT_NAME: Final = "event.name"  # a log record's attribute naming its event (before LogRecord.event_name)
EVALUATION_NAME: Final = "gen_ai.evaluation.name"  # str, required
EVALUATION_SCORE_VALUE: Final = "gen_ai.evaluation.score.value"  # double
EVALUATION_SCORE_LABEL: Final = "gen_ai.evaluation.score.label"  # str
EVALUATION_EXPLANATION: Final = "gen_ai.evaluation.explanation"  # str (not stored)
# A result with a label and no score: these labels (case-insensitive) are the rewards 1.0 and 0.0.
EVALUATION_LABELS: Final = {
    "pass": 1.0, "passed": 1.0, "correct": 1.0, "true": 1.0, "yes": 1.0,
    "fail": 0.0, "failed": 0.0, "incorrect": 0.0, "false": 0.0, "no": 0.0,
}  # fmt: skip

# --- Value ranges (docs/spans.md) -------------------------------------------------------------
INT64_MIN: Final = -(1 << 63)  # every int attribute is a signed 64-bit integer
INT64_MAX: Final = (1 << 63) - 1  # identity counters (attempt, call.seq, policy.version) are 0..INT64_MAX

# --- Propagation ------------------------------------------------------------------------------
HEADER_ROLLOUT_ID: Final = "x-agl-rollout-id"
HEADER_TASK_ID: Final = "x-agl-task-id"
HEADER_ATTEMPT: Final = "x-agl-attempt"
HEADER_MODE: Final = "x-agl-mode"
# Declared structure: agl's own pair wins over Claude Code's when both are present.
HEADER_AGENT_ID: Final = "x-agl-agent-id"
HEADER_PARENT_AGENT_ID: Final = "x-agl-parent-agent-id"
HEADER_CLAUDE_CODE_AGENT_ID: Final = "x-claude-code-agent-id"
HEADER_CLAUDE_CODE_PARENT_AGENT_ID: Final = "x-claude-code-parent-agent-id"
# Claude Code's session (every call of one `claude` run): its main thread, which sends no agent id,
# is the agent named by it, and a first-level sub-agent's parent (docs/spans.md "Declared structure").
HEADER_CLAUDE_CODE_SESSION_ID: Final = "x-claude-code-session-id"
HEADER_COMPACTION: Final = "x-agl-compaction"  # "1" or "true": this call follows a compaction
AGENT_ID_MAX_CHARS: Final = 256  # a longer declared agent id is refused (400)
ROLLOUT_ID_MAX_CHARS: Final = 256  # agl.rollout.id, agl.task.id: longer is refused (sidecar 400, receiver violation)
BAGGAGE_ROLLOUT_ID: Final = ROLLOUT_ID  # W3C baggage keys reuse the attribute names
BAGGAGE_TASK_ID: Final = TASK_ID
BAGGAGE_ATTEMPT: Final = ATTEMPT
BAGGAGE_MODE: Final = ROLLOUT_MODE
BAGGAGE_AGENT_ID: Final = CALL_AGENT_ID  # after x-agl-agent-id, before Claude Code's header
BAGGAGE_PARENT_AGENT_ID: Final = CALL_PARENT_AGENT_ID
ROLLOUT_PATH_PREFIX: Final = "/rollouts"  # /rollouts/{id}[/attempts/{n}]/v1/...
ATTEMPT_PATH_PREFIX: Final = "/attempts"  # after /rollouts/{id}
MODE_PATH_PREFIX: Final = "/modes"  # after /rollouts/{id}[/attempts/{n}]: /modes/val (absent: no mode)
REWARD_PATH: Final = "/reward"  # POST /rollouts/{id}[/attempts/{n}]/reward
END_PATH: Final = "/end"  # POST /rollouts/{id}[/attempts/{n}]/end


def rollout_path(rollout_id: str, attempt: int = 0, mode: str | None = None) -> str:
    """The path prefix that attributes a harness's calls: `/rollouts/{id}[/attempts/{n}][/modes/{mode}]/v1`.

    The id is percent-encoded whole (`/`, `?`, `#`, `%` and non-ASCII included) and the sidecar
    decodes the segment back, so an id reaches it as it was whoever built the URL. Attempt 0 and
    no mode leave their segments out."""
    path = f"{ROLLOUT_PATH_PREFIX}/{quote(rollout_id, safe='')}"
    if attempt:
        path += f"{ATTEMPT_PATH_PREFIX}/{attempt}"
    if mode is not None:
        path += f"{MODE_PATH_PREFIX}/{quote(mode, safe='')}"
    return path + "/v1"

# --- Sidecar admin API (the trainer's calls) -------------------------------------------------------
ADMIN_PAUSE_PATH: Final = "/agl/v1/pause"
ADMIN_RESUME_PATH: Final = "/agl/v1/resume"
ADMIN_STATE_PATH: Final = "/agl/v1/state"
ADMIN_FLUSH_PATH: Final = "/agl/v1/flush"  # deliver the spans of the calls finished so far, holding none

# --- Environment (set by runners, read by the SDK and harnesses) ------------------------------
ENV_ROLLOUT_ID: Final = "AGL_ROLLOUT_ID"
# The agl run the rollout belongs to (`agl train`'s run id; each `agl eval` its own): with AGL_ROLLOUT_ID
# unique on a machine, where agl eval's rollout ids repeat from run to run (eval-{task}-{attempt}, which
# seeds its sampling). Key anything a rollout keeps on disk by both.
ENV_RUN_ID: Final = "AGL_RUN_ID"
ENV_TASK_ID: Final = "AGL_TASK_ID"
ENV_ATTEMPT: Final = "AGL_ATTEMPT"
ENV_MODE: Final = "AGL_ROLLOUT_MODE"
ENV_TASK: Final = "AGL_TASK"  # the task as JSON
ENV_OTLP_ENDPOINT: Final = "AGL_OTLP_ENDPOINT"
ENV_OTLP_HEADERS: Final = "AGL_OTLP_HEADERS"
# OpenTelemetry's own names, read when agl's are unset (the traces endpoint is a full URL, used as is).
ENV_OTEL_TRACES_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_OTEL_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTEL_HEADERS: Final = "OTEL_EXPORTER_OTLP_HEADERS"
ENV_SERVICE_NAME: Final = "AGL_SERVICE_NAME"
ENV_EXIT_FLUSH_TIMEOUT: Final = "AGL_EXIT_FLUSH_TIMEOUT_S"
ENV_TRACEPARENT: Final = "TRACEPARENT"  # W3C trace context handed to a child process
ENV_ROLLOUT_LOG: Final = "AGL_ROLLOUT_LOG"  # a retried attempt: the log file of the attempt before it
# Secrets a process reads from its environment rather than its command line (visible in `ps`).
ENV_SIDECAR_ADMIN_TOKEN: Final = "AGL_SIDECAR_ADMIN_TOKEN"
ENV_RECEIVER_TOKEN: Final = "AGL_RECEIVER_TOKEN"
ENV_VIEWER_TOKEN: Final = "AGL_VIEWER_TOKEN"  # the trace viewer's token (agl traces serve, the train viewer)
ENV_SIDECAR_API_KEY: Final = "AGL_SIDECAR_API_KEY"  # the key harnesses must send (the sidecar's --api-key)
ENV_SIDECAR_OTLP_HEADERS: Final = "AGL_SIDECAR_OTLP_HEADERS"  # k=v,k=v the sidecar adds to its OTLP export
# What a harness's model client reads: the sidecar's URL with the rollout's prefix, and a key.
ENV_OPENAI_BASE_URL: Final = "OPENAI_BASE_URL"
ENV_OPENAI_API_KEY: Final = "OPENAI_API_KEY"
ENV_ANTHROPIC_BASE_URL: Final = "ANTHROPIC_BASE_URL"  # the same URL without /v1
ENV_ANTHROPIC_API_KEY: Final = "ANTHROPIC_API_KEY"
# The key a harness gets when the sidecar asks for none (clients that insist on one); the sidecar ignores it.
PLACEHOLDER_API_KEY: Final = "agl-placeholder-key"

# Scope name of every tracer agl creates.
INSTRUMENTATION_SCOPE: Final = "agl"
