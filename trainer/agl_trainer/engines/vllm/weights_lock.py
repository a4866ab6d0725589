"""One run at a time in a vLLM engine's `weights_dir`.

The engine writes every weight version and LoRA adapter there, points `lora/current` at the one in
service and deletes the versions it no longer needs; a fresh start points `current` at the empty
adapter. Two runs given one `weights_dir` (a shared filesystem, as several nodes need) would undo
each other: the second's start pointed the first's servers at an empty adapter and deleted its
versions. So the directory is locked for the engine's life: a POSIX record lock (`fcntl.lockf`,
which NFS carries) on `<weights_dir>/.agl-weights.lock`, released by the kernel when the holder
dies, so a crashed run never leaves it locked. The file names the holder, and a second run is
refused with it. Within one process, where POSIX locks do not exclude each other, a set of the
directories held does.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
from pathlib import Path

from agl_trainer.redaction import redact_argv

LOCK_FILE = ".agl-weights.lock"
_held: set[str] = set()  # directories locked by this process
_held_guard = threading.Lock()


class WeightsDirInUse(RuntimeError):
    """Another run holds the weights directory; the message names it and the fix."""


class WeightsDirLock:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        key = str(self.directory.resolve())
        with _held_guard:
            if key in _held:
                raise self._in_use("another engine of this process")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.EACCES, errno.EAGAIN):
                    raise self._in_use(self._holder()) from None
                raise
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(_this_run()) + "\n").encode())
            self._fd = fd
            _held.add(key)

    def release(self) -> None:
        if self._fd is None:
            return
        with _held_guard:
            _held.discard(str(self.directory.resolve()))
            try:
                os.ftruncate(self._fd, 0)
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def _holder(self) -> str:
        try:
            run = json.loads(self.path.read_text())
            return (f"host {run['host']}, pid {run['pid']}, since {run['since']}, running "
                    f"`{' '.join(run['argv'])}` in {run['cwd']}")  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            return "a run that did not say who it is"

    def _in_use(self, holder: str) -> WeightsDirInUse:
        return WeightsDirInUse(
            f"engine weights_dir {self.directory} is in use by another run ({holder}); two runs writing one "
            "weights_dir overwrite each other's weights and adapters (fix: give each run its own weights_dir, "
            "e.g. a subdirectory per run, and start that run's vLLM servers with it; or stop the other run)"
        )


def _this_run() -> dict[str, object]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": redact_argv(sys.argv),  # the holder is shown to other runs: no secrets
        "cwd": os.getcwd(),
    }
