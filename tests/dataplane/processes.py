"""`agl receive` as a child process, the way an operator runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

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
