"""The spool: where spans wait on disk for their OTLP endpoint, one directory per sidecar.

Layout under `--spool-dir` (default ~/.local/state/agl-sidecar/spool):

    <endpoint key>/            one per OTLP endpoint (host_port-<hash of the URL and protocol>)
        0/ 1/ ...              one slot per live sidecar, held with an exclusive flock on slot/.lock
            <ns>-<pid>-<seq>-<spans>.otlp.gz   ready-to-send requests, replayed oldest first
            <ns>-<pid>-<seq>.wal               durable mode: spans of answered calls not yet settled
        dead-letter/           requests the endpoint refused for good (one span each, or the span
                               set refused together), with a .why.txt beside each; never replayed

Sidecars that share a spool directory never send each other's spans (each endpoint has its own
directory) and never replay the same files (each holds its slot's lock). A slot whose lock is free
belongs to a sidecar that is gone: the next sidecar for the same endpoint adopts its files.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import time
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger("agl_sidecar.spool")

SPOOL_SUFFIX = ".otlp.gz"
WAL_SUFFIX = ".wal"
DEAD_LETTER = "dead-letter"
LOCK = ".lock"
MAX_SLOTS = 1024


def endpoint_key(endpoint: str, protocol: str) -> str:
    """A directory name for an endpoint: readable, and distinct for distinct URLs."""
    parts = urlsplit(endpoint)
    readable = re.sub(r"[^A-Za-z0-9.]+", "_", f"{parts.hostname or 'endpoint'}_{parts.port or ''}").strip("_")
    digest = hashlib.sha256(f"{protocol} {endpoint.rstrip('/')}".encode()).hexdigest()[:10]
    return f"{readable[:60]}-{digest}"


def spans_in_name(path: Path) -> int:
    try:
        return int(path.name[: -len(SPOOL_SUFFIX)].rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def write_atomic(path: Path, payload: bytes) -> None:
    """Write, fsync, rename, fsync the directory: once this returns the file survives a crash."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpoolLocked(RuntimeError):
    """Every slot is held by a live sidecar."""


class Spool:
    """This sidecar's slot of the spool for one endpoint."""

    def __init__(self, root: str | os.PathLike[str], endpoint: str, protocol: str) -> None:
        self.root = Path(root)
        self.endpoint_dir = self.root / endpoint_key(endpoint, protocol)
        self.dead_letter_dir = self.endpoint_dir / DEAD_LETTER
        self.directory = self.endpoint_dir / "0"
        self._lock_fd: int | None = None
        self._seq = 0

    def open(self) -> int:
        """Take a free slot (locked until close) and adopt the files of slots nobody holds; returns
        the number of files adopted."""
        self.endpoint_dir.mkdir(parents=True, exist_ok=True)
        for slot in range(MAX_SLOTS):
            directory = self.endpoint_dir / str(slot)
            fd = _try_lock(directory)
            if fd is not None:
                self.directory, self._lock_fd = directory, fd
                break
        else:
            raise SpoolLocked(f"all {MAX_SLOTS} spool slots under {self.endpoint_dir} are held by live sidecars")
        adopted = self._adopt()
        self._warn_about_legacy_files()
        return adopted

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _adopt(self) -> int:
        adopted = 0
        for other in sorted(self.endpoint_dir.iterdir()):
            if other == self.directory or not other.name.isdigit() or not other.is_dir():
                continue
            fd = _try_lock(other)
            if fd is None:
                continue  # a live sidecar's slot
            try:
                for path in other.iterdir():
                    if path.name.endswith((SPOOL_SUFFIX, WAL_SUFFIX)):
                        os.replace(path, self.directory / path.name)
                        adopted += 1
            finally:
                os.close(fd)
        if adopted:
            fsync_dir(self.directory)
            log.warning("agl-sidecar: adopted %d spool file(s) a stopped sidecar left in %s", adopted, self.endpoint_dir)
        return adopted

    def _warn_about_legacy_files(self) -> None:
        legacy = list(self.root.glob("*" + SPOOL_SUFFIX))
        if legacy:
            log.warning(
                "agl-sidecar: %d spool file(s) directly in %s come from an older sidecar that kept one spool for "
                "every endpoint; they are not replayed (their endpoint is unknown). Move them into %s to send "
                "them to %s", len(legacy), self.root, self.directory, self.endpoint_dir.name,
            )

    # --- files ---------------------------------------------------------------------------------
    def new_name(self, suffix: str, spans: int | None = None) -> Path:
        self._seq += 1
        count = f"-{spans}" if spans is not None else ""
        return self.directory / f"{time.time_ns():020d}-{os.getpid()}-{self._seq:08d}{count}{suffix}"

    def files(self, suffix: str = SPOOL_SUFFIX) -> list[Path]:
        try:
            return sorted(self.directory.glob("*" + suffix))
        except OSError:
            return []

    def bytes(self) -> int:
        total = 0
        for path in self.files():
            try:
                total += path.stat().st_size
            except OSError:
                pass
        return total

    def dead_letter(self, payload: bytes, spans: int, why: str) -> Path:
        """Set a refused request aside (gzip, ready to resend by hand once the cause is fixed)."""
        self.dead_letter_dir.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        path = self.dead_letter_dir / f"{time.time_ns():020d}-{os.getpid()}-{self._seq:08d}-{spans}{SPOOL_SUFFIX}"
        write_atomic(path, payload)
        path.with_name(path.name[: -len(SPOOL_SUFFIX)] + ".why.txt").write_text(why + "\n")
        return path


def _try_lock(directory: Path) -> int | None:
    """An fd holding an exclusive flock on directory/.lock, or None when another process holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
