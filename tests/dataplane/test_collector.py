"""A real OpenTelemetry collector (rotel-agent) between the sender and `agl receive`, over gRPC and HTTP."""

from __future__ import annotations

import gzip
import re
import signal
import subprocess
import sys

import httpx
import pytest
from agl_trainer.store import RolloutStore

from tests.dataplane.otlp import call_span, request, reward_span, rollout_span
from tests.dataplane.processes import AGL, URL_LINE, start_rotel
from tests.support.waiting import wait_until

GRPC_LINE = re.compile(r"OTLP/gRPC on (\S+)")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_spans_through_rotel_into_agl_receive(tmp_path, protocol):
    import os

    store_path = tmp_path / "rollouts.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONUNBUFFERED": "1"}
    receiver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            AGL,
            "receive",
            "--store",
            str(store_path),
            "--listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    collector = None
    try:
        http_url = URL_LINE.search(receiver.stdout.readline()).group(1)
        grpc_address = GRPC_LINE.search(receiver.stdout.readline()).group(1)
        target = f"http://{grpc_address}" if protocol == "grpc" else http_url
        collector, http_port, _ = start_rotel(tmp_path, target, protocol)
        prompt = list(range(1000, 5000))  # a long prompt: thousands of AnyValues through the collector
        spans = [
            call_span("via-rotel", 0, prompt, [7, 8, 9]),
            call_span("via-rotel", 1, prompt + [7, 8, 9, 10], [11]),
            reward_span("via-rotel", 1.0),
            rollout_span("via-rotel"),
        ]
        body = gzip.compress(request(spans).SerializeToString())
        reply = httpx.post(
            f"http://127.0.0.1:{http_port}/v1/traces",
            content=body,
            timeout=30,
            headers={"content-type": "application/x-protobuf", "content-encoding": "gzip"},
        )
        assert reply.status_code == 200

        def stored() -> bool:
            with RolloutStore(store_path) as store:
                return len(store.span_ids()) == 4

        wait_until(stored, "the collector's export to be stored", timeout=60.0)
        with RolloutStore(store_path, grace_s=0.0) as store:
            data = store.load("via-rotel")
            assert [call.prompt_ids.tolist() for call in data.calls] == [prompt, prompt + [7, 8, 9, 10]]
            assert [r.rollout_id for r in store.ready_rollouts()] == ["via-rotel"]
    finally:
        if collector is not None:
            collector.terminate()
            collector.wait(10)
        receiver.send_signal(signal.SIGTERM)
        out, _ = receiver.communicate(timeout=30)
    assert receiver.returncode == 0 and "4 spans stored" in out
