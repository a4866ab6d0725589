"""`agl receive` as a child process, the way an operator runs it."""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

URL_LINE = re.compile(r"OTLP/HTTP on (http://\S+)/v1/traces")
GRPC_LINE = re.compile(r"OTLP/gRPC on (\S+)")


AGL = "import sys; from agl_trainer.cli import main; sys.exit(main())"


def start_receiver(store: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONUNBUFFERED": "1"}
    log = open(store.with_suffix(".log"), "a")  # noqa: SIM115 (the child owns it)
    process = subprocess.Popen(
        [sys.executable, "-c", AGL, "receive", "--store", str(store), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )
    log.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            raise AssertionError(f"agl receive exited: {store.with_suffix('.log').read_text()}")
        found = URL_LINE.search(line)
        if found:
            return process, found.group(1)
    process.kill()
    raise AssertionError("agl receive did not print its URL")


ROTEL = Path(sys.executable).parent.parent / "lib" / "python3.11" / "site-packages" / "rotel" / "rotel-agent"


class Collector(NamedTuple):
    process: subprocess.Popen
    http_port: int  # OTLP/HTTP in
    grpc_port: int  # OTLP/gRPC in


def start_rotel(log_dir: Path, target: str, protocol: str, *extra: str) -> Collector:
    """A real OpenTelemetry collector (rotel-agent) exporting the traces and logs it takes (OTLP/HTTP
    and gRPC, on the ports it returns) to `target` over `protocol` (grpc or http); `extra` are more
    rotel flags. Returned once it listens on both ports."""
    import socket

    from tests.support.ports import free_port
    from tests.support.waiting import wait_until

    http_port, grpc_port = free_port(), free_port()
    log_path = log_dir / "rotel.log"
    log = open(log_path, "wb")  # noqa: SIM115 (the child writes it)
    collector = subprocess.Popen(
        [str(ROTEL), "start", "--otlp-http-endpoint", f"127.0.0.1:{http_port}", "--otlp-grpc-endpoint",
         f"127.0.0.1:{grpc_port}", "--exporter", "otlp", "--otlp-exporter-endpoint", target,
         "--otlp-exporter-protocol", protocol, "--batch-timeout", "50ms", *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()

    def listening() -> bool:
        assert collector.poll() is None, log_path.read_text()
        try:
            for port in (http_port, grpc_port):
                socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            return False

    try:
        wait_until(listening, "rotel-agent to listen", timeout=60.0)
    except BaseException:
        collector.kill()
        raise
    return Collector(collector, http_port, grpc_port)


@dataclass
class BehindRotel:
    """`agl receive` with a real collector in front of it, as `receive_behind_rotel` runs them."""

    store: Path
    collector_port: int = 0  # the collector's OTLP/HTTP port: send here
    output: str = ""  # the receiver's output and exit code, once it has stopped
    returncode: int | None = None

    def post_traces(self, body: bytes, *, gzipped: bool = False) -> None:
        """An OTLP/HTTP protobuf export request to the collector, which takes it."""
        import httpx

        headers = {"content-type": "application/x-protobuf"}
        if gzipped:
            body, headers["content-encoding"] = gzip.compress(body), "gzip"
        url = f"http://127.0.0.1:{self.collector_port}/v1/traces"
        assert httpx.post(url, content=body, timeout=30, headers=headers).status_code == 200

    def wait_stored(self, spans: int) -> None:
        """Until the store holds `spans` spans (the collector batches and exports on its own time)."""
        from agl_trainer.store import RolloutStore

        from tests.support.waiting import wait_until

        def stored() -> bool:
            with RolloutStore(self.store) as store:
                return len(store.span_ids()) == spans

        wait_until(stored, "the collector's exports to be stored", timeout=60.0)


@contextlib.contextmanager
def receive_behind_rotel(tmp_path: Path, protocol: str) -> Iterator[BehindRotel]:
    """`agl receive` (OTLP/HTTP and gRPC) on a store in `tmp_path`, and rotel-agent exporting to it
    over `protocol` (grpc or http). Both are stopped on the way out, the receiver by SIGTERM."""
    running = BehindRotel(tmp_path / "rollouts.db")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-c", AGL, "receive", "--store", str(running.store), "--listen", "127.0.0.1:0",
            "--grpc-listen", "127.0.0.1:0"]  # fmt: skip
    receiver = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    collector = None
    try:
        http_url = URL_LINE.search(receiver.stdout.readline()).group(1)  # type: ignore[union-attr]
        grpc_address = GRPC_LINE.search(receiver.stdout.readline()).group(1)  # type: ignore[union-attr]
        target = f"http://{grpc_address}" if protocol == "grpc" else http_url
        collector = start_rotel(tmp_path, target, protocol)
        running.collector_port = collector.http_port
        yield running
    finally:
        if collector is not None:
            collector.process.terminate()
            collector.process.wait(10)
        receiver.send_signal(signal.SIGTERM)
        running.output, _ = receiver.communicate(timeout=30)
        running.returncode = receiver.returncode
