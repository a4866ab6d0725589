"""Benchmark: OTLP protobuf batches of model calls -> receiver -> store -> samples.

    python bench/ingest.py [--quick]

Prints token IDs per second for each stage and the ratio against a straightforward receiver
measured in the same run (opentelemetry-proto's Python messages -> dicts with
json_format.MessageToDict -> token lists). Then runs `agl receive` as a separate process pinned to
one core and sends it 2k-token calls as fast as it acknowledges them, to answer: does the receiver
keep up with 2,000 calls/s on one core (the sidecar's top export rate)?
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from agl import semconv
from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.receiver import Receiver, ReceiverConfig, decode_body
from agl_trainer.store import RolloutStore
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
PROTOBUF = {"content-type": "application/x-protobuf"}


def _kv(key, value) -> KeyValue:
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        any_value = AnyValue(array_value=ArrayValue(values=[AnyValue(double_value=float(v)) for v in value]))
    elif isinstance(value, np.ndarray):
        any_value = AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=int(v)) for v in value]))
    elif isinstance(value, str):
        any_value = AnyValue(string_value=value)
    else:
        any_value = AnyValue(int_value=value)
    return KeyValue(key=key, value=any_value)


def make_requests(
    rollouts: int, calls: int, prompt_tokens: int, completion_tokens: int, per_request: int, seed: int = 0
) -> tuple[list[bytes], int, int]:
    """Serialized requests of multi-call rollouts: the first prompt has `prompt_tokens` tokens, each
    later one extends the previous sequence (sent in full, not by reference: the worst case for
    bytes). Returns (bodies, calls, token IDs)."""
    rng = np.random.default_rng(seed)
    spans, tokens = [], 0
    for r in range(rollouts):
        rollout_id = f"bench-{seed}-{r}"
        growth = 32  # tool output between calls
        sequence = rng.integers(0, 150_000, prompt_tokens)
        for seq in range(calls):
            completion = rng.integers(0, 150_000, completion_tokens)
            logprobs = -rng.random(completion_tokens)
            from opentelemetry.proto.trace.v1.trace_pb2 import Span

            span = Span(
                trace_id=os.urandom(16),
                span_id=os.urandom(8),
                name="chat bench",
                kind=3,
                start_time_unix_nano=1,
                end_time_unix_nano=2,
            )
            span.attributes.extend(
                [
                    _kv(semconv.GEN_AI_OPERATION_NAME, "chat"),
                    _kv(semconv.ROLLOUT_ID, rollout_id),
                    _kv(semconv.TASK_ID, f"task-{r % 8}"),
                    _kv(semconv.ATTEMPT, 0),
                    _kv(semconv.CALL_SEQ, seq),
                    _kv(semconv.POLICY_VERSION, 0),
                    _kv(semconv.TOKENS_SOURCE, "engine"),
                    _kv(semconv.PROMPT_LENGTH, int(sequence.size)),
                    _kv(semconv.PROMPT_TOKEN_IDS, sequence),
                    _kv(semconv.COMPLETION_TOKEN_IDS, completion),
                    _kv(semconv.COMPLETION_LOGPROBS, logprobs),
                ]
            )
            spans.append(span)
            tokens += sequence.size + completion.size
            sequence = np.concatenate([sequence, completion, rng.integers(0, 150_000, growth)])
        from opentelemetry.proto.trace.v1.trace_pb2 import Span

        end = Span(trace_id=os.urandom(16), span_id=os.urandom(8), name=semconv.SPAN_ROLLOUT)
        end.attributes.extend([_kv(semconv.ROLLOUT_ID, rollout_id), _kv(semconv.ATTEMPT, 0)])
        reward = Span(trace_id=os.urandom(16), span_id=os.urandom(8), name=semconv.SPAN_REWARD)
        reward.attributes.extend([_kv(semconv.ROLLOUT_ID, rollout_id), _kv(semconv.ATTEMPT, 0)])
        reward.attributes.append(KeyValue(key=semconv.REWARD_VALUE, value=AnyValue(double_value=1.0)))
        spans += [end, reward]
    bodies = []
    for start in range(0, len(spans), per_request):
        message = ExportTraceServiceRequest()
        message.resource_spans.add().scope_spans.add().spans.extend(spans[start : start + per_request])
        bodies.append(message.SerializeToString())
    return bodies, rollouts * calls, tokens


def baseline_decode(body: bytes) -> int:
    """The straightforward receiver: opentelemetry-proto message -> dict -> token lists."""
    message = ExportTraceServiceRequest()
    message.ParseFromString(body)
    data = json_format.MessageToDict(message)
    tokens = 0
    for resource_spans in data.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for kv in span.get("attributes", []):
                    if kv["key"] in (semconv.PROMPT_TOKEN_IDS, semconv.COMPLETION_TOKEN_IDS):
                        tokens += len([int(v["intValue"]) for v in kv["value"]["arrayValue"]["values"]])
    return tokens


def timed(fn, bodies) -> float:
    start = time.perf_counter()
    for body in bodies:
        fn(body)
    return time.perf_counter() - start


def stage_throughput(console: Console, quick: bool) -> None:
    rollouts, calls = (8, 4) if quick else (32, 4)
    bodies, n_calls, tokens = make_requests(rollouts, calls, 8192, 256, per_request=16)
    mb = sum(map(len, bodies)) / 1e6
    console.print(
        f"[bold]8k-token prompts[/]: {n_calls} calls, {tokens:,} token IDs, {len(bodies)} requests, {mb:.1f} MB"
    )

    base_s = (
        timed(baseline_decode, bodies[: max(2, len(bodies) // 4)]) * len(bodies) / max(2, len(bodies) // 4)
    )
    ours_s = timed(lambda body: decode_body(body, "application/x-protobuf"), bodies)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "bench.db"
        with Receiver(path, ReceiverConfig(port=0)) as receiver, httpx.Client(timeout=60) as http:
            start = time.perf_counter()
            for body in bodies:
                assert (
                    http.post(f"{receiver.url}/v1/traces", content=body, headers=PROTOBUF).status_code == 200
                )
            http_s = time.perf_counter() - start
        with RolloutStore(path, grace_s=0.0) as store:
            start = time.perf_counter()
            result = assemble(store, store.ready_rollouts(), AssemblyConfig())
            assemble_s = time.perf_counter() - start
            assert len(result.rollouts) == rollouts and result.report.merged_calls == rollouts * (calls - 1)
            out_tokens = sum(len(s.token_ids) for r in result.rollouts for s in r.samples)

    table = Table(title="token IDs per second (higher is better)", title_justify="left")
    for column in ("stage", "seconds", "token IDs/s", "vs baseline decode"):
        table.add_column(column, justify="right")

    def row(name: str, seconds: float, count: int) -> None:
        rate = count / seconds
        table.add_row(name, f"{seconds:.3f}", f"{rate:,.0f}", f"{rate / (tokens / base_s):.1f}x")

    row("baseline: parse + MessageToDict + lists", base_s, tokens)
    row("agl decode + contract check", ours_s, tokens)
    row("agl HTTP receive -> store (fsync)", http_s, tokens)
    row("agl store -> samples (assembly)", assemble_s, out_tokens)
    console.print(table)


AGL = "import sys; from agl_trainer.cli import main; sys.exit(main())"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def keeps_up(console: Console, quick: bool) -> None:
    """`agl receive` on one core (sched_setaffinity), fed 2k-token calls by 2 client threads."""
    per_request, requests = 64, (40 if quick else 160)
    bodies, n_calls, tokens = make_requests(
        requests * per_request // 3, 3, 2048, 128, per_request=per_request, seed=1
    )
    n_spans = n_calls + 2 * (requests * per_request // 3)  # rollout and reward spans ride along
    with tempfile.TemporaryDirectory() as directory:
        store = Path(directory) / "one-core.db"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        process = subprocess.Popen(
            [sys.executable, "-c", AGL, "receive", "--store", str(store), "--listen", "127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        try:
            os.sched_setaffinity(process.pid, {0})  # its threads are created later and inherit it
            url = None
            while url is None:
                line = process.stdout.readline()
                if not line:
                    raise SystemExit("agl receive did not start")
                found = re.search(r"on (http://\S+)/v1/traces", line)
                url = found.group(1) if found else None
            for thread_id in os.listdir(f"/proc/{process.pid}/task"):  # threads made before the first pin
                os.sched_setaffinity(int(thread_id), {0})
            lock, queue = threading.Lock(), list(bodies)

            def client() -> None:
                with httpx.Client(timeout=60) as http:
                    while True:
                        with lock:
                            if not queue:
                                return
                            body = queue.pop()
                        assert (
                            http.post(f"{url}/v1/traces", content=body, headers=PROTOBUF).status_code == 200
                        )

            start, cpu_start = time.perf_counter(), cpu_seconds(process.pid)
            with Progress(transient=True) as progress:
                task = progress.add_task("2k-token calls -> agl receive (1 core)", total=len(bodies))
                threads = [threading.Thread(target=client) for _ in range(2)]
                for thread in threads:
                    thread.start()
                while any(thread.is_alive() for thread in threads):
                    time.sleep(0.1)
                    with lock:
                        progress.update(task, completed=len(bodies) - len(queue))
            seconds = time.perf_counter() - start
            cpu = cpu_seconds(process.pid) - cpu_start
        finally:
            process.terminate()
            process.wait(30)
    calls = requests * per_request // 3 * 3
    rate, capacity = calls / seconds, calls / cpu
    verdict = "[green]yes[/]" if capacity >= 2000 else "[red]no[/]"
    console.print(
        f"[bold]2k-token calls into `agl receive` pinned to one core (fsync per commit)[/]: {calls} calls"
        f" (+{n_spans - calls} rollout/reward spans, {tokens:,} token IDs) in {seconds:.2f} s wall:"
        f" {rate:,.0f} calls/s, {tokens / seconds:,.0f} token IDs/s. The receiver used {cpu:.2f} CPU-s:"
        f" {capacity:,.0f} calls per CPU-second (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        f" inflates wall time). Keeps up with 2,000 calls/s on one core: {verdict} ({capacity / 2000:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller run (under a minute)")
    parser.add_argument("--only", choices=("stages", "one-core"), help="run one part")
    args = parser.parse_args()
    console = Console()
    if args.only != "one-core":
        stage_throughput(console, args.quick)
    if args.only != "stages":
        keeps_up(console, args.quick)


if __name__ == "__main__":
    main()
