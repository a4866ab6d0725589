"""Issue #43: token IDs as today's OTLP int arrays against int32 bytes (bench/_token_bytes.py), both
ends, on the same calls in the same run.

    python bench/token_representation.py [--quick] [--rounds N]

The same model calls (CallRecords as the proxy fills them: the engine's JSON token arrays and chat
logprobs) go through each path in process:
  today          agl-sidecar's SpanRecorder (slice and prompt caches, the C extension), requests framed
                 by otlp.RequestFramer, sent raw or gzipped by the exporter's loopback rule
                 (`repeats`: gzip only a request mostly made of prompts sent before, their kept
                 deflate streams copied in, deflate.py)
  today gzip     the same spans, every request gzipped as off loopback (deflate.gzip_spans)
  bytes          the candidate: int32 LE bytesValue, a prompt repeated in a request sent once in the
                 scope's table, no gzip
  bytes gzip     the same requests through plain zlib gzip (level 1, as the exporter)
  bytes+prefix   the candidate, its sidecar keeping per rollout the last prompt's JSON text and int32
                 bytes, so that a conversation's next prompt decodes only its new JSON, and whole
                 prompts by their JSON text (an exact match: the k attempts decode their prompt once)
  bytes+prefix gzip  the same, gzipped
then into the receiver: the body inflated (payload.decompress), decoded into RawSpans with numpy arrays
(today: otlp_protobuf.decode_protobuf; the candidate: _token_bytes.decode_request), contract-checked
(payload._classified) and written to a RolloutStore (one transaction per request).

Workloads (token IDs Zipf(1.1) over a 151k vocabulary, not real text; 8 calls per export request):
  conversation   agent conversations growing turn by turn: a 2k-token start (1.5k of it a system
                 prompt they share), each turn a 256-token completion and 768 tokens of tool output,
                 up to ~32k tokens (31 calls each); conversations' calls interleaved
  attempts       k = 8 attempts of each task starting together on the same 8k-token prompt, 3 calls
                 each (later calls extend the prompt: sent by reference)
Per call: the sidecar's CPU to build the spans and the request (and compress it), bytes on the wire,
the receiver's CPU to inflate + decode into numpy arrays, and to check + write them to the store; the
median over rounds (each round fresh recorders, caches cold), paths in alternating order. All paths'
stored arrays are checked equal. CPU is this process's (time.process_time), so other load on the
machine shows little.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _token_bytes as candidate  # bench/_token_bytes.py (bench/ is on sys.path when run as a script)
import msgspec
import numpy as np
from agl import semconv
from agl_sidecar.calls.attribution import Identity
from agl_sidecar.calls.record import CallRecord, Choice
from agl_sidecar.spans import deflate, otlp
from agl_sidecar.spans.exporter import REPEATS, SpanExporter
from agl_sidecar.spans.recorder import SpanRecorder
from agl_trainer.receiver.payload import _classified, decompress
from agl_trainer.receiver.wire import DecodeError, decode_protobuf
from agl_trainer.store import RolloutStore

VOCAB = 151_000
PER_REQUEST = 8
LEVEL = 1  # the exporter's compression level
RESOURCE = {"service.name": "agl-sidecar", "agl.sidecar.id": "bench"}


@dataclass
class Spec:
    """One call as the engine answered it (JSON bytes), to make a fresh CallRecord per round."""

    rollout_id: str
    task_id: str
    attempt: int
    seq: int
    prompt: bytes
    completion: bytes
    logprobs: bytes
    tokens: int


class Tokens:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(VOCAB)  # frequent tokens anywhere in the vocabulary

    def draw(self, n: int) -> np.ndarray:
        return self.order[np.minimum(self.rng.zipf(1.1, n), VOCAB) - 1]


def _logprobs(rng: np.random.Generator, n: int) -> bytes:
    values = np.round(-rng.exponential(0.5, n), 6)
    return msgspec.json.encode({"content": [{"token": "t", "logprob": float(v), "bytes": None, "top_logprobs": []}
                                            for v in values]})


def _spec(rollout: str, task: str, attempt: int, seq: int, prompt: np.ndarray, completion: np.ndarray,
          rng: np.random.Generator) -> Spec:
    return Spec(rollout, task, attempt, seq, msgspec.json.encode(prompt.tolist()),
                msgspec.json.encode(completion.tolist()), _logprobs(rng, completion.size),
                prompt.size + completion.size)


def conversation(conversations: int, max_tokens: int = 32_768) -> list[Spec]:
    tokens = Tokens(1)
    system = tokens.draw(1536)
    per: list[list[Spec]] = []
    for c in range(conversations):
        sequence = np.concatenate([system, tokens.draw(512)])
        calls: list[Spec] = []
        seq = 0
        while sequence.size + 256 <= max_tokens:
            completion = tokens.draw(256)
            calls.append(_spec(f"conv-{c}", f"conv-task-{c}", 0, seq, sequence, completion, tokens.rng))
            sequence = np.concatenate([sequence, completion, tokens.draw(768)])
            seq += 1
        per.append(calls)
    return [call for turn in zip(*per) for call in turn]  # interleaved, as concurrent rollouts arrive


def attempts(tasks: int, k: int = 8, calls: int = 3) -> list[Spec]:
    tokens = Tokens(2)
    out: list[Spec] = []
    for t in range(tasks):
        sequences = [tokens.draw(8192)] * k  # the same prompt for every attempt
        for seq in range(calls):
            for a in range(k):
                completion = tokens.draw(256)
                out.append(_spec(f"task-{t}-a{a}", f"task-{t}", a, seq, sequences[a], completion, tokens.rng))
                sequences[a] = np.concatenate([sequences[a], completion, tokens.draw(512)])
    return out


def records(specs: list[Spec]) -> list[CallRecord]:
    out = []
    for s in specs:
        call = CallRecord(api="chat.completions", operation=semconv.OPERATION_CHAT,
                          identity=Identity(s.rollout_id, s.task_id, s.attempt, semconv.MODE_TRAIN),
                          trace_parent=None, start_ns=time.time_ns(), model="tiny", seq=s.seq,
                          policy_version=0, response_model="tiny", upstream="http://127.0.0.1:8000",
                          prompt_ids=msgspec.Raw(s.prompt))
        call.choices[0] = Choice(msgspec.Raw(s.completion), msgspec.Raw(s.logprobs), "stop")
        out.append(call)
    return out


class Capture:
    """The exporter as the recorder sees it: spans handed over, kept in order."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.counters = types.SimpleNamespace(spans_failed=0)

    def submit(self, span: Any) -> None:
        self.spans.append(span)


_REPEATS_RULE = types.SimpleNamespace(compress=REPEATS)


def today_bodies(calls: list[CallRecord], gzip_all: bool) -> list[tuple[bytes, bool]]:
    capture = Capture()
    recorder = SpanRecorder(capture)  # type: ignore[arg-type]
    framer = otlp.RequestFramer(RESOURCE, "agl-sidecar", "bench")
    kept = deflate.KeptStreams()
    out = []
    for start in range(0, len(calls), PER_REQUEST):
        for call in calls[start : start + PER_REQUEST]:
            recorder.finish(call)
        batch, capture.spans = capture.spans, []
        gzipped = gzip_all or SpanExporter._gzips(_REPEATS_RULE, batch)  # type: ignore[arg-type]
        out.append((deflate.gzip_spans(framer, batch, LEVEL, kept) if gzipped else framer.request(batch), gzipped))
    return out


_RESOURCE_BYTES = otlp.attributes(1, RESOURCE.items())


def bytes_bodies(calls: list[CallRecord], gzip_all: bool, reuse_prefix: bool = False) -> list[tuple[bytes, bool]]:
    capture = Capture()
    recorder = candidate.BytesRecorder(capture, reuse_prefix=reuse_prefix)  # type: ignore[arg-type]
    out = []
    for start in range(0, len(calls), PER_REQUEST):
        for call in calls[start : start + PER_REQUEST]:
            recorder.finish(call)
        batch, capture.spans = capture.spans, []
        request = candidate.frame_request(batch, _RESOURCE_BYTES, "agl-sidecar", "bench")
        out.append((candidate.gzip(request, LEVEL) if gzip_all else request, gzip_all))
    return out


PATHS: dict[str, tuple[Callable[[list[CallRecord], bool], list[tuple[bytes, bool]]], bool, Callable]] = {
    "today": (today_bodies, False, decode_protobuf),
    "today gzip": (today_bodies, True, decode_protobuf),
    "bytes": (bytes_bodies, False, candidate.decode_request),
    "bytes gzip": (bytes_bodies, True, candidate.decode_request),
    "bytes+prefix": (functools.partial(bytes_bodies, reuse_prefix=True), False, candidate.decode_request),
    "bytes+prefix gzip": (functools.partial(bytes_bodies, reuse_prefix=True), True, candidate.decode_request),
}


def run_path(name: str, specs: list[Spec], directory: Path, keep: dict[str, Any] | None) -> dict[str, float]:
    build, gzip_all, decode = PATHS[name]
    calls = records(specs)
    t0 = time.process_time()
    bodies = build(calls, gzip_all)
    t1 = time.process_time()
    decoded = []
    for body, gzipped in bodies:
        raw = decompress(body, "gzip" if gzipped else None, 1 << 30)
        decoded.append(_classified(decode(bytes(raw))))
    t2 = time.process_time()
    path = directory / f"{name.replace(' ', '-')}-{time.monotonic_ns()}.db"
    with RolloutStore(path, grace_s=0.0) as store:
        t3 = time.process_time()
        for batch in decoded:
            store.write(batch.records)
        t4 = time.process_time()
        if keep is not None:
            keep[name] = {(r.rollout_id, r.call_seq): r for b in decoded for r in b.records}
    if keep is not None and decode is decode_protobuf:  # the candidate's receiver takes int arrays too
        again = [_classified(candidate.decode_request(bytes(decompress(b, "gzip" if g else None, 1 << 30))))
                 for b, g in bodies]
        keep[f"{name} (bytes decoder)"] = {(r.rollout_id, r.call_seq): r for b in again for r in b.records}
    n = len(specs)
    return {
        "sidecar": (t1 - t0) / n * 1e6,
        "wire": sum(len(b) for b, _ in bodies) / n,
        "decode": (t2 - t1) / n * 1e6,
        "store": (t4 - t3) / n * 1e6,
    }


def check_equal(kept: dict[str, Any]) -> None:
    """Every path stored the same calls with the same arrays."""
    reference = kept["today"]
    for name, got in kept.items():
        assert got.keys() == reference.keys(), f"{name}: other calls than today's"
        for key, record in got.items():
            want = reference[key]
            assert type(record).__name__ == "CallSpan", f"{name} {key}: {record}"
            for field in ("prompt_ids", "completion_ids", "logprobs"):
                a, b = getattr(record, field), getattr(want, field)
                assert a is not None and np.array_equal(a, b), f"{name} {key}: {field} differs"
            assert (record.prompt_ref_seq, record.prompt_ref_length) == (want.prompt_ref_seq, want.prompt_ref_length)


def check_hostile() -> None:
    """The candidate's receiver refuses bad values with a DecodeError (the receiver's 400) naming them."""
    head = otlp.span(trace_id=b"t" * 16, span_id=b"s" * 8, parent_span_id=None, name="chat tiny", kind=3,
                     start_ns=1, end_ns=2, attrs=[(semconv.GEN_AI_OPERATION_NAME, "chat"), (semconv.ROLLOUT_ID, "r")])
    big = np.arange(300, dtype="<i4").tobytes()
    cases = {
        "10 bytes is not a whole number": [candidate.TokenSpan(head, b"\x01" * 10)],
        "token ID -7 is negative": [candidate.TokenSpan(head, np.array([5, -7], "<i4").tobytes())],
        "agl.prompt.table entry 0: 1202 bytes": [candidate.TokenSpan(head, big + b"xx")] * 2,
        "agl.prompt.table_entry 3 names no entry": [candidate.TokenSpan(
            head + otlp.attributes(9, [(candidate.TABLE_ENTRY_KEY, 3)]), None)],
        "both agl.prompt.table_entry and agl.prompt.token_ids": [
            candidate.TokenSpan(head, big), candidate.TokenSpan(head, big),
            candidate.TokenSpan(head + candidate.bytes_attribute(semconv.PROMPT_TOKEN_IDS, big), big)],
        "agl.completion.token_ids: 6 bytes": [candidate.TokenSpan(
            head + candidate.bytes_attribute(semconv.COMPLETION_TOKEN_IDS, b"abcdef"), None)],
    }
    for expected, spans in cases.items():
        try:
            candidate.decode_request(candidate.frame_request(spans, _RESOURCE_BYTES, "agl-sidecar", "bench"))
        except DecodeError as error:
            assert expected in str(error), f"expected {expected!r}, got {error}"
        else:
            raise AssertionError(f"not refused: {expected}")
    print(f"hostile requests refused by the candidate's decoder, each naming its attribute: {len(cases)} of {len(cases)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workloads, 2 rounds")
    parser.add_argument("--rounds", type=int, help="rounds per path (default 5, 2 with --quick)")
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    if rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    workloads = {
        "conversation": conversation(1 if args.quick else 3),
        "attempts": attempts(1 if args.quick else 4),
    }
    check_hostile()
    print(f"{PER_REQUEST} calls per export request, gzip level {LEVEL}, {rounds} round(s), median per call")
    with tempfile.TemporaryDirectory(prefix="agl-bench-tokens-") as scratch:
        for workload, specs in workloads.items():
            tokens = sum(s.tokens for s in specs)
            print(f"\n{workload}: {len(specs)} calls, {tokens / len(specs):,.0f} prompt+completion tokens a call on average")
            results: dict[str, list[dict[str, float]]] = {name: [] for name in PATHS}
            kept: dict[str, Any] = {}
            for r in range(rounds):
                order = list(PATHS) if r % 2 == 0 else list(reversed(PATHS))
                for name in order:
                    results[name].append(run_path(name, specs, Path(scratch), kept if r == 0 else None))
                if r == 0:
                    check_equal(kept)
            median = {name: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for name, rows in results.items()}
            print(f"  {'path':<19}{'sidecar us':>12}{'wire bytes':>12}{'inflate+decode us':>19}{'check+store us':>16}")
            for name, m in median.items():
                print(f"  {name:<19}{m['sidecar']:12.0f}{m['wire']:12,.0f}{m['decode']:19.0f}{m['store']:16.0f}")
            for new, old in (("bytes", "today"), ("bytes gzip", "today gzip"), ("bytes+prefix", "today"),
                             ("bytes+prefix gzip", "today gzip"), ("bytes+prefix gzip", "today")):
                a, b = median[new], median[old]
                print(f"  => {new} / {old}: sidecar {a['sidecar'] / b['sidecar']:.2f}x, wire {a['wire'] / b['wire']:.2f}x, "
                      f"decode {a['decode'] / b['decode']:.2f}x, store {a['store'] / b['store']:.2f}x, "
                      f"sidecar+decode {(a['sidecar'] + a['decode']) / (b['sidecar'] + b['decode']):.2f}x")
            print(f"  stored arrays equal across the {len(PATHS)} paths, and today's requests read by the bytes decoder: yes")


if __name__ == "__main__":
    main()
