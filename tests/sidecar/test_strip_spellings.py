"""The fields the sidecar injects (token IDs, logprobs) are stripped from what the harness receives
whatever the engine's JSON spelling: vLLM's own bytes take the byte-splice fast path; the same values
spelled as another server, version or proxy writes them (spaces, pretty-printing, escaped key names,
another key order; SSE with CRLF, `data:` without a space, JSON over several `data:` lines) take the
slow path. Both give the harness the same JSON and record the same tokens."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest

from agl import semconv
from agl_sidecar.calls.attribution import Identity
from agl_sidecar.proxy.recording import StreamRecorder, record_unary
from agl_sidecar.proxy.request import CHAT, COMPLETIONS, Flags
from agl_sidecar.calls.record import CallRecord
from agl_sidecar.calls.wire import chat_request, completion_request
from agl_testing.fake_vllm import FakeVLLM, Reply, capture, sse_events


def _reversed_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _reversed_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed_keys(v) for v in value]
    return value


def _escaped_keys(text: bytes) -> bytes:
    return text.replace(b'"token_ids":', b'"token\\u005fids":').replace(b'"logprobs":', b'"log\\u0070robs":')


def _delta_after_logprobs(raw: bytes) -> bytes:
    """vLLM's compact spelling with `delta` moved between `logprobs` and `finish_reason`, where the
    fast path's end marker for logprobs would take it along."""
    data = json.loads(raw)
    for i, choice in enumerate(data.get("choices", [])):
        first = {k: choice[k] for k in ("index", "logprobs", "delta") if k in choice}
        data["choices"][i] = {**first, **{k: v for k, v in choice.items() if k not in first}}
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


SPELLINGS: dict[str, Callable[[bytes], bytes]] = {
    "delta_after_logprobs": _delta_after_logprobs,
    "vllm": lambda raw: raw,
    "spaces": lambda raw: json.dumps(json.loads(raw), ensure_ascii=False).encode(),
    "pretty": lambda raw: json.dumps(json.loads(raw), ensure_ascii=False, indent=2).encode(),
    "escaped_keys": _escaped_keys,
    "key_order": lambda raw: json.dumps(_reversed_keys(json.loads(raw)), separators=(",", ":")).encode(),
    "ascii_escapes": lambda raw: json.dumps(json.loads(raw), separators=(",", ":"), ensure_ascii=True).encode(),
}


def _stripped(original: dict[str, Any], token_ids: bool, logprobs: bool) -> dict[str, Any]:
    """What the harness must receive: the engine's JSON with the fields it did not ask for nulled."""
    out = json.loads(json.dumps(original))
    if not token_ids and out.get("prompt_token_ids") is not None:
        out["prompt_token_ids"] = None
    for choice in out.get("choices", []):
        for key in ("token_ids", "prompt_token_ids") if not token_ids else ():
            if choice.get(key) is not None:
                choice[key] = None
        if not logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
    return out


def _ints(value: Any) -> list[int] | None:
    if value is None or isinstance(value, list):
        return value
    return msgspec.json.decode(bytes(value))


def _flags(kind: str, asked: dict[str, Any]) -> Flags:
    if kind == CHAT:
        return Flags(CHAT, chat_request.decode(json.dumps({"messages": [], **asked})))
    return Flags(COMPLETIONS, completion_request.decode(json.dumps({"prompt": "x", **asked})))


def _call() -> CallRecord:
    return CallRecord(api="a", operation="chat", identity=Identity(), trace_parent=None, start_ns=0)


UNARY = [
    (CHAT, "chat_nonstream_token_ids_logprobs.json"),
    (CHAT, "chat_nonstream_n2_token_ids.json"),
    (COMPLETIONS, "completions_nonstream_token_ids_logprobs.json"),
    (COMPLETIONS, "completions_nonstream_batch_two_prompts.json"),
]
ASKED = [{}, {"return_token_ids": True}, {"logprobs": True}]


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize(("kind", "name"), UNARY)
@pytest.mark.parametrize("asked", ASKED)
def test_unary_response_is_stripped_and_recorded_whatever_its_spelling(kind, name, spelling, asked):
    if kind == COMPLETIONS and asked.get("logprobs") is True:
        asked = {"logprobs": 1}
    raw = capture(name)
    original = json.loads(raw)
    flags = _flags(kind, asked)
    call = _call()
    out = record_unary(kind, SPELLINGS[spelling](raw), flags, call, False)
    assert json.loads(out) == _stripped(original, flags.token_ids, flags.logprobs)
    first = original["choices"][0]
    prompt = original.get("prompt_token_ids") if kind == CHAT else first.get("prompt_token_ids")
    assert _ints(call.prompt_ids) == prompt
    for choice in original["choices"]:
        assert _ints(call.choices[choice["index"]].token_ids) == choice.get("token_ids")


STREAMS = [
    (CHAT, "chat_stream_token_ids_logprobs.sse"),
    (CHAT, "chat_stream_n2_token_ids.sse"),
    (CHAT, "chat_stream_token_ids_logprobs_usage.sse"),
    (COMPLETIONS, "completions_stream_token_ids_logprobs.sse"),
    (COMPLETIONS, "completions_stream_batch_two_prompts.sse"),
]


def _chunks(name: str) -> list[bytes]:
    return [event.strip()[6:] for event in sse_events(name) if event.strip() != b"data: [DONE]"]


def _expected_tokens(kind: str, chunks: list[dict[str, Any]]) -> tuple[list[int] | None, dict[int, list[int]]]:
    prompt = None
    completions: dict[int, list[int]] = {}
    for chunk in chunks:
        if kind == CHAT and prompt is None and chunk.get("prompt_token_ids") is not None:
            prompt = chunk["prompt_token_ids"]
        for choice in chunk["choices"]:
            if kind == COMPLETIONS and prompt is None and choice["index"] == 0 and choice.get("prompt_token_ids"):
                prompt = choice["prompt_token_ids"]
            completions.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
    return prompt, completions


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize(("kind", "name"), STREAMS)
def test_stream_chunks_are_stripped_and_recorded_whatever_their_spelling(kind, name, spelling):
    chunks = _chunks(name)
    flags = _flags(kind, {})
    call = _call()
    recorder = StreamRecorder(kind, flags, call)
    received = []
    for chunk in chunks:
        spelled = SPELLINGS[spelling](chunk)
        if spelling == "pretty":  # JSON over several lines is several data: lines in SSE
            event = b"\n".join(b"data: " + line for line in spelled.split(b"\n"))
        else:
            event = b"data: " + spelled
        out = recorder.event(event)
        assert out.startswith(b"data: ") and b"\n" not in out
        received.append(json.loads(out[6:]))
    originals = [json.loads(c) for c in chunks]
    assert received == [_stripped(c, False, False) for c in originals]
    prompt, completions = _expected_tokens(kind, originals)
    assert _ints(call.prompt_ids) == prompt
    for index, ids in completions.items():
        assert _ints(call.choices[index].token_ids) == ids


# --- through the sidecar: SSE framing as other servers write it ----------------------------------
FRAMINGS: dict[str, Callable[[bytes], bytes]] = {
    "vllm": lambda event: event,
    "crlf": lambda event: event.replace(b"\n", b"\r\n"),
    "cr": lambda event: event.replace(b"\n", b"\r"),
    "no_space": lambda event: event.replace(b"data: ", b"data:"),
    "with_fields": lambda event: b": keep-alive\nevent: message\nid: 7\n" + event,
    "spaced_json": lambda event: b"data: " + SPELLINGS["spaces"](event.strip()[6:]) + b"\n\n"
    if not event.startswith(b"data: [DONE]")
    else event,
}


def _sse_payloads(text: bytes) -> list[bytes]:
    payloads = []
    for event in text.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n\n"):
        data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            payloads.append(b"\n".join(data))
    return payloads


@pytest.mark.parametrize("framing", list(FRAMINGS))
@pytest.mark.parametrize(("kind", "name"), [STREAMS[0], STREAMS[3]])
def test_a_stream_framed_otherwise_reaches_the_harness_stripped_and_the_span_whole(
    kind, name, framing, make_sidecar, otlp_sink
):
    events = sse_events(name)
    # Cut the byte stream at odd places, so a CRLF or an event is split across reads.
    body = b"".join(FRAMINGS[framing](event) for event in events)
    pieces = [body[i : i + 97] for i in range(0, len(body), 97)]
    with FakeVLLM(script=lambda request: Reply(content_type="text/event-stream", chunks=pieces)) as engine:
        sidecar = make_sidecar(upstream=[engine.base_url], otlp_endpoint=otlp_sink.endpoint)
        path = "/rollouts/r/v1/chat/completions" if kind == CHAT else "/rollouts/r/v1/completions"
        request = {"model": "tiny", "stream": True, **({"messages": []} if kind == CHAT else {"prompt": "x"})}
        response = httpx.post(sidecar.url + path, json=request, timeout=30)
        assert response.status_code == 200
        payloads = _sse_payloads(response.content)
        assert payloads[-1] == b"[DONE]"
        originals = [json.loads(c) for c in _chunks(name)]
        assert [json.loads(p) for p in payloads[:-1]] == [_stripped(c, False, False) for c in originals]
        (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
        prompt, completions = _expected_tokens(kind, originals)
        assert span.attributes[semconv.PROMPT_TOKEN_IDS] == prompt
        assert span.attributes[semconv.COMPLETION_TOKEN_IDS] == completions[0]
