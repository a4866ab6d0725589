"""Spans the sidecar makes: one per model call, plus reward and rollout-end spans.

`CallRecord` collects what one call observed; `SpanRecorder.finish` turns it into an encoded OTLP
span (attribute names from agl.semconv only) for the exporter. The hot path keeps the engine's token
arrays as their JSON bytes (msgspec `Raw`). A span whose arrays fit in one slice (a few thousand
token IDs) is built as its call ends, after its response went out: tens of microseconds, less than
handing it to a task costs. Bigger ones are queued, and a background task decodes and encodes them
(token_arrays.py) in slices while no call is active (foreground.py: while calls wait on the engine,
or once the last call has settled), so the time a span costs is spent while the proxy waits on the
engine, not before the next call. Jobs run in order (a rollout's spans leave in the order its calls
and rewards ended): a small span is built at once only when nothing is queued before it.

It also numbers the calls of each rollout (agl.call.seq: increasing in arrival order, unique without
shared state so a restarted sidecar or a second one serving the rollout numbers on; see
call_seq.py) and sends a
prompt that extends the rollout's previous call (prompt + choice-0 completion) as a reference plus
the new suffix, so the bytes exported grow with a rollout's tokens rather than with their square.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec

from agl import semconv
from agl_sidecar.spans import otlp
from agl_sidecar.calls import wire
from agl_sidecar.calls.attribution import Identity, RolloutTraces, TraceParent
from agl_sidecar.calls.record import CallRecord, Choice
from agl_sidecar.calls.switches import version_runs
from agl_sidecar.spans.call_seq import CallSeqs
from agl_sidecar.spans.exporter import SpanExporter
from agl_sidecar.spans.foreground import Foreground
from agl_sidecar.spans.lru import BytesLRU
from agl_sidecar.spans.token_arrays import SLICE_JSON_BYTES, SliceCache, encode_token_ids

log = logging.getLogger("agl_sidecar.spans")

# Short prompts are cheaper to send whole than to reference.
MIN_REFERENCE_TOKENS = 16
# How long the builder defers to active calls before it takes a slice anyway.
MAX_DEFER_S = 0.02


def _sequence_size(rollout_id: str, item: tuple[int, otlp.IntArray]) -> int:
    return len(item[1].elements)


class _Rollouts:
    """Per rollout: the last call seq and when its first call arrived (bounded LRU: a rollout that
    falls out numbers on from the clock, call_seq.py)."""

    def __init__(self, max_rollouts: int = 200_000, seqs: CallSeqs | None = None) -> None:
        self.max_rollouts = max_rollouts
        self.seqs = seqs or CallSeqs()
        self._items: OrderedDict[str, list[int]] = OrderedDict()

    def next_seq(self, rollout_id: str) -> int:
        now = time.time_ns()
        item = self._items.get(rollout_id)
        if item is None:
            item = self._items[rollout_id] = [-1, now]
            if len(self._items) > self.max_rollouts:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(rollout_id)
        seq = item[0] = self.seqs.next(item[0], now)
        return seq

    def first_seen_ns(self, rollout_id: str) -> int | None:
        item = self._items.get(rollout_id)
        return item[1] if item is not None else None

    def forget(self, rollout_id: str) -> None:
        self._items.pop(rollout_id, None)


# IDs need uniqueness, not secrecy (the OTel SDK also uses random.getrandbits); os.urandom is a
# syscall per ID.
_random = random.Random(int.from_bytes(os.urandom(16)))


def new_trace_id() -> bytes:
    return (_random.getrandbits(128) or 1).to_bytes(16)  # all-zero IDs are invalid


def new_span_id() -> bytes:
    return (_random.getrandbits(64) or 1).to_bytes(8)


class SpanRecorder:
    def __init__(
        self,
        exporter: SpanExporter,
        prompt_ref_max_bytes: int = 256 * 1024 * 1024,
        max_backlog: int = 128,
        foreground: Foreground | None = None,
        max_defer_s: float = MAX_DEFER_S,
        token_cache_bytes: int = 64 * 1024 * 1024,
        durable: bool = False,
    ) -> None:
        self.exporter = exporter
        # Durable mode: spans are built on the call's path, and logged before its last byte goes out.
        self.durable = durable
        self.foreground = foreground or Foreground()
        self.max_defer_s = max_defer_s
        self.rollouts = _Rollouts()
        self.traces = RolloutTraces()  # each rollout's harness trace: a call's agl.call.origin
        # Per rollout, the last finished call's seq and full token sequence (prompt + choice-0
        # completion, as encoded int-array elements): ~200 KB for 35k tokens, so bounded by bytes.
        self._last: BytesLRU[str, tuple[int, otlp.IntArray]] = BytesLRU(prompt_ref_max_bytes, _sequence_size)
        self._static: dict[tuple[Any, ...], bytes] = {}
        self.slices = SliceCache(token_cache_bytes)
        self.calls_recorded = 0
        self.build_failures = 0
        # Past this many queued jobs the builder stops deferring to active calls, and past four times
        # as many it stops yielding: the queue (it holds response bodies) stays bounded when calls
        # end faster than their spans are built.
        self.max_backlog = max_backlog
        self._backlog: deque[Iterator[None]] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._current: Iterator[None] | None = None  # the job being built

    @property
    def backlog(self) -> int:
        """Spans queued or being built (the job the builder holds is pending until handed on)."""
        return len(self._backlog) + (self._current is not None)

    # --- the builder task ----------------------------------------------------------------------
    def start(self) -> None:
        """Build spans in a background task of the running loop (until then they are built at once)."""
        if self._task is None and not self.durable:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="agl-span-builder")

    async def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued span is built and handed to the exporter."""
        if self._task is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self, timeout_s: float = 10.0) -> None:
        """Build what is queued, then stop the task; what is left is built here, synchronously."""
        if self._task is None:
            return
        await self.drain(timeout_s)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        if self._current is not None:  # cancelled between two of its slices: finish it
            self._run_job(self._current)
            self._current = None
        while self._backlog:
            self._run_job(self._backlog.popleft())

    def _defer(self, job: Iterator[None]) -> None:
        if self._task is None:
            self._run_job(job)
            return
        self._backlog.append(job)
        self._idle.clear()
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._backlog:
                job = self._current = self._backlog.popleft()
                try:
                    await self._turn()
                    for _ in job:
                        await self._turn()
                except Exception:
                    self._job_failed()
                self._current = None
            self._idle.set()

    async def _turn(self) -> None:
        """Before a slice: let the loop read new I/O, and let active calls finish their steps first."""
        deadline = 0.0
        while True:
            behind = len(self._backlog)
            if behind >= 4 * self.max_backlog:
                return
            # Two yields: I/O that arrived during the last slice is read in the first, and the handler
            # it wakes takes its first step (and becomes active) before the second returns.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            if behind >= self.max_backlog or self.foreground.quiet_now():
                return
            now = time.monotonic()
            deadline = deadline or now + self.max_defer_s
            if now >= deadline:
                return
            await self.foreground.quiet(deadline - now)

    def _run_job(self, job: Iterator[None]) -> None:
        try:
            for _ in job:
                pass
        except Exception:
            self._job_failed()

    def _job_failed(self) -> None:
        # A recording bug costs one span, counted and logged, never the recorder.
        self.build_failures += 1
        self.exporter.counters.spans_failed += 1
        log.exception("agl-sidecar: building a span failed; the span is lost")

    def next_seq(self, identity: Identity) -> int | None:
        return self.rollouts.next_seq(identity.rollout_id) if identity.rollout_id else None

    # --- model calls ---------------------------------------------------------------------------
    def finish(self, call: CallRecord) -> None:
        """The call ended: queue its span (cheap; built by the background task)."""
        if call.finished:
            return
        call.finished = True
        call.end_ns = time.time_ns()
        call.origin = self.traces.origin(call.identity, call.trace_parent)
        job = self._build_call(call)
        if self._current is None and not self._backlog and _fits_one_slice(call):
            self._run_job(job)  # one slice: queueing it costs more loop turns than the slice itself
        else:
            self._defer(job)

    def persister(self, call: CallRecord) -> Callable[[], Awaitable[None]] | None:
        """Durable mode: what the response awaits before its final bytes (the call's span built and
        on disk); None otherwise."""
        if not self.durable:
            return None

        async def persist() -> None:
            self.finish(call)
            await self.exporter.sync_durable()

        return persist

    def _build_call(self, call: CallRecord) -> Iterator[None]:
        identity = call.identity
        prompt: otlp.IntArray | None = None
        completions: list[tuple[int, Choice, otlp.IntArray]] = []
        if any(index != i for i, index in enumerate(sorted(call.choices))):
            call.tokens_absent = True  # the engine's choice indices are not 0..n-1 (-1, 10**12): no completion 0
        if call.prompt_ids is not None and not call.tokens_absent:
            logprobs_of = wire.chat_logprobs if call.operation == semconv.OPERATION_CHAT else wire.legacy_logprobs
            try:
                prompt = yield from encode_token_ids(call.prompt_ids, self.slices, prompt=True)
                for index in sorted(call.choices):
                    choice = call.choices[index]
                    ids = yield from encode_token_ids(choice.token_ids, self.slices)
                    if ids is None:
                        call.tokens_absent = True
                        break
                    if not isinstance(choice.logprobs, list):  # decoded here: an engine's bad value
                        choice.logprobs = logprobs_of(choice.logprobs) or []  # costs the tokens, not the span
                    completions.append((index, choice, ids))
            except (msgspec.MsgspecError, otlp.OutOfRange):  # not an int array, or IDs beyond int64
                call.tokens_absent = True
        has_tokens = prompt is not None and not call.tokens_absent
        # Attributes that repeat across calls are encoded once per distinct combination.
        static_key = (
            call.operation, call.provider, call.model, call.stream, call.api, call.end_reason, call.upstream,
            call.response_model, has_tokens, identity.mode,
        )
        static = self._static.get(static_key)
        if static is None:
            static = otlp.attributes(9, static_attributes(call, has_tokens))
            if len(self._static) < 1024:
                self._static[static_key] = static
        entry_version, runs = call.policy_version, None
        if has_tokens and completions and completions[0][0] == 0:
            runs = version_runs(
                call.switches, entry_version, call.response_id, call.switch_marks, completions[0][2].length
            )
            if runs is not None and runs[1] != entry_version:
                # The first switch came before the call's first token: every token is a later version's,
                # as if the call had entered under it (the span's version is its first token's).
                entry_version, runs = runs[1], runs if len(runs) > 2 else None
        attrs = call_attributes(call, entry_version)
        indices = sorted(call.choices)
        if indices:
            finish = [call.choices[i].finish_reason or "" for i in indices]
            attrs.append((semconv.GEN_AI_RESPONSE_FINISH_REASONS, finish))
            attrs.append((semconv.COMPLETION_CHOICES, len(indices)))
        input_tokens = call.input_tokens
        if input_tokens is None and prompt is not None:
            input_tokens = prompt.length
        output_tokens = call.output_tokens
        if output_tokens is None and has_tokens:
            output_tokens = sum(ids.length for _, _, ids in completions)
        attrs.append((semconv.GEN_AI_USAGE_INPUT_TOKENS, input_tokens))
        attrs.append((semconv.GEN_AI_USAGE_OUTPUT_TOKENS, output_tokens))
        if has_tokens:
            assert prompt is not None
            attrs.extend(self._token_attributes(call, prompt, completions, runs))
        status = otlp.STATUS_ERROR if call.error_type else otlp.STATUS_UNSET
        parent = call.trace_parent
        span = otlp.span(
            trace_id=parent.trace_id if parent else new_trace_id(),
            span_id=new_span_id(),
            parent_span_id=parent.span_id if parent else None,
            name=semconv.call_span_name(call.operation, call.model),
            kind=otlp.SPAN_KIND_CLIENT,
            start_ns=call.start_ns,
            end_ns=call.end_ns,
            attrs=attrs,
            encoded_attrs=static,
            status_code=status,
            status_message=call.error_message,
        )
        self.calls_recorded += 1
        self.exporter.submit(span)

    def _token_attributes(
        self,
        call: CallRecord,
        prompt: otlp.IntArray,
        completions: list[tuple[int, Choice, otlp.IntArray]],
        runs: list[int] | None,
    ) -> list[tuple[str, Any]]:
        attrs: list[tuple[str, Any]] = [(semconv.PROMPT_LENGTH, prompt.length)]
        rollout_id = call.identity.rollout_id
        previous = self._last.get(rollout_id) if rollout_id else None
        if (
            previous is not None
            and previous[1].length >= MIN_REFERENCE_TOKENS
            and prompt.length >= previous[1].length
            and prompt.elements.startswith(previous[1].elements)
        ):
            ref_seq, ref = previous
            suffix = otlp.IntArray(prompt.elements[len(ref.elements) :], prompt.length - ref.length)
            attrs += [
                (semconv.PROMPT_REF_CALL_SEQ, ref_seq),
                (semconv.PROMPT_REF_LENGTH, ref.length),
                (semconv.PROMPT_TOKEN_IDS, suffix),
            ]
        else:
            attrs.append((semconv.PROMPT_TOKEN_IDS, prompt))
        logprobs_of = wire.chat_logprobs if call.operation == semconv.OPERATION_CHAT else wire.legacy_logprobs
        first: otlp.IntArray | None = None
        for index, choice, ids in completions:
            if index == 0:
                first = ids
            attrs.append((semconv.completion_token_ids_key(index), ids))
            logprobs = choice.logprobs if isinstance(choice.logprobs, list) else logprobs_of(choice.logprobs)
            if logprobs and len(logprobs) == ids.length:  # else the receiver refuses the whole span
                attrs.append((semconv.completion_logprobs_key(index), otlp.DoubleArray(logprobs)))
            if index > 0:
                attrs.append((semconv.completion_finish_reason_key(index), choice.finish_reason or ""))
        if runs is not None:
            attrs.append((semconv.COMPLETION_POLICY_VERSIONS, otlp.IntArray.of(runs)))
        if rollout_id and call.seq is not None and first is not None:
            self._last.put(rollout_id, (call.seq, prompt + first))
        return attrs

    # --- rewards and rollout ends --------------------------------------------------------------
    def reward(
        self,
        identity: Identity,
        value: float,
        name: str,
        call_seq: int | None,
        parent: TraceParent | None,
        extra: dict[str, Any],
    ) -> None:
        now = time.time_ns()
        attrs: list[tuple[str, Any]] = list(extra.items())
        attrs += [
            (semconv.ROLLOUT_ID, identity.rollout_id),
            (semconv.TASK_ID, identity.task_id),
            (semconv.ATTEMPT, identity.attempt),
            (semconv.REWARD_NAME, name),
            (semconv.REWARD_VALUE, float(value)),
            (semconv.CALL_SEQ, call_seq),
        ]
        self._internal_span(semconv.SPAN_REWARD, now, now, attrs, parent)

    def rollout_end(self, identity: Identity, status: str, parent: TraceParent | None) -> None:
        now = time.time_ns()
        assert identity.rollout_id is not None
        start = self.rollouts.first_seen_ns(identity.rollout_id) or now
        attrs: list[tuple[str, Any]] = [
            (semconv.ROLLOUT_ID, identity.rollout_id),
            (semconv.TASK_ID, identity.task_id),
            (semconv.ATTEMPT, identity.attempt if identity.attempt is not None else 0),
            (semconv.ROLLOUT_MODE, identity.mode or semconv.MODE_TRAIN),
            (semconv.ROLLOUT_STATUS, status),
        ]
        code = otlp.STATUS_ERROR if status == semconv.STATUS_FAILED else otlp.STATUS_UNSET
        rollout_id = identity.rollout_id
        # After the rollout's queued calls: an ended rollout makes no more calls to reference.
        forget = functools.partial(self._last.pop, rollout_id)
        self.traces.forget(identity)
        self._internal_span(semconv.SPAN_ROLLOUT, start, now, attrs, parent, code, forget)

    def _internal_span(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attrs: list[tuple[str, Any]],
        parent: TraceParent | None,
        status_code: int = otlp.STATUS_UNSET,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Encode now (small); submit behind the calls already queued, so a rollout's spans keep order."""
        span = otlp.span(
            trace_id=parent.trace_id if parent else new_trace_id(),
            span_id=new_span_id(),
            parent_span_id=parent.span_id if parent else None,
            name=name,
            kind=otlp.SPAN_KIND_INTERNAL,
            start_ns=start_ns,
            end_ns=end_ns,
            attrs=attrs,
            status_code=status_code,
        )
        self._defer(self._submit(span, then))

    def _submit(self, span: bytes, then: Callable[[], None] | None) -> Iterator[None]:
        self.exporter.submit(span)
        if then is not None:
            then()
        yield from ()


def static_attributes(call: CallRecord, has_tokens: bool) -> list[tuple[str, Any]]:
    """A call span's attributes that repeat across calls (the recorder encodes each combination once)."""
    identity = call.identity
    return [
        (semconv.GEN_AI_OPERATION_NAME, call.operation),
        (semconv.GEN_AI_PROVIDER_NAME, call.provider),
        (semconv.GEN_AI_REQUEST_MODEL, call.model),
        (semconv.GEN_AI_REQUEST_STREAM, call.stream),
        (semconv.GEN_AI_RESPONSE_MODEL, call.response_model),
        (semconv.ROLLOUT_MODE, identity.mode),
        (semconv.CALL_API, call.api),
        (semconv.CALL_END_REASON, call.end_reason),
        (semconv.CALL_UPSTREAM, call.upstream),
        (semconv.TOKENS_SOURCE, semconv.TOKENS_FROM_ENGINE if has_tokens else semconv.TOKENS_ABSENT),
    ]


def call_attributes(call: CallRecord, policy_version: int | None) -> list[tuple[str, Any]]:
    """A call span's own attributes before its choices and tokens (`policy_version`: its first token's)."""
    identity = call.identity
    return [
        (semconv.GEN_AI_REQUEST_TEMPERATURE, _float(call.temperature)),
        (semconv.GEN_AI_REQUEST_TOP_P, _float(call.top_p)),
        (semconv.GEN_AI_REQUEST_MAX_TOKENS, call.max_tokens),
        (semconv.GEN_AI_REQUEST_CHOICE_COUNT, call.n),
        (semconv.GEN_AI_RESPONSE_ID, call.response_id),
        (semconv.ROLLOUT_ID, identity.rollout_id),
        (semconv.TASK_ID, identity.task_id),
        (semconv.ATTEMPT, identity.attempt),
        (semconv.CALL_SEQ, call.seq),
        (semconv.CALL_HELD_MS, float(call.held_ms)),
        (semconv.CALL_ORIGIN, call.origin),
        (semconv.CALL_AGENT_ID, identity.agent_id),
        (semconv.CALL_PARENT_AGENT_ID, identity.parent_agent_id),
        (semconv.CALL_COMPACTION, True if identity.compaction else None),
        (semconv.POLICY_VERSION, policy_version),
        (semconv.ERROR_TYPE, call.error_type),
        (semconv.GEN_AI_INPUT_MESSAGES, call.input_messages),
        (semconv.GEN_AI_OUTPUT_MESSAGES, call.output_messages),
        (semconv.REQUEST_FIELDS_DROPPED, list(call.fields_dropped) if call.fields_dropped else None),
        (semconv.REQUEST_FIELDS_PASSED, list(call.fields_passed) if call.fields_passed else None),
        (semconv.CALL_CONTEXT_EDITS, list(call.context_edits) if call.context_edits else None),
    ]


def _json_bytes(value: list[int] | list[float] | msgspec.Raw | None) -> int:
    """About the JSON size of a token or logprob array (a decoded list: about 6 bytes an element)."""
    if value is None:
        return 0
    return 6 * len(value) if isinstance(value, list) else len(value)


def _fits_one_slice(call: CallRecord) -> bool:
    """The call's arrays are at most one builder slice of JSON (token_arrays.SLICE_JSON_BYTES)."""
    size = _json_bytes(call.prompt_ids)
    for choice in call.choices.values():
        size += _json_bytes(choice.token_ids) + _json_bytes(choice.logprobs)
        if size > SLICE_JSON_BYTES:
            return False
    return size <= SLICE_JSON_BYTES


def _float(value: float | None) -> float | None:
    return float(value) if value is not None else None
