"""The trainer's receiver SIGKILLed while the sidecar exports to it: once it is back, every call's
span is stored, each once (the sidecar resends what was not acknowledged; the store ignores a span
it already has)."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

RECEIVER = """
import sys, time
from agl_trainer.receiver import Receiver, ReceiverConfig
with Receiver(sys.argv[1], ReceiverConfig(port=int(sys.argv[2]), grpc_port=0)) as receiver:
    print(receiver.url, flush=True)
    while True:
        time.sleep(3600)
"""
CALLS = 150


def _receiver(store: Path, port: int) -> tuple[subprocess.Popen[str], str]:
    """A receiver process on `port` (0: one it picks) and the URL it reports."""
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(store), str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    assert url.startswith("http://"), url
    return proc, url


def test_receiver_sigkilled_mid_export_loses_and_duplicates_nothing(fake, make_sidecar, tmp_path):
    store = tmp_path / "rollouts.db"
    receiver, url = _receiver(store, 0)
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=url, export_interval_s=0.01)
    done = threading.Event()
    answered: list[int] = []

    def harness() -> None:
        with httpx.Client(timeout=30) as client:
            for i in range(CALLS):
                body = {"model": "tiny", "messages": [{"role": "user", "content": f"call {i}"}]}
                if client.post(f"{sidecar.url}/rollouts/k{i % 10}/v1/chat/completions", json=body).status_code == 200:
                    answered.append(i)
                time.sleep(0.002)
        done.set()

    thread = threading.Thread(target=harness)
    thread.start()
    try:
        while len(answered) < CALLS // 3:
            time.sleep(0.005)
        receiver.send_signal(signal.SIGKILL)  # mid-export: requests are in flight or about to be
        receiver.wait(10)
        time.sleep(0.3)
        receiver, _ = _receiver(store, int(url.rsplit(":", 1)[1]))  # back on the port the sidecar sends to
        thread.join(60)
        assert done.is_set() and len(answered) == CALLS
        state = httpx.post(f"{sidecar.url}/agl/v1/pause", json={"drain": True, "timeout_s": 30}).json()
        assert state["spans_flushed"] is True
        with sqlite3.connect(store) as db:
            rows = db.execute("select rollout_id, call_seq from calls").fetchall()
        assert len(rows) == CALLS and len(set(rows)) == CALLS
    finally:
        receiver.kill()
        receiver.wait(10)
