"""The receiver's memory and descriptors are bounded by its limits: a gzip body is inflated once,
into one buffer, and refused at the limit; a connection that sends half a request is closed (its
head) or answered 408 (its body) instead of being held forever. Loopback only, bounded load."""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from agl_trainer.receiver import Receiver, ReceiverConfig
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from tests.dataplane.otlp import any_value, call_span, request, reward_span, rollout_span

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def export(url: str, body: bytes, encoding: str | None = None) -> httpx.Response:
    headers = {"content-type": "application/x-protobuf", **({"content-encoding": encoding} if encoding else {})}
    return httpx.post(f"{url}/v1/traces", content=body, headers=headers, timeout=120)


def a_good_batch() -> bytes:
    return request([call_span("ok", 0, [1, 2], [3]), reward_span("ok", 1.0), rollout_span("ok")]).SerializeToString()


def test_half_sent_heads_are_closed_and_half_sent_bodies_are_a_408(tmp_path: Path) -> None:
    # Before: no header or body read timeout; 240 such connections exhausted 256 descriptors.
    config = ReceiverConfig(port=0, header_timeout_s=0.5, body_timeout_s=0.5, durability="normal")
    with Receiver(tmp_path / "t.db", config) as receiver:
        port = int(receiver.url.rsplit(":", 1)[1])
        heads = []
        for _ in range(20):
            client = socket.create_connection(("127.0.0.1", port), timeout=60)
            client.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: appl")
            heads.append(client)
        body = socket.create_connection(("127.0.0.1", port), timeout=60)
        body.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/x-protobuf\r\n"
                     b"content-length: 1000\r\n\r\n0123456789")  # fmt: skip
        for client in heads:
            assert client.recv(1024) == b""  # closed by the receiver, nothing answered
            client.close()
        answer = b""
        while chunk := body.recv(65536):
            answer += chunk
        body.close()
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and "did not all arrive" in json.loads(payload)["message"]
        assert receiver.stats().bad_requests.get("header_timeout") == 20
        assert receiver.stats().bad_requests.get("408_body_timeout") == 1
        assert export(receiver.url, a_good_batch()).status_code == 200  # the receiver goes on
        # a kept-alive connection: its first request answered, then half of a second head
        batch = a_good_batch()
        kept = socket.create_connection(("127.0.0.1", port), timeout=60)
        kept.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/x-protobuf\r\n"
                     b"content-length: %d\r\n\r\n" % len(batch) + batch)  # fmt: skip
        first = kept.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        kept.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        while kept.recv(65536):
            pass  # until the receiver closes it
        kept.close()
        assert receiver.stats().bad_requests.get("header_timeout") == 21


MEASURE = textwrap.dedent(
    """
    import resource, sys, threading, httpx
    sys.path.insert(0, {root!r})
    from agl_trainer.receiver import Receiver, ReceiverConfig
    limit, path, body, copies = {limit}, {path!r}, open({body!r}, 'rb').read(), {copies}
    receiver = Receiver(path, ReceiverConfig(port=0, max_decompressed_bytes=limit, durability='normal')).start()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    codes = []
    def send():
        codes.append(httpx.post(receiver.url + '/v1/traces', content=body, timeout=300, headers={{
            'content-type': 'application/x-protobuf', 'content-encoding': 'gzip'}}).status_code)
    threads = [threading.Thread(target=send) for _ in range(copies)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    receiver.stop()
    print(sorted(codes), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
    """
)


def peak_growth(tmp_path: Path, body: bytes, limit: int, copies: int) -> tuple[list[int], int]:
    """Status codes and the receiver's peak RSS growth (bytes), its own process, gzip bodies sent at once."""
    (tmp_path / "body.gz").write_bytes(body)
    code = MEASURE.format(root=str(ROOT / "trainer"), limit=limit, path=str(tmp_path / "m.db"),
                          body=str(tmp_path / "body.gz"), copies=copies)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    codes, growth = out.stdout.strip().rsplit(" ", 1)
    return json.loads(codes), int(growth)


@pytest.mark.slow
def test_gzip_bodies_are_inflated_once_and_refused_at_the_limit(tmp_path: Path) -> None:
    # Before: one body took 3x its inflated size (zlib's buffer, a join, a slice per string: a 256 MiB
    # limit peaked at 687 MB), and a bomb was inflated to the limit 2.6 times over.
    limit = 64 * MiB
    bomb = gzip.compress(b"\0" * (200 * MiB), 1)  # 200 MiB of zeros in 200 KiB
    codes, growth = peak_growth(tmp_path, bomb, limit, copies=6)
    assert codes == [413] * 6
    assert growth < 1.4 * limit, growth / MiB  # one inflated at a time, to the limit, once
    span = call_span("big", 0, [1, 2], [3])
    span.attributes.append(KeyValue(key="big.blob", value=any_value("a" * (48 * MiB))))
    big = gzip.compress(request([span]).SerializeToString(), 1)
    codes, growth = peak_growth(tmp_path, big, limit, copies=1)
    assert codes == [200]
    assert growth < 2.4 * 48 * MiB, growth / MiB  # the inflated body and the string decoded from it
