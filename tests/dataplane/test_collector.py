"""A real OpenTelemetry collector (rotel-agent) between the sender and `agl receive`, over gRPC and HTTP."""

from __future__ import annotations

import gzip
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from agl_trainer.store import RolloutStore

from tests.dataplane.otlp import call_span, request, reward_span, rollout_span
from tests.dataplane.processes import AGL, URL_LINE
from tests.support.ports import free_port
from tests.support.waiting import wait_until

ROTEL = Path(sys.executable).parent.parent / "lib" / "python3.11" / "site-packages" / "rotel" / "rotel-agent"
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
        http_port = free_port()
        target = f"http://{grpc_address}" if protocol == "grpc" else http_url
        log = open(tmp_path / "rotel.log", "wb")  # noqa: SIM115 (the child writes it)
        collector = subprocess.Popen(
            [
                str(ROTEL),
                "start",
                "--otlp-http-endpoint",
                f"127.0.0.1:{http_port}",
                "--otlp-grpc-endpoint",
                f"127.0.0.1:{free_port()}",
                "--exporter",
                "otlp",
                "--otlp-exporter-endpoint",
                target,
                "--otlp-exporter-protocol",
                protocol,
                "--batch-timeout",
                "50ms",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

        def collector_up() -> bool:
            assert collector.poll() is None, (tmp_path / "rotel.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", http_port), 0.2).close()
                return True
            except OSError:
                return False

        wait_until(collector_up, "rotel-agent to listen", timeout=60.0)
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
