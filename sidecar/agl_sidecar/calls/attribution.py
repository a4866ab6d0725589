"""Which rollout a call belongs to, which trace its span joins, and whether it came from inside
the harness's trace.

First match wins: the URL prefix `/rollouts/{id}[/attempts/{n}]`, the `x-agl-rollout-id` header, the
W3C baggage entry `agl.rollout.id`, then an API key mapped to a rollout in the config.

A rollout's trace is the trace of its first call that carried a W3C `traceparent` (a traced harness
sends one on every call; the agl SDK joins the TRACEPARENT a runner hands down). A later call of the
rollout without one, or with another trace's, came from outside the harness's trace: a process the
agent spawned, which inherited OPENAI_BASE_URL (`agl.call.origin`, docs/spans.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

from agl import semconv
from agl_sidecar import inputs


@dataclass(slots=True)
class Identity:
    rollout_id: str | None = None
    task_id: str | None = None
    attempt: int | None = None
    mode: str | None = None
    # Declared structure (docs/spans.md): the agent that made the call and its parent agent.
    agent_id: str | None = None
    parent_agent_id: str | None = None
    compaction: bool = False


@dataclass(slots=True)
class TraceParent:
    trace_id: bytes
    span_id: bytes


def parse_baggage(header: str) -> dict[str, str]:
    """W3C baggage `k=v;props,k2=v2` as a dict (values percent-decoded, properties dropped)."""
    entries: dict[str, str] = {}
    for item in header.split(","):
        key, sep, rest = item.partition("=")
        if not sep:
            continue
        entries[key.strip()] = unquote(rest.split(";", 1)[0].strip())
    return entries


def parse_traceparent(header: str | None) -> TraceParent | None:
    """`00-<32 hex trace id>-<16 hex span id>-<flags>`; None when absent or malformed."""
    if not header:
        return None
    parts = header.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id = bytes.fromhex(parts[1]), bytes.fromhex(parts[2])
    except ValueError:
        return None
    if trace_id == bytes(16) or span_id == bytes(8):
        return None
    return TraceParent(trace_id, span_id)


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The API key a client sent: `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic)."""
    auth = headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("x-api-key")


def resolve(
    headers: Mapping[str, str],
    path_rollout_id: str | None,
    path_attempt: str | None,
    api_key_rollouts: Mapping[str, str],
) -> Identity:
    """The call's rollout identity from the first source that names a rollout; task, attempt and
    mode are filled from headers and baggage whichever source named the rollout. An id or attempt
    that a span cannot carry raises inputs.BadInput naming its source (the harness gets a 400
    before anything is forwarded: a call is never answered while its span cannot be recorded)."""
    baggage_header = headers.get("baggage")
    baggage = parse_baggage(baggage_header) if baggage_header else {}
    identity = Identity()
    if path_rollout_id:
        identity.rollout_id = _id(path_rollout_id, "rollout id in the URL path")
        identity.attempt = inputs.count(path_attempt, "attempt in the URL path")
    elif headers.get(semconv.HEADER_ROLLOUT_ID):
        identity.rollout_id = _id(headers[semconv.HEADER_ROLLOUT_ID], semconv.HEADER_ROLLOUT_ID)
    elif baggage.get(semconv.BAGGAGE_ROLLOUT_ID):
        identity.rollout_id = _id(baggage[semconv.BAGGAGE_ROLLOUT_ID], "baggage " + semconv.BAGGAGE_ROLLOUT_ID)
    if api_key_rollouts:  # a per-rollout key attributes a call, and acts for its own rollout only
        key = bearer_token(headers)
        own = api_key_rollouts.get(key) if key is not None else None
        if own is not None and identity.rollout_id is None:
            identity.rollout_id = own
        elif own is not None and identity.rollout_id != own:
            raise inputs.NotYours(
                f"the API key sent is rollout {inputs.shown_text(own)}'s (rollout_api_keys) and acts for that "
                f"rollout only, not for rollout {inputs.shown_text(identity.rollout_id)}; use that rollout's "
                "URL or the sidecar's --api-key", "authorization",
            )
    task_id = headers.get(semconv.HEADER_TASK_ID)
    if task_id:
        identity.task_id = _id(task_id, semconv.HEADER_TASK_ID)
    elif baggage.get(semconv.BAGGAGE_TASK_ID):
        identity.task_id = _id(baggage[semconv.BAGGAGE_TASK_ID], "baggage " + semconv.BAGGAGE_TASK_ID)
    if identity.attempt is None:
        attempt = headers.get(semconv.HEADER_ATTEMPT)
        if attempt:
            identity.attempt = inputs.count(attempt, semconv.HEADER_ATTEMPT)
        elif baggage.get(semconv.BAGGAGE_ATTEMPT):
            identity.attempt = inputs.count(baggage[semconv.BAGGAGE_ATTEMPT], "baggage " + semconv.BAGGAGE_ATTEMPT)
    # A mode the sidecar does not know is refused as in the URL path (ignoring it would sample a
    # validation rollout with the training overrides, or the other way round).
    if headers.get(semconv.HEADER_MODE):
        identity.mode = _mode(headers[semconv.HEADER_MODE], semconv.HEADER_MODE)
    elif baggage.get(semconv.BAGGAGE_MODE):
        identity.mode = _mode(baggage[semconv.BAGGAGE_MODE], "baggage " + semconv.BAGGAGE_MODE)
    # Declared structure: a dict lookup per header when absent (the hot path of every call).
    get = headers.get
    agent, agent_cc, parent, parent_cc = get(_AGENT), get(_AGENT_CC), get(_PARENT), get(_PARENT_CC)
    agent_bag = baggage.get(semconv.BAGGAGE_AGENT_ID) if baggage else None
    parent_bag = baggage.get(semconv.BAGGAGE_PARENT_AGENT_ID) if baggage else None
    # Claude Code's main thread sends no agent id, only its session's: the main agent is the session,
    # and the session is the parent of a sub-agent that names no parent (one the main thread started).
    session = get(_SESSION_CC)
    if agent or agent_cc or agent_bag or session:
        identity.agent_id = _agent(
            (agent, semconv.HEADER_AGENT_ID),
            (agent_bag, "baggage " + semconv.BAGGAGE_AGENT_ID),
            (agent_cc, semconv.HEADER_CLAUDE_CODE_AGENT_ID),
            (session, semconv.HEADER_CLAUDE_CODE_SESSION_ID),
        )
    if parent or parent_cc or parent_bag or (agent_cc and session):
        identity.parent_agent_id = _agent(
            (parent, semconv.HEADER_PARENT_AGENT_ID),
            (parent_bag, "baggage " + semconv.BAGGAGE_PARENT_AGENT_ID),
            (parent_cc, semconv.HEADER_CLAUDE_CODE_PARENT_AGENT_ID),
            (session if agent_cc else None, semconv.HEADER_CLAUDE_CODE_SESSION_ID),
        )
    compaction = get(_COMPACTION)
    if compaction:
        identity.compaction = _flag(compaction, semconv.HEADER_COMPACTION)
    return identity


_AGENT, _AGENT_CC = semconv.HEADER_AGENT_ID, semconv.HEADER_CLAUDE_CODE_AGENT_ID
_PARENT, _PARENT_CC = semconv.HEADER_PARENT_AGENT_ID, semconv.HEADER_CLAUDE_CODE_PARENT_AGENT_ID
_SESSION_CC = semconv.HEADER_CLAUDE_CODE_SESSION_ID
_COMPACTION = semconv.HEADER_COMPACTION


def _id(value: str, param: str) -> str:
    """A rollout or task id: printable text of at most ROLLOUT_ID_MAX_CHARS characters (every span
    of the rollout carries it, and every row the trainer stores for it)."""
    return inputs.short_text(value, param, semconv.ROLLOUT_ID_MAX_CHARS)


def _agent(*given: tuple[str | None, str]) -> str | None:
    """A declared agent id from (value, where it came from) in precedence order: agl's header, the
    W3C baggage entry, Claude Code's header, Claude Code's session. The first given wins, but every given one is validated
    where it came from (a hostile value in any is refused)."""
    found: str | None = None
    for value, param in given:
        if value:
            value = inputs.short_text(value, param, semconv.AGENT_ID_MAX_CHARS)
            found = found or value
    return found


def _flag(value: str, param: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true"):
        return True
    if lowered in ("0", "false"):
        return False
    raise inputs.BadInput(f"{param} must be 1, true, 0 or false, got {inputs.shown_text(value)}", param)


def _mode(value: str, param: str) -> str:
    if value not in semconv.MODES:
        raise inputs.BadInput(f"{param} {inputs.shown_text(value)} is not one of {list(semconv.MODES)}", param)
    return value


class RolloutTraces:
    """Per rollout attempt, the trace its harness runs in (bounded LRU), and each call's origin."""

    def __init__(self, max_rollouts: int = 200_000) -> None:
        self.max_rollouts = max_rollouts
        self._traces: OrderedDict[tuple[str, int], bytes] = OrderedDict()

    def origin(self, identity: Identity, parent: TraceParent | None) -> str | None:
        """semconv.ORIGIN_* for a call of `identity`'s rollout (None: the call names no rollout).
        The first traced call of a rollout sets its trace; calls before it count as the harness's."""
        if identity.rollout_id is None:
            return None
        key = (identity.rollout_id, identity.attempt or 0)
        known = self._traces.get(key)
        if known is not None:
            self._traces.move_to_end(key)
        if parent is None:
            return semconv.ORIGIN_HARNESS if known is None else semconv.ORIGIN_UNTRACED
        if known is None:
            self._traces[key] = parent.trace_id
            if len(self._traces) > self.max_rollouts:
                self._traces.popitem(last=False)
            return semconv.ORIGIN_HARNESS
        return semconv.ORIGIN_HARNESS if known == parent.trace_id else semconv.ORIGIN_FOREIGN_TRACE

    def forget(self, identity: Identity) -> None:
        if identity.rollout_id is not None:
            self._traces.pop((identity.rollout_id, identity.attempt or 0), None)
