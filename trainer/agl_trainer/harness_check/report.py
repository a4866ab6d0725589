"""The report of a check: each request the harness made (the tap's exchanges) with the call agl
recorded for it (the stored span), what assembly makes of the calls, and the verdict.

Exchanges and spans are matched by API and time: a call's span starts after the sidecar read the
request the tap forwarded, so each span goes to the latest exchange of its API that began before
it (a WebSocket carries several). Calls of one API made at the same instant can swap rows; nothing
else can. The verdict holds when the harness exited 0 after at least one model call, every request
was answered below 400, and every model call was recorded with the engine's token IDs and
delivered; merge breaks are reported (classified as `agl traces inspect` does), not failed on.
"""

from __future__ import annotations

import msgspec
import numpy as np
from agl import semconv

from agl_trainer.assembly import AssemblyConfig, assemble_rollout
from agl_trainer.assembly.assemble import START_REASONS, CallPlacement, RolloutAssembly, full_sequences
from agl_trainer.harness_check import features
from agl_trainer.harness_check.chatml import TOKENIZER
from agl_trainer.harness_check.tap import Exchange
from agl_trainer.store.records import CallRow, RolloutData

SCHEMA = 1  # of the JSON report (`--json`); bumped when a field changes meaning
ANSWER_CHARS = 80
BREAK_CONTEXT = 40  # tokens (bytes) shown before and after where a merge breaks


class Recorded(msgspec.Struct):
    """What the call's span holds."""

    call_seq: int
    token_ids: bool  # the prompt's and the completion's, from the engine
    logprobs: bool
    tokens_source: str | None
    policy_version: int | None
    agent_id: str | None
    parent_agent_id: str | None
    compaction: bool
    origin: str | None
    finish_reason: str | None
    end_reason: str | None


class Call(msgspec.Struct):
    """One row: a request and, for a model call, what was recorded of it."""

    number: int  # 1, 2, ... in the order of the harness's requests
    method: str | None  # None (and path, status): a span whose request the tap did not see
    path: str | None  # as the harness asked, without the rollout prefix
    status: int | None  # the HTTP status the harness got (101: a WebSocket, 0: no answer)
    api: str | None
    model: str | None
    stream: bool
    prompt_tokens: int | None
    completion_tokens: int | None
    recorded: Recorded | None  # None: no span (a refused request, or not a model call)
    fields_dropped: list[str]
    fields_passed: list[str]
    refused: str | None  # the body of an answer >= 400, or why none came
    answer: str | None  # the completion's text (cut)
    sample: int | None
    placement: str | None  # what assembly made of the call
    problems: list[str]  # why this row fails the check


class Break(msgspec.Struct):
    """A call that extends no earlier call: assembly's classification, and the text around it."""

    call: int
    previous_call: int
    kind: str  # template | retokenization | other
    classified_by: str
    position: int
    detail: str
    expected: str  # the previous call's sequence from just before the break
    got: str  # this call's prompt from there


class HarnessRun(msgspec.Struct):
    command: list[str]
    exit_code: int | None
    outcome: str  # the store's Cause: ok, harness_error, timeout, infra_error
    message: str
    seconds: float
    log_tail: str


class Report(msgspec.Struct):
    schema: int
    name: str  # the harness, as the compatibility table names it
    version: str | None  # the harness's version, as the user gave it (--harness-version)
    rollout_id: str
    harness: HarnessRun
    calls: list[Call]
    samples: int
    breaks: list[Break]
    features: list[str]
    reward: float | None  # the rollout's reward, when the harness gave one
    problems: list[str]  # the run's own (not one call's)
    ok: bool
    verdict: str


def build(
    name: str,
    version: str | None,
    rollout_id: str,
    harness: HarnessRun,
    exchanges: list[Exchange],
    data: RolloutData | None,
    starts: list[int],
    violations: dict[str, int],
    undelivered: int,
    drain_problem: str | None = None,
) -> Report:
    """The report; `starts` holds each of `data.calls`' start time (ns), `violations` the receiver's
    refused spans by reason, `undelivered` the spans the sidecar could not deliver at the end,
    `drain_problem` why the sidecar did not drain its calls (when it did not answer)."""
    calls = data.calls if data is not None else []
    assembly = assemble_rollout(data, AssemblyConfig(missing_reward=0.0), TOKENIZER) if data is not None else None
    placements = {p.call_seq: p for p in assembly.placements} if assembly is not None else {}
    owner = _match(exchanges, calls, starts)
    keyed: list[tuple[tuple[int, int], Exchange | None, CallRow | None]] = []
    spanned: set[int] = set()
    for index, call in enumerate(calls):
        exchange = owner.get(index)
        keyed.append(((exchange.start_ns if exchange else starts[index], starts[index]), exchange, call))
        if exchange is not None:
            spanned.add(id(exchange))
    keyed += [((e.start_ns, 0), e, None) for e in exchanges if id(e) not in spanned]
    keyed.sort(key=lambda item: item[0])
    numbers = {c.call_seq: n for n, (_, _, c) in enumerate(keyed, 1) if c is not None}
    rows = [_row(n, exchange, call, placements, numbers) for n, (_, exchange, call) in enumerate(keyed, 1)]
    found: set[str] = set()
    for exchange in exchanges:
        found.update(exchange.features)
    if any(call.parent_agent_id for call in calls):
        found.add(features.SUB_AGENTS)
    if any(call.compaction for call in calls):
        found.add(features.COMPACTION)
    breaks = _breaks(calls, assembly, numbers)
    problems = _run_problems(harness, exchanges, calls, violations, undelivered)
    if drain_problem:
        problems.append(drain_problem)
    samples = 0 if assembly is None or assembly.result is None else len(assembly.result.samples)
    ok = not problems and not any(row.problems for row in rows)
    reward = data.final_reward(semconv.DEFAULT_REWARD_NAME) if data is not None else None
    return Report(
        schema=SCHEMA, name=name, version=version, rollout_id=rollout_id, harness=harness, calls=rows, samples=samples, breaks=breaks,
        features=features.ordered(found), reward=reward, problems=problems, ok=ok,
        verdict=_verdict(ok, rows, problems, samples, breaks),
    )  # fmt: skip


def _match(exchanges: list[Exchange], calls: list[CallRow], starts: list[int]) -> dict[int, Exchange]:
    """Each call (by index) to the latest exchange of its API that began before its span did."""
    owner: dict[int, Exchange] = {}
    taken: set[int] = set()
    for index in sorted(range(len(calls)), key=lambda i: (starts[i], calls[i].call_seq)):
        call = calls[index]
        best = None
        for exchange in exchanges:
            api = features.model_api(exchange.path)
            if api is None or (call.api is not None and api != call.api) or exchange.start_ns > starts[index]:
                continue
            if id(exchange) in taken and not exchange.websocket:
                continue
            if best is None or exchange.start_ns > best.start_ns:
                best = exchange
        if best is not None:
            owner[index] = best
            taken.add(id(best))
    return owner


def _row(
    number: int, exchange: Exchange | None, call: CallRow | None, placements: dict[int, CallPlacement], numbers: dict[int, int]
) -> Call:
    problems: list[str] = []
    status = exchange.status if exchange is not None else None
    api = call.api if call is not None else features.model_api(exchange.path) if exchange is not None else None
    if exchange is not None:
        if status == 0:
            problems.append(f"no answer: {exchange.error}")
        elif status >= 400:  # type: ignore[operator]
            problems.append(f"refused: HTTP {status}")
        elif call is None and api is not None:
            problems.append("no call recorded" + (" over the WebSocket" if exchange.websocket else ""))
    recorded = placement = answer = sample = None
    prompt_tokens = completion_tokens = None
    if call is not None:
        recorded = _recorded(call)
        if not recorded.token_ids:
            problems.append(f"recorded without the engine's token IDs (tokens: {call.tokens_source or 'absent'})")
        if call.end_reason in semconv.ENDS_UNDELIVERED:
            problems.append(f"the harness did not get the answer ({call.end_reason})")
        if call.completion_ids is not None:
            completion_tokens = int(call.completion_ids.size)
            answer = _cut(TOKENIZER.decode(call.completion_ids.tolist(), skip_special_tokens=True), ANSWER_CHARS)
        if call.prompt_ids is not None:
            prompt_tokens = call.prompt_length if call.prompt_length is not None else int(call.prompt_ids.size)
        where = placements.get(call.call_seq)
        if where is not None:
            sample, placement = where.sample, _placement_text(where, numbers)
    return Call(
        number=number,
        method=exchange.method if exchange else None,
        path=features.api_path(exchange.path) + _query(exchange.path) if exchange else None,
        status=status, api=api,
        model=(exchange.model if exchange and exchange.model else _model(call)),
        stream=bool(exchange and exchange.stream),
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, recorded=recorded,
        fields_dropped=list(call.fields_dropped) if call else [], fields_passed=list(call.fields_passed) if call else [],
        refused=exchange.error if exchange is not None and (status == 0 or (status or 0) >= 400) else None,
        answer=answer, sample=sample, placement=placement, problems=problems,
    )  # fmt: skip


def _recorded(call: CallRow) -> Recorded:
    tokens = (
        call.tokens_source == semconv.TOKENS_FROM_ENGINE and call.prompt_ids is not None and call.completion_ids is not None
    )
    logprobs = call.logprobs is not None and call.completion_ids is not None and call.logprobs.size == call.completion_ids.size
    return Recorded(
        call_seq=call.call_seq, token_ids=tokens, logprobs=bool(logprobs and np.isfinite(call.logprobs).all()),
        tokens_source=call.tokens_source, policy_version=call.policy_version, agent_id=call.agent_id,
        parent_agent_id=call.parent_agent_id, compaction=bool(call.compaction), origin=call.origin,
        finish_reason=call.finish_reason, end_reason=call.end_reason,
    )  # fmt: skip


def _model(call: CallRow | None) -> str | None:
    if call is None:
        return None
    _, _, model = call.name.partition(" ")
    return model or None


def _query(path: str) -> str:
    at = path.find("?")
    return path[at:] if at >= 0 else ""


def _placement_text(placement: CallPlacement, numbers: dict[int, int]) -> str:
    parent = f"#{numbers.get(placement.parent, '?')}" if placement.parent is not None else "?"
    if placement.problem:
        return f"not trained: {placement.problem}"
    if placement.sample is None:
        return "dropped with its sample"
    if placement.merged:
        text = f"merged onto {parent}"
    else:
        text = START_REASONS.get(placement.start or "", "new sample").replace("call {parent}", parent)
    return text + (f"; the declared agents disagree: {placement.declared}" if placement.declared else "")


def _breaks(calls: list[CallRow], assembly: RolloutAssembly | None, numbers: dict[int, int]) -> list[Break]:
    if assembly is None or not assembly.merge_failures:
        return []
    sequences = full_sequences(calls)
    out = []
    for failure in assembly.merge_failures:
        _, previous = sequences[failure.previous_call_seq]
        prompt, _ = sequences[failure.call_seq]
        begin = max(0, failure.position - BREAK_CONTEXT)
        end = failure.position + BREAK_CONTEXT
        out.append(Break(
            call=numbers.get(failure.call_seq, 0), previous_call=numbers.get(failure.previous_call_seq, 0),
            kind=failure.kind, classified_by=failure.classified_by, position=failure.position, detail=failure.detail,
            expected=TOKENIZER.decode(previous[begin:end].tolist()), got=TOKENIZER.decode(prompt[begin:end].tolist()),
        ))  # fmt: skip
    return out


def _run_problems(
    harness: HarnessRun, exchanges: list[Exchange], calls: list[CallRow], violations: dict[str, int], undelivered: int
) -> list[str]:
    problems = []
    if harness.outcome != "ok":
        problems.append(f"the harness {harness.message or harness.outcome}")
    if not calls and not any(features.model_api(e.path) for e in exchanges):
        problems.append(
            "the harness made no model call through agl (fix: it must take its endpoint from OPENAI_BASE_URL or"
            " ANTHROPIC_BASE_URL; one that reads another variable or a file gets it through --env, a config file"
            " or `sh -c` with $OPENAI_BASE_URL: see `agl harness check --help`)"
        )
    for reason, count in sorted(violations.items()):
        problems.append(f"{count} span(s) broke the span contract: {reason}")
    if undelivered:
        problems.append(f"{undelivered} span(s) did not reach the receiver")
    return problems


def _verdict(ok: bool, rows: list[Call], problems: list[str], samples: int, breaks: list[Break]) -> str:
    recorded = sum(1 for row in rows if row.recorded is not None)
    if ok:
        merged = (
            "they merge into one sample"
            if samples == 1
            else f"they make {samples} samples ({_count_kinds(breaks)})"
        )
        return f"works through agl: {recorded} call(s) recorded with token IDs, none refused; {merged}"
    by_problem: dict[str, list[int]] = {}  # the same problem on many rows is said once, with their numbers
    for row in rows:
        if row.problems:
            by_problem.setdefault(row.problems[0], []).append(row.number)
    said = [f"{_numbers(numbers)} {problem}" for problem, numbers in by_problem.items()]
    more = len(said) - 3
    said = said[:3] + problems[:2]
    return "does not work through agl yet: " + "; ".join(said) + (f"; and {more} more problem(s)" if more > 0 else "")


def _numbers(numbers: list[int]) -> str:
    """#1-#3, #5: rows in runs."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ", ".join(f"#{run[0]}" if len(run) == 1 else f"#{run[0]}-#{run[-1]}" for run in runs)


def _count_kinds(breaks: list[Break]) -> str:
    if not breaks:
        return "no merge break: separate threads"
    kinds: dict[str, int] = {}
    for item in breaks:
        kinds[item.kind] = kinds.get(item.kind, 0) + 1
    return ", ".join(f"{count} {kind} break{'s' if count > 1 else ''}" for kind, count in sorted(kinds.items()))


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def to_json(report: Report) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2)


def from_json(data: bytes) -> Report:
    return msgspec.json.decode(data, type=Report)
