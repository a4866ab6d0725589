"""A real `agl-sidecar` process for fault tests (signals, shared spool directories)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.support.waiting import wait_until


class SidecarProcess:
    def __init__(
        self, *args: str, log_path: str, env: dict[str, str] | None = None, file_size_limit: int | None = None
    ) -> None:
        self.args = [sys.executable, "-m", "agl_sidecar.cli", "--listen", "127.0.0.1:0", *args]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = log_path  # output goes to a file: a pipe nobody drains would block the sidecar
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._offset = 0
        self.file_size_limit = file_size_limit  # RLIMIT_FSIZE: a disk that fills up, for this process only

    def start(self, timeout: float = 30.0) -> SidecarProcess:
        with open(self.log_path, "ab") as log:
            self._offset = log.tell()  # this run's output starts here
            self.proc = subprocess.Popen(
                self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=self._limits
            )
        proc = self.proc
        try:
            wait_until(lambda: self._ready_url() or proc.poll() is not None, "the ready line", timeout)
        except AssertionError:
            pass  # reported below, with the sidecar's output
        if not self.url:
            self.kill()
            raise AssertionError("the sidecar did not start:\n" + self.output())
        return self

    def _ready_url(self) -> bool:
        """Whether the ready line is out (its URL then in self.url)."""
        for line in self.output().splitlines():
            if line.startswith("agl-sidecar listening on "):
                self.url = line.split()[-1].strip()
                return True
        return False

    def _limits(self) -> None:
        if self.file_size_limit is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_size_limit, self.file_size_limit))

    def output(self) -> str:
        """This run's output so far."""
        with open(self.log_path, "rb") as log:
            log.seek(self._offset)
            return log.read().decode(errors="replace")

    def signal(self, sig: int, timeout: float = 30.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGTERM)
