"""The JSON of one rollout (calls, tree, samples token by token, merge breaks, rewards, logs) and
of one training step (its rollouts, their advantages and staleness, the metrics row).

The rollout is assembled exactly as the trainer assembles it (`assemble_rollout`): the samples,
placements and merge failures shown are the trainer's, so a new field on a placement (a call's
parent in the call tree) reaches the page without a change here.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from agl_trainer.assembly import AssemblyConfig, assemble_rollout
from agl_trainer.assembly.assemble import call_rewards, rewarded_call
from agl_trainer.batch import Sample
from agl_trainer.store import queries
from agl_trainer.store.records import RolloutKey
from agl_trainer.viewer import agreement
from agl_trainer.viewer.tokens import TokenDecoder

PROMPT, COMPLETION, CONTEXT, MASKED = "p", "c", "t", "m"  # token roles (see app.js ROLES)
LOG_TAIL_BYTES = 64 * 1024
MAX_FAILURES = 1_000  # merge breaks listed on one page (the total is in `page`)


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value, enc_hook=repr)


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


@dataclass(frozen=True)
class Page:
    """What one rollout page renders: a window of calls, of samples, and of each sample's tokens (a
    20,000-call rollout is millions of tokens: one response of all of them stalls server and browser)."""

    calls_offset: int = 0
    calls_limit: int = 500
    samples_offset: int = 0
    samples_limit: int = 20
    tokens_offset: int = 0
    tokens_limit: int = 20_000

    @classmethod
    def parse(cls, params: dict[str, str]) -> Page:
        values: dict[str, int] = {}
        for name, high in (("calls_offset", 2**31), ("calls_limit", 5_000), ("samples_offset", 2**31),
                           ("samples_limit", 200), ("tokens_offset", 2**31), ("tokens_limit", 200_000)):  # fmt: skip
            if name in params:
                values[name] = queries._int(name, params[name], 0 if name.endswith("offset") else 1, high)
        return cls(**values)


def _never() -> None:
    return None


def rollout(
    database: queries.Database,
    key: RolloutKey,
    config: AssemblyConfig,
    decoder: TokenDecoder,
    run_dir: Path | None,
    page: Page = Page(),  # noqa: B008 (frozen)
    check: Callable[[], None] = _never,
) -> dict[str, Any]:
    """The rollout's JSON, `page` of it; `check()` raises to stop (the request's budget is spent or
    its client left: viewer/work.py)."""
    with database.lock:
        loaded = queries.load(database.db, key)
        others = queries.attempts(database.db, key.rollout_id)
    if loaded is None:
        raise queries.QueryError(f"no rollout {key.rollout_id!r} attempt {key.attempt}", 404)
    check()
    data, rows = loaded
    assembly = assemble_rollout(data, config, decoder.tokenizer, check=check)
    check()
    placements = {p.call_seq: p for p in assembly.placements}
    per_call = call_rewards(data.rewards, config.reward_name, placements)  # by seq or by position, as trained
    calls = []
    window = slice(page.calls_offset, page.calls_offset + page.calls_limit)
    for number, (call, row) in enumerate(zip(data.calls[window], rows[window], strict=True), page.calls_offset):
        placement = placements.get(call.call_seq)
        calls.append(
            {
                **row,
                "number": number,
                "name": call.name,
                "policy_version": call.policy_version,
                "finish_reason": call.finish_reason,
                "end_reason": call.end_reason,
                "tokens_source": call.tokens_source,
                "held_ms": _finite(call.held_ms),
                "upstream": call.upstream,
                "api": call.api,
                "fields_dropped": list(call.fields_dropped),
                "fields_passed": list(call.fields_passed),
                "choices": call.choices,
                "prompt_tokens": call.prompt_length
                if call.prompt_length is not None
                else (None if call.prompt_ids is None else int(call.prompt_ids.size)),
                "prompt_ref_seq": call.prompt_ref_seq,
                "completion_tokens": None if call.completion_ids is None else int(call.completion_ids.size),
                "reward": per_call.get(call.call_seq),
                "placement": None if placement is None else _builtins(placement),
            }
        )
    info = _builtins(data.info)
    info["mode"] = queries.shown_mode(data.info.mode, data.info.dropped_reason)
    samples, kept = _samples(assembly, page, check)
    if kept:  # per-token engine/trainer agreement (viewer/agreement.py), on whole samples
        agreement.attach(samples, kept, run_dir, key)
    for view, sample in zip(samples, kept, strict=True):
        check()
        _window(view, sample, page, decoder)
    total_samples = 0 if assembly.result is None else len(assembly.result.samples)
    failures = assembly.merge_failures
    body = {
        "info": info,
        "attempts": others,
        "reward": _finite(assembly.reward),
        "dropped": assembly.dropped,
        "problems": assembly.problems,
        "truncations": assembly.truncations,
        "samples_dropped": assembly.samples_dropped,
        "calls": calls,
        "placements": [_builtins(p) for p in assembly.placements[window]],
        "merge_failures": [_builtins(f) for f in failures[: MAX_FAILURES]],
        "rewards": _rewards(data.rewards, rows, sorted(placements)),
        "samples": samples,
        "decoded": decoder.decodes,
        "log": _log(run_dir, key),
        "page": {
            **asdict(page),
            "calls_total": len(data.calls),
            "samples_total": total_samples,
            "merge_failures_total": len(failures),
        },
    }
    body["call_numbers"] = call_numbers([call.call_seq for call in data.calls], body)
    return exact_seqs(body)


def call_numbers(ordered: list[int], body: Any) -> dict[str, int]:
    """The number in its rollout (0, 1, 2 in seq order) of every call `body` names, by seq: the page
    says "call 2", the seq (a clock reading, unique across restarts and sidecars) on hover. Only the
    calls this page names: a 20,000-call rollout comes a window at a time."""
    first: dict[int, int] = {}
    for number, seq in enumerate(ordered):
        first.setdefault(seq, number)
    named: set[int] = set()
    _named_seqs(body, "", named)
    return {str(seq): first[seq] for seq in sorted(named) if seq in first}


def _named_seqs(value: Any, key: str, found: set[int]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _named_seqs(v, k, found)
    elif isinstance(value, list):
        for v in value:
            _named_seqs(v, "call_seq" if key == "call_seqs" else "", found)
    elif key in SEQ_KEYS and type(value) is int:
        found.add(value)


JS_EXACT = 2**53 - 1  # a JavaScript number holds integers exactly up to here
SEQ_KEYS = frozenset({"call_seq", "previous_call_seq", "prompt_ref_seq", "parent", "for_call"})


def exact_seqs(value: Any, key: str = "") -> Any:
    """Call seqs past 2^53 as decimal strings: the sidecar's seqs are clock readings near 2^59,
    which JSON.parse would round (the page would show, and match, the wrong call). Smaller seqs
    (another producer's 0, 1, 2, ...) stay numbers; a seq is the same either way on every row."""
    if isinstance(value, dict):
        return {k: exact_seqs(v, k) for k, v in value.items()}
    if key == "call_seqs" and isinstance(value, list):
        return [exact_seqs(v, "call_seq") for v in value]
    if isinstance(value, list):
        return [exact_seqs(v) for v in value]
    if key in SEQ_KEYS and type(value) is int and abs(value) > JS_EXACT:
        return str(value)
    return value


def _samples(assembly: Any, page: Page, check: Callable[[], None]) -> tuple[list[dict[str, Any]], list[Sample]]:
    """The page's samples (views of whole samples; _window cuts them) and the samples themselves."""
    if assembly.result is None:
        return [], []
    chosen = range(page.samples_offset, min(len(assembly.result.samples), page.samples_offset + page.samples_limit))
    mine: dict[int, list[Any]] = {index: [] for index in chosen}
    for p in assembly.placements:  # one pass (was one per sample: quadratic in a many-sample rollout)
        if p.sample in mine:
            mine[p.sample].append(p)
    views, kept = [], []
    for index in chosen:
        check()
        sample = assembly.result.samples[index]
        n = len(sample.token_ids)
        roles = bytearray(MASKED.encode() * n)
        first = min((p.completion_start for p in mine[index]), default=n)
        roles[: min(first, n)] = PROMPT.encode() * min(first, n)
        for p in mine[index]:
            begin, end = (p.context_start if p.merged else p.completion_start), min(p.completion_start, n)
            if end > begin:
                roles[begin:end] = CONTEXT.encode() * (end - begin)
        codes = np.frombuffer(roles, np.uint8)
        codes[sample.loss_mask] = ord(COMPLETION)
        logprobs = np.round(sample.engine_logprobs.astype(np.float64), 4)
        views.append(
            {
                "index": index,
                "call_seqs": sample.call_seqs,
                "roles": roles.decode(),
                "logprobs": [v if math.isfinite(v) else None for v in logprobs.tolist()],
                "boundaries": [{"position": p.context_start, "call_seq": p.call_seq} for p in mine[index] if p.merged]
                + [{"position": p.completion_start, "call_seq": p.call_seq, "completion": True} for p in mine[index]],
                "token_rewards": None
                if sample.token_rewards is None
                else [[i, sample.token_rewards[i].item()] for i in np.flatnonzero(sample.token_rewards).tolist()],
                "trained_tokens": sample.num_trained_tokens,
            }
        )
        kept.append(sample)
    return views, kept


PER_TOKEN = ("roles", "logprobs", "trainer_logprobs", "abs_delta")


def _window(view: dict[str, Any], sample: Sample, page: Page, decoder: TokenDecoder) -> None:
    """Cut a sample's view to the page's tokens: `offset` and `length` (the whole sample's) say
    where; positions in `boundaries` and `token_rewards` become positions within the window."""
    n = len(sample.token_ids)
    begin = min(page.tokens_offset, n)
    end = min(n, begin + page.tokens_limit)
    ids = sample.token_ids[begin:end].tolist()
    versions = sample.policy_versions[begin:end].tolist()
    view.update(offset=begin, length=n, ids=ids, text=decoder.texts(ids), versions=versions)
    for name in PER_TOKEN:
        if isinstance(view.get(name), (list, str)):
            view[name] = view[name][begin:end]
    view["boundaries"] = [{**b, "position": b["position"] - begin} for b in view["boundaries"]
                          if begin <= b["position"] < end or (b["position"] == end == n)]  # fmt: skip
    if view["token_rewards"] is not None:
        view["token_rewards"] = [[i - begin, r] for i, r in view["token_rewards"] if begin <= i < end]
def _log(run_dir: Path | None, key: RolloutKey) -> dict[str, Any] | None:
    """The harness's log, when the run's rollouts/ folder holds one for this rollout. The name is
    matched against the folder's listing: a rollout id is never used to build a path."""
    if run_dir is None:
        return None
    folder = run_dir / "rollouts"
    if not folder.is_dir():
        return None
    wanted = {f"{key.rollout_id}.log", f"{key.rollout_id}.{key.attempt}.log", f"{key.rollout_id}-{key.attempt}.log"}
    try:
        for entry in folder.iterdir():
            if entry.name in wanted and entry.is_file():
                size = entry.stat().st_size
                with open(entry, "rb") as file:
                    file.seek(max(0, size - LOG_TAIL_BYTES))
                    text = file.read().decode("utf-8", "replace")
                return {"name": entry.name, "size": size, "tail": text, "truncated": size > LOG_TAIL_BYTES}
    except OSError:
        return None
    return None


def _rewards(rewards: Any, calls: queries.CallRows, ordered: list[int]) -> list[dict[str, Any]]:
    """Each reward span with its end time as people read it: seconds since the epoch (`end_s`, the
    page shows the local time) and nanoseconds after the rollout's first call started (`after_ns`),
    and for a per-call one the seq of the call it names (`for_call`: its seq, or the call at its
    position; `ordered` the rollout's call seqs, sorted)."""
    starts = [start for start in calls.column("start_ns") if isinstance(start, int)]
    first = min(starts) if starts else None
    return [
        {
            "name": r.name,
            "value": _finite(r.value),
            "call_seq": r.call_seq,
            "for_call": None if r.call_seq is None else rewarded_call(r.call_seq, ordered),
            "end_ns": r.end_ns,
            "end_s": None if r.end_ns is None else r.end_ns / 1e9,
            "after_ns": None if r.end_ns is None or first is None else r.end_ns - first,
        }
        for r in rewards
    ]


def metrics_rows(run_dir: Path | None) -> list[dict[str, Any]]:
    """The run's metrics.jsonl (one row per step), when the store sits in a run's output dir."""
    if run_dir is None:
        return []
    path = run_dir / "metrics.jsonl"
    rows: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as file:
            for line in file:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line being written right now
                step = row.get("step") if isinstance(row, dict) else None
                if isinstance(step, float) and step.is_integer():
                    step = row["step"] = int(step)  # files written before the writer kept it an int
                if isinstance(step, int) and not isinstance(step, bool):
                    rows.append({k: v for k, v in row.items() if isinstance(v, (int, float)) and math.isfinite(v)})
    except OSError:
        return []
    return rows


def step(
    database: queries.Database, number: int, config: AssemblyConfig, run_dir: Path | None
) -> dict[str, Any]:
    with database.lock:
        rows = queries.step_rollouts(database.db, number, config.reward_name)
        known = queries.step_row(database.db, number)
    if not rows and known is None:
        raise queries.QueryError(f"no training step {number} in the store", 404)
    metrics = next((row for row in metrics_rows(run_dir) if row.get("step") == number), None)
    # The policy that trained step N generated version N-1 (one update per step); metrics know better.
    trained_version = number - 1
    if metrics and isinstance(metrics.get("policy_version"), (int, float)):
        trained_version = int(metrics["policy_version"]) - 1
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["task_id"] or row["rollout_id"], []).append(row)
    for row in rows:
        row.pop("rowid", None)
        row["break_kinds"] = json.loads(row["break_kinds"]) if row.get("break_kinds") else None
    for members in groups.values():
        rewards = [m["reward"] for m in members if m["reward"] is not None]
        mean = statistics.fmean(rewards) if rewards else None
        std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
        for m in members:
            m["group_size"] = len(members)
            m["group_mean"] = mean
            if m["reward"] is None or mean is None:
                m["advantage"] = m["advantage_normalized"] = None
            else:
                m["advantage"] = m["reward"] - mean
                m["advantage_normalized"] = (m["reward"] - mean) / (std + 1e-6) if len(members) > 1 else 0.0
            m["staleness"] = None if m["min_version"] is None else trained_version - m["min_version"]
    return {
        "step": number,
        "recorded": None if known is None else {"rollouts": known[0], "at": known[1]},
        "trained_version": trained_version,
        "rollouts": rows,
        "metrics": metrics,
    }
