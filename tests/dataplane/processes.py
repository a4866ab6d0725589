"""`agl receive` as a child process, the way an operator runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

URL_LINE = re.compile(r"OTLP/HTTP on (http://\S+)/v1/traces")


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
