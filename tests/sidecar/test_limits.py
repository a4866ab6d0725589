"""Memory and descriptors bounded by the limits: a compressed body is inflated only up to
--max-body-bytes, a resume's engine_progress is bounded, and half-sent requests are dropped after
the header / body timeouts (a slow client cannot hold descriptors until harness calls fail)."""

from __future__ import annotations

import gzip
import resource
import socket
import threading
import zlib

import httpx
import pytest

from agl import semconv
from agl_sidecar.calls.switches import MAX_LOG_PROGRESS, SwitchLog
from tests.sidecar.sidecar_process import SidecarProcess
from tests.support.waiting import wait_until

MESSAGES = [{"role": "user", "content": "go"}]
MIB = 1024 * 1024


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _bomb(inflated: int) -> bytes:
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    block = b" " * MIB  # whitespace: valid JSON padding once inflated
    parts = [compressor.compress(b'{"model": "tiny", "messages": [], "pad": "')]
    parts += [compressor.compress(block) for _ in range(inflated // MIB)]
    parts.append(compressor.compress(b'"}') + compressor.flush())
    return b"".join(parts)


@pytest.mark.slow
def test_gzip_bodies_are_inflated_only_up_to_the_limit(fake, tmp_path):
    limit = 8 * MIB
    bomb = _bomb(256 * MIB)  # about 250 KB on the wire
    assert gzip.decompress(bomb)[:9] == b'{"model":'
    args = ["--upstream", fake.base_url, "--spool-dir", str(tmp_path / "spool"), "--max-body-bytes", str(limit)]
    with SidecarProcess(*args, log_path=str(tmp_path / "sidecar.log")) as sidecar:
        assert sidecar.proc is not None
        before = _peak_rss_bytes(sidecar.proc.pid)
        answers: list[httpx.Response] = []

        def send() -> None:
            headers = {"content-encoding": "gzip", "content-type": "application/json"}
            answers.append(httpx.post(f"{sidecar.url}/v1/chat/completions", content=bomb, headers=headers, timeout=60))

        threads = [threading.Thread(target=send) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        grown = _peak_rss_bytes(sidecar.proc.pid) - before
        assert [a.status_code for a in answers] == [413] * 6
        message = answers[0].json()["error"]["message"]
        assert str(limit) in message and "--max-body-bytes" in message and "decompressed" in message
        # Six bodies held at most up to the limit each (and some slack for the allocator), never
        # inflated whole: the control (no bound on inflation) peaks at several times this.
        assert grown < 6 * limit * 1.5, f"peak RSS grew {grown / MIB:.0f} MiB"
        ok = httpx.post(f"{sidecar.url}/v1/chat/completions", content=gzip.compress(
            b'{"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2}'),
            headers={"content-encoding": "gzip", "content-type": "application/json"}, timeout=60)  # fmt: skip
        assert ok.status_code == 200  # a small compressed body still works


def test_engine_progress_is_bounded_naming_it(fake, make_sidecar):
    sidecar = make_sidecar(upstream=[fake.base_url])
    admin = httpx.Client(base_url=sidecar.url, timeout=60)
    admin.post(semconv.ADMIN_PAUSE_PATH, json={"mode": "keep"})
    many = {f"chatcmpl-{i}": 1 for i in range(70_000)}
    refused = admin.post(semconv.ADMIN_RESUME_PATH, json={"policy_version": 1, "switch": True, "engine_progress": many})
    assert refused.status_code == 400 and "engine_progress" in refused.json()["error"]
    long_id = {"x" * 300: 1}
    refused = admin.post(semconv.ADMIN_RESUME_PATH, json={"policy_version": 1, "switch": True, "engine_progress": long_id})
    assert refused.status_code == 400 and "engine_progress" in refused.json()["error"]
    assert admin.get(semconv.ADMIN_STATE_PATH).json()["policy_version"] == 0  # nothing applied
    fine = {f"chatcmpl-{i}": 1 for i in range(1000)}
    assert admin.post(semconv.ADMIN_RESUME_PATH, json={"policy_version": 1, "switch": True, "engine_progress": fine}).status_code == 200


def test_the_switch_log_keeps_a_bounded_number_of_progress_entries():
    log = SwitchLog()
    per_switch = MAX_LOG_PROGRESS // 4
    for version in range(1, 11):
        log.record(version, {f"r{version}-{i}": i for i in range(per_switch)})
    switches = log.since(0)
    assert sum(len(s.progress or {}) for s in switches) <= MAX_LOG_PROGRESS
    assert switches[-1].progress is not None and len(switches[-1].progress) == per_switch  # the newest kept
    assert switches[0].progress is None  # the oldest: no word any more (its boundary falls back to the stream)


def _fd_limit(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return apply


def test_slow_clients_are_dropped_and_harness_calls_go_through(fake, tmp_path):
    """Half-sent requests under a 96-descriptor limit: 120 connections that never finish their
    headers, and one that stops half-way through its body. Once the timeouts drop them, a harness
    call is served."""
    args = ["--upstream", fake.base_url, "--spool-dir", str(tmp_path / "spool")]
    env = {"AGL_SIDECAR_HEADER_TIMEOUT_S": "2", "AGL_SIDECAR_BODY_TIMEOUT_S": "2"}
    sidecar = SidecarProcess(*args, log_path=str(tmp_path / "sidecar.log"), env=env)
    sidecar._limits = _fd_limit(96)  # type: ignore[method-assign]
    host, port = sidecar.start().url.removeprefix("http://").split(":")
    slow: list[socket.socket] = []
    try:
        body_stall = socket.create_connection((host, int(port)), timeout=60)
        body_stall.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 1000\r\n\r\n{\"model\": ")  # fmt: skip
        for _ in range(120):
            conn = socket.create_connection((host, int(port)), timeout=60)
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            slow.append(conn)
        answer = body_stall.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"body_timeout_s" in answer
        for conn in slow:  # each is closed by the sidecar, unanswered (b""; a reset is a close too)
            try:
                assert conn.recv(1024) == b""
            except ConnectionResetError:
                pass
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
        assert httpx.post(f"{sidecar.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        wait_until(lambda: sidecar.proc is not None and sidecar.proc.poll() is None, "the sidecar alive")
    finally:
        for conn in slow:
            conn.close()
        sidecar.kill()
