"""Managed vLLM server processes: one record per server, its log's tail for errors, and stopping a
server's whole process group (its engine core may outlive the API server)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

LOG_TAIL_LINES = 40


@dataclass
class Server:
    """One replica: where it answers, its log, and (managed) its process and restarts so far."""

    index: int
    port: int
    url: str
    log_path: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0


def log_tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_bytes()[-32_000:].decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])



def terminate(process: subprocess.Popen[bytes] | None, grace_s: float = 30.0) -> None:
    """Stop a server's whole process group: SIGTERM, then SIGKILL after `grace_s`."""
    if process is None:
        return
    pgid = process.pid  # start_new_session made the server its group's leader
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if process.poll() is not None and not group_alive(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if process.poll() is not None and not group_alive(pgid):
                return
            time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def exits_soon(process: subprocess.Popen[bytes], within_s: float = 2.0) -> bool:
    """Whether a replica whose request just failed is dying. A crashed server's sockets are reset
    while it exits, a moment before the process can be reaped: poll() alone would miss it."""
    try:
        process.wait(within_s)
    except subprocess.TimeoutExpired:
        return False
    return True
