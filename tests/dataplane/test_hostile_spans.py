"""The receiver against senders that spell OTLP/HTTP otherwise or break HTTP itself."""

from __future__ import annotations

import gzip
import logging
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from tests.dataplane.otlp import call_span, request


def _raw(url: str, data: bytes) -> bytes:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as conn:
        conn.sendall(data)
        out = b""
        while chunk := conn.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # request line over aiohttp's 8190
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\nContent-Length: 0\r\n\r\n",
        b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    ],
)
def test_malformed_http_is_a_400_and_a_warning_not_a_traceback(receiver, caplog, request_bytes):
    # Before: aiohttp logged each as an ERROR with a traceback, the sender's fault in the trainer's log.
    with caplog.at_level(logging.WARNING, logger="aiohttp.server"):
        answer = _raw(receiver.url, request_bytes)
    assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n", 1)[0]
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records and all(r.levelno == logging.WARNING and r.exc_info is None for r in records)
    assert "refused, 400" in records[0].getMessage()


def test_x_gzip_is_gzip(receiver, store):
    body = request([call_span("r-xgzip", 0, [1, 2], [3])]).SerializeToString()
    answer = httpx.post(
        receiver.url.rstrip("/") + "/v1/traces",
        content=gzip.compress(body),
        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "x-gzip"},
    )
    assert answer.status_code == 200, answer.text
    assert [call.completion_ids.tolist() for call in store.load("r-xgzip").calls] == [[3]]
