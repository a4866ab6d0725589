"""The protocol-adapter seam: a tiny adapter defined here, mounted like the real ones."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from agl import semconv
from agl_sidecar.protocols import registry
from agl_sidecar.protocols.base import ProtocolError, Translation
from agl_testing.fake_vllm import chat_prompt_ids


class _Translator:
    def __init__(self) -> None:
        self.text = ""

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        out = []
        for choice in chunk.get("choices", []):
            assert "token_ids" not in choice or choice["token_ids"] is None  # stripped before the adapter
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece:
                self.text += piece
                out.append(b"event: piece\ndata: " + json.dumps({"p": piece}).encode() + b"\n\n")
        return out

    def finish(self) -> list[bytes]:
        return [b"event: done\ndata: " + json.dumps({"text": self.text}).encode() + b"\n\n"]


class EchoAdapter:
    """Speaks {"say": "..."} -> {"reply": "..."}."""

    api = "test.echo"
    path = "/echo"
    tokenize_only = False
    prepared_on: list[str] = []

    def prepare(self) -> None:
        import threading

        self.prepared_on.append(threading.current_thread().name)

    def to_chat_request(self, body: dict[str, Any]) -> Translation:
        if not isinstance(body.get("say"), str):
            raise ProtocolError(422, "'say' must be a string", "bad_say")
        chat = {"model": "tiny", "messages": [{"role": "user", "content": body["say"]}], "stream": bool(body.get("stream"))}
        return Translation(chat, dropped=tuple(f"{key}: unknown to the echo API" for key in body if key not in ("say", "stream")))

    def from_chat_response(self, chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        if "tokens" in chat:
            return {"count": chat["count"]}
        return {"reply": chat["choices"][0]["message"]["content"], "had_token_ids": chat.get("prompt_token_ids") is not None}

    def stream_translator(self, body: dict[str, Any]) -> _Translator:
        return _Translator()

    def error_body(self, status: int, message: str, error_type: str) -> dict[str, Any]:
        return {"kind": "error", "error": {"type": error_type, "message": message}}


class CountAdapter(EchoAdapter):
    path = "/echo/count"
    tokenize_only = True


ECHO = EchoAdapter()
COUNT = CountAdapter()


@pytest.fixture
def echo_adapters():
    added = {"/echo": f"{__name__}:ECHO", "/echo/count": f"{__name__}:COUNT"}
    registry.ADAPTERS.update(added)
    registry.clear_caches()
    yield
    for key in added:
        registry.ADAPTERS.pop(key)
    registry.clear_caches()


def test_adapter_unary_stream_tokenize_and_errors(echo_adapters, fake, make_sidecar, otlp_sink):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    url = sidecar.url + "/rollouts/ad/v1/echo"
    reply = httpx.post(url, json={"say": "hello"}).json()
    direct = httpx.post(fake.base_url + "/v1/chat/completions",
                        json={"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}).json()
    assert reply == {"reply": direct["choices"][0]["message"]["content"], "had_token_ids": False}

    streamed = httpx.post(url, json={"say": "hello", "stream": True}).text
    assert streamed.endswith("event: done\ndata: " + json.dumps({"text": reply["reply"]}) + "\n\n")

    assert httpx.post(sidecar.url + "/v1/echo/count", json={"say": "hello"}).json() == {
        "count": len(chat_prompt_ids([{"role": "user", "content": "hello"}]))
    }
    bad = httpx.post(url, json={"say": 3})
    assert bad.status_code == 422 and bad.json() == {"kind": "error", "error": {"type": "bad_say", "message": "'say' must be a string"}}
    malformed = httpx.post(url, content=b"{nope")
    assert malformed.status_code == 400 and malformed.json()["kind"] == "error"

    # Each of the two adapters was prepared (its imports) once, off the event loop's thread.
    assert len(ECHO.prepared_on) == 2 and "agl-sidecar" not in ECHO.prepared_on

    spans = otlp_sink.wait_for(lambda spans: len(spans) >= 2)
    assert len(spans) == 2  # the tokenize-only call records no span
    for span in spans:
        assert span.attributes[semconv.CALL_API] == "test.echo"
        assert span.attributes[semconv.ROLLOUT_ID] == "ad"
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] == chat_prompt_ids([{"role": "user", "content": "hello"}])


def test_the_span_records_what_the_adapter_dropped_and_a_plain_call_records_nothing(
    echo_adapters, fake, make_sidecar, otlp_sink
):
    sidecar = make_sidecar(upstream=[fake.base_url], otlp_endpoint=otlp_sink.endpoint)
    reply = httpx.post(sidecar.url + "/rollouts/f1/v1/echo", json={"say": "hi", "mood": "x", "zeal": 1})
    assert reply.status_code == 200
    plain = httpx.post(sidecar.url + "/rollouts/f2/v1/chat/completions",
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "mood": "x"})
    assert plain.status_code == 200
    spans = {s.attributes[semconv.ROLLOUT_ID]: s for s in otlp_sink.wait_for(lambda spans: len(spans) >= 2)}
    assert spans["f1"].attributes[semconv.REQUEST_FIELDS_DROPPED] == [
        "mood: unknown to the echo API", "zeal: unknown to the echo API"
    ]
    assert semconv.REQUEST_FIELDS_PASSED not in spans["f1"].attributes
    # A chat body goes to the engine as sent: nothing is read as unknown, so nothing is listed.
    assert semconv.REQUEST_FIELDS_DROPPED not in spans["f2"].attributes
    assert semconv.REQUEST_FIELDS_PASSED not in spans["f2"].attributes


class SlowImportAdapter(EchoAdapter):
    """An adapter whose first-use imports (prepare) last until the test lets them finish."""

    path = "/echo/slow"
    entered = threading.Event()
    release = threading.Event()

    def prepare(self) -> None:
        self.entered.set()
        assert self.release.wait(120), "the test never released the import"


SLOW = SlowImportAdapter()


def test_the_first_translated_call_does_not_stall_other_calls(fake, make_sidecar):
    """A translated API's first call imports its adapter (litellm: seconds of CPU) in a worker
    thread, so chat calls arriving meanwhile are served, not held until it is done. The import here
    lasts exactly until every chat call has been answered: were it on the event loop, they would
    wait for it, and it for them (the client's timeout then fails the test)."""
    registry.ADAPTERS["/echo/slow"] = f"{__name__}:SLOW"
    registry.clear_caches()
    try:
        sidecar = make_sidecar(upstream=[fake.base_url])
        translated: dict[str, httpx.Response] = {}
        first = threading.Thread(target=lambda: translated.setdefault(
            "reply", httpx.post(sidecar.url + "/v1/echo/slow", json={"say": "hi"}, timeout=120)))
        first.start()
        assert SLOW.entered.wait(60), "the translated call never started its import"
        for _ in range(3):
            reply = httpx.post(sidecar.url + "/v1/chat/completions", timeout=30, json={
                "model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
            assert reply.status_code == 200
        assert first.is_alive()  # the import is still under way: the chat calls did not wait for it
        SLOW.release.set()
        first.join(120)
        assert translated["reply"].status_code == 200, translated["reply"].text
        assert translated["reply"].json()["reply"]
    finally:
        SLOW.release.set()
        registry.ADAPTERS.pop("/echo/slow")
        registry.clear_caches()
