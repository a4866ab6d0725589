"""An engine that closes an idle keep-alive connection just as the sidecar reuses it (vLLM's
keep-alive is 5 s): the call is resent on a fresh connection, and the harness sees no error."""

from __future__ import annotations

import json
import socket
import threading

import httpx


REPLY = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "tiny",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop", "token_ids": [9, 2]}
    ],
    "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2},
    "prompt_token_ids": [1, 5, 6],
}


class DroppingEngine:
    """Answers the first request on each connection, then closes it when the next one arrives,
    without answering: what a server does when its keep-alive ran out as the request was sent."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.answered = 0
        self.dropped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            first = True
            while True:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(65536)
                    if not data:
                        return
                    head += data
                if not first:
                    self.dropped += 1
                    return  # close without an answer
                headers, _, body = head.partition(b"\r\n\r\n")
                lengths = [line.split(b":")[1] for line in headers.split(b"\r\n")
                           if line.lower().startswith(b"content-length")]  # fmt: skip
                length = int(lengths[0]) if lengths else 0  # a GET (the health check) has none
                while len(body) < length:
                    body += conn.recv(65536)
                payload = json.dumps(REPLY).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: keep-alive\r\n"
                    + f"content-length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                self.answered += head.startswith(b"POST")  # the calls, not the health probes
                first = False

    def close(self) -> None:
        self.server.close()


def test_a_stale_pooled_connection_is_retried_not_failed(make_sidecar) -> None:
    engine = DroppingEngine()
    try:
        sidecar = make_sidecar(upstream=[engine.url])
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(3):  # every call after the first reuses a connection the engine drops
            response = httpx.post(f"{sidecar.url}/v1/chat/completions", json=body, timeout=10)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] == "ok"
        assert engine.answered == 3
        assert engine.dropped >= 1
    finally:
        engine.close()
