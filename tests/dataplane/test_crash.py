"""SIGKILL `agl receive` while clients send; after a restart every acknowledged span is stored."""

from __future__ import annotations

import signal
import subprocess
import threading

import httpx
from agl_trainer.store import RolloutStore

from tests.dataplane.otlp import call_span, request, reward_span
from tests.dataplane.processes import start_receiver


def make_batches(count: int):
    batches = []
    for index in range(count):
        spans = [
            call_span(f"r{index}", seq, list(range(64 * seq, 64 * seq + 200)), [1, 2, 3]) for seq in range(4)
        ]
        spans.append(reward_span(f"r{index}", 1.0))
        batches.append((request(spans).SerializeToString(), {(s.trace_id, s.span_id) for s in spans}))
    return batches


def test_sigkill_loses_no_acknowledged_span(tmp_path):
    store_path = tmp_path / "rollouts.db"
    batches = make_batches(400)
    acknowledged: set[tuple[bytes, bytes]] = set()
    lock = threading.Lock()
    process, url = start_receiver(store_path)
    enough = threading.Event()

    def client(mine):
        with httpx.Client(timeout=10) as http:
            for body, ids in mine:
                try:
                    reply = http.post(
                        f"{url}/v1/traces", content=body, headers={"content-type": "application/x-protobuf"}
                    )
                except httpx.HTTPError:
                    return  # the receiver is gone
                if reply.status_code == 200:
                    with lock:
                        acknowledged.update(ids)
                        if len(acknowledged) >= 5 * 60:
                            enough.set()

    threads = [threading.Thread(target=client, args=(batches[i::3],)) for i in range(3)]
    try:
        for thread in threads:
            thread.start()
        assert enough.wait(120), "the clients made no progress"
        process.send_signal(signal.SIGKILL)  # mid-stream: requests are in flight
        process.wait(30)
        for thread in threads:
            thread.join(60)
        with lock:
            acked = set(acknowledged)
        assert len(acked) < 5 * len(batches), "the kill came after every request: nothing was tested"

        process, url = start_receiver(store_path)  # restart on the same store
        with RolloutStore(store_path) as store:
            stored = store.span_ids()
        assert acked <= stored, f"{len(acked - stored)} acknowledged spans lost"

        with httpx.Client(timeout=30) as http:  # the clients retry everything; nothing is stored twice
            for body, _ in batches:
                assert (
                    http.post(
                        f"{url}/v1/traces", content=body, headers={"content-type": "application/x-protobuf"}
                    ).status_code
                    == 200
                )
        with RolloutStore(store_path) as store:
            assert len(store.span_ids()) == 5 * len(batches)
            assert store.stats().calls == 4 * len(batches)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
