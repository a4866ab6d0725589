"""An engine whose answers are valid but spelled otherwise (IDs as `1.0`, logprobs as Python's `json`
writes them: `NaN`, `-Infinity`, `-1e400`), or that are not what the contract expects (a chunk with
a string for token IDs, an unreadable `data:` line, an error whose message is not a string). The
harness always gets a well-formed answer; the call's span records exactly what the engine generated,
or says its tokens are absent, never a sequence with a gap and never no span at all."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from agl import semconv
from agl_testing.fake_vllm import FakeVLLM, Reply

SSE = "text/event-stream; charset=utf-8"
MESSAGES = [{"role": "user", "content": "hi"}]
LOGPROB = '{"token":"a","logprob":%s,"bytes":[97],"top_logprobs":[]}'


def _chat_body(ids: str, logprobs: list[str]) -> bytes:
    content = ",".join(LOGPROB % value for value in logprobs)
    return (
        '{"id":"c1","object":"chat.completion","created":1,"model":"tiny","choices":[{"index":0,'
        '"message":{"role":"assistant","content":"ab"},"logprobs":{"content":[%s]},"finish_reason":"stop",'
        '"token_ids":%s}],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2},'
        '"prompt_token_ids":[1,2,3]}' % (content, ids)
    ).encode()


def _chunk(ids: str, logprob: str = "-0.5", finish: str = "null", prompt: str | None = None) -> bytes:
    extra = ',"prompt_token_ids":%s' % prompt if prompt else ""
    return (
        'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,'
        '"delta":{"content":"a"},"logprobs":{"content":[%s]},"finish_reason":%s,"token_ids":%s}]%s}\n\n'
        % (LOGPROB % logprob, finish, ids, extra)
    ).encode()


def _stream(*middle: bytes) -> Reply:
    chunks = [_chunk("[5]", prompt="[1,2]"), *middle, _chunk("[7]", finish='"stop"'), b"data: [DONE]\n\n"]
    return Reply(content_type=SSE, chunks=chunks)


@pytest.fixture
def engine() -> Iterator[tuple[FakeVLLM, dict[str, Reply]]]:
    scripted: dict[str, Reply] = {}
    with FakeVLLM(script=lambda request: scripted["reply"]) as server:
        yield server, scripted


def _call(
    engine: tuple[FakeVLLM, dict[str, Reply]], make_sidecar: Callable[..., Any], otlp_sink: Any,
    reply: Reply, **asked: Any,
) -> tuple[str, dict[str, Any]]:
    """(the body the harness received, the call span's attributes)."""
    server, scripted = engine
    scripted["reply"] = reply
    sidecar = make_sidecar(upstream=[server.base_url], otlp_endpoint=otlp_sink.endpoint)
    body = {"model": "tiny", "messages": MESSAGES, "stream": bool(reply.chunks), **asked}
    with httpx.stream("POST", sidecar.url + "/rollouts/r-1/v1/chat/completions", json=body, timeout=10) as answer:
        text = answer.read().decode()  # a 500 written into the chunked body raises here
        assert answer.status_code == 200, text
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    return text, span.attributes


def _events(text: str) -> list[Any]:
    """The stream's `data:` payloads, read as Python's json (the openai SDK's reader) reads them."""
    out = []
    for event in text.split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            out.append(json.loads(event[6:]))
    return out


def _as_list(value: Any) -> list[Any]:
    return [v for v in value]


def test_a_stream_chunk_whose_token_ids_are_not_ints_does_not_break_the_stream(engine, make_sidecar, otlp_sink):
    # Before: an uncaught ValidationError after the status line went out, answered as a 500 inside the
    # chunked body: the harness's client read "illegal chunk header".
    text, attributes = _call(engine, make_sidecar, otlp_sink, _stream(_chunk('"x"')))
    assert text.endswith("data: [DONE]\n\n")
    assert len(_events(text)) == 3
    assert attributes[semconv.TOKENS_SOURCE] == semconv.TOKENS_ABSENT  # not a sequence with a gap
    assert semconv.COMPLETION_TOKEN_IDS not in attributes


def test_an_unreadable_data_event_mid_stream_marks_the_tokens_absent(engine, make_sidecar, otlp_sink):
    # Before: the event passed unread and the span said "engine" tokens [5, 7], missing whatever it held.
    text, attributes = _call(engine, make_sidecar, otlp_sink, _stream(b"data: {not json\n\n"))
    assert "data: {not json\n\n" in text
    assert attributes[semconv.TOKENS_SOURCE] == semconv.TOKENS_ABSENT


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_spelled_as_integral_floats_are_the_same_ids(engine, make_sidecar, otlp_sink, stream):
    reply = _stream(_chunk("[6.0]")) if stream else Reply(body=_chat_body("[5.0,6e0]", ["-0.5", "-0.25"]))
    text, attributes = _call(engine, make_sidecar, otlp_sink, reply)
    assert _as_list(attributes[semconv.COMPLETION_TOKEN_IDS]) == ([5, 6, 7] if stream else [5, 6])
    received = _events(text) if stream else [json.loads(text)]
    assert all(choice["token_ids"] is None for event in received for choice in event["choices"])


@pytest.mark.parametrize("spelling,expected", [("NaN", math.nan), ("-Infinity", -math.inf), ("-1e400", -math.inf)])
def test_logprobs_as_python_json_writes_them_are_recorded_unary(engine, make_sidecar, otlp_sink, spelling, expected):
    # Before: NaN / -Infinity made the whole body unreadable (tokens absent, the injected fields left
    # in the harness's body); -1e400 lost the call's span (the builder raised "Number out of range").
    reply = Reply(body=_chat_body("[5,6]", [spelling, "-0.25"]))
    text, attributes = _call(engine, make_sidecar, otlp_sink, reply)
    assert _as_list(attributes[semconv.COMPLETION_TOKEN_IDS]) == [5, 6]
    first, second = _as_list(attributes[semconv.COMPLETION_LOGPROBS])
    assert (math.isnan(first) if math.isnan(expected) else first == expected) and second == -0.25
    choice = json.loads(text)["choices"][0]
    assert choice["logprobs"] is None and choice["token_ids"] is None  # not asked for: stripped


def test_logprobs_with_nan_in_a_stream_are_recorded_and_reach_a_harness_that_asked(engine, make_sidecar, otlp_sink):
    reply = _stream(_chunk("[6]", logprob="NaN"))
    text, attributes = _call(engine, make_sidecar, otlp_sink, reply, logprobs=True)
    assert _as_list(attributes[semconv.COMPLETION_TOKEN_IDS]) == [5, 6, 7]
    logprobs = _as_list(attributes[semconv.COMPLETION_LOGPROBS])
    assert logprobs[0] == -0.5 and math.isnan(logprobs[1]) and logprobs[2] == -0.5
    events = _events(text)
    assert math.isnan(events[1]["choices"][0]["logprobs"]["content"][0]["logprob"])  # the engine's value
    assert all(event["choices"][0]["token_ids"] is None for event in events)  # not asked for


def test_an_error_chunk_whose_message_is_not_a_string_is_recorded(engine, make_sidecar, otlp_sink):
    text, attributes = _call(engine, make_sidecar, otlp_sink, _stream(b'data: {"error":{"message":{"code":5}}}\n\n'))
    assert attributes[semconv.CALL_END_REASON] == semconv.END_UPSTREAM_ERROR
    assert attributes[semconv.ERROR_TYPE] == "upstream_stream_error"



def test_logprobs_of_the_wrong_type_cost_the_tokens_not_the_span(engine, make_sidecar, otlp_sink):
    # Before: the span builder raised on them and the call's span was lost (no record of the call).
    body = (
        b'{"id":"c1","object":"text_completion","created":1,"model":"tiny","choices":[{"index":0,"text":"ab",'
        b'"logprobs":{"token_logprobs":"x"},"finish_reason":"stop","token_ids":[5,6],"prompt_token_ids":[1,2,3]}]}'
    )
    server, scripted = engine
    scripted["reply"] = Reply(body=body)
    sidecar = make_sidecar(upstream=[server.base_url], otlp_endpoint=otlp_sink.endpoint)
    answer = httpx.post(sidecar.url + "/rollouts/r-1/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert answer.status_code == 200 and answer.json()["choices"][0]["logprobs"] is None
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.CALL_END_REASON] == semconv.END_COMPLETED
    assert span.attributes[semconv.TOKENS_SOURCE] == semconv.TOKENS_ABSENT


def test_logprobs_for_only_some_tokens_leave_the_tokens_recorded(engine, make_sidecar, otlp_sink):
    # A chunk with null logprobs: the span would carry 2 IDs and 1 logprob, which the receiver refuses
    # whole (logprobs_length_mismatch); the IDs are kept and the partial logprobs left out.
    reply = _stream(_chunk("[6]").replace(b'"logprobs":{"content":[' + (LOGPROB % "-0.5").encode() + b"]}", b'"logprobs":null'))
    _, attributes = _call(engine, make_sidecar, otlp_sink, reply)
    assert _as_list(attributes[semconv.COMPLETION_TOKEN_IDS]) == [5, 6, 7]
    assert semconv.COMPLETION_LOGPROBS not in attributes


def test_a_malformed_chunk_does_not_break_a_translated_stream(engine, make_sidecar, otlp_sink):
    # Before: the Anthropic translator raised on `"choices": 5` and the harness's stream was cut.
    server, scripted = engine
    scripted["reply"] = _stream(b'data: {"choices":5}\n\n')
    sidecar = make_sidecar(upstream=[server.base_url], otlp_endpoint=otlp_sink.endpoint)
    body = {"model": "tiny", "max_tokens": 5, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", sidecar.url + "/rollouts/r-1/v1/messages", json=body, timeout=10) as answer:
        text = answer.read().decode()
    types = [json.loads(e.split("data: ", 1)[1])["type"] for e in text.split("\n\n") if "data: " in e]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert "".join(
        json.loads(e.split("data: ", 1)[1])["delta"].get("text", "") for e in text.split("\n\n")
        if "content_block_delta" in e
    ) == "aa"
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.TOKENS_SOURCE] == semconv.TOKENS_ABSENT  # what it held is unknown


def test_json_over_several_data_lines_with_nan_is_recorded(engine, make_sidecar, otlp_sink):
    # Before: the joined lines did not decode (NaN) and the event passed unrecorded: token 6 missing
    # from a span that said its tokens came from the engine.
    pretty = json.dumps(json.loads(_chunk("[6]")[6:].decode().replace("-0.5", "0.5")), indent=1)
    event = ("\n".join("data: " + line for line in pretty.replace("0.5", "NaN").split("\n")) + "\n\n").encode()
    _, attributes = _call(engine, make_sidecar, otlp_sink, _stream(event))
    assert _as_list(attributes[semconv.COMPLETION_TOKEN_IDS]) == [5, 6, 7]
    assert math.isnan(_as_list(attributes[semconv.COMPLETION_LOGPROBS])[1])


def test_two_json_objects_in_one_event_mark_the_tokens_absent(engine, make_sidecar, otlp_sink):
    event = _chunk("[6]").rstrip(b"\n") + b"\n" + _chunk("[8]")
    _, attributes = _call(engine, make_sidecar, otlp_sink, _stream(event))
    assert attributes[semconv.TOKENS_SOURCE] == semconv.TOKENS_ABSENT


@pytest.mark.parametrize("stream", [False, True])
def test_counts_and_indices_spelled_as_floats_are_recorded(engine, make_sidecar, otlp_sink, stream):
    # Before: `"index": 0.0` / `"prompt_tokens": 3.0` failed the typed decode: the call's tokens were
    # marked absent (unary) or the chunk's token went unrecorded (stream).
    if stream:
        reply = _stream(_chunk("[6]").replace(b'"index":0', b'"index":0.0'))
    else:
        body = _chat_body("[5,6]", ["-0.5", "-0.25"]).replace(b'"index":0', b'"index":0.0')
        reply = Reply(body=body.replace(b'"prompt_tokens":3', b'"prompt_tokens":3.0'))
    text, attributes = _call(engine, make_sidecar, otlp_sink, reply)
    assert _as_list(attributes[semconv.COMPLETION_TOKEN_IDS]) == ([5, 6, 7] if stream else [5, 6])
    if not stream:
        assert attributes[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 3
        assert json.loads(text)["choices"][0]["token_ids"] is None  # stripped all the same


@pytest.mark.parametrize("answer", [b"null", b"[1, 2]"])
def test_a_tokenize_answer_that_is_not_an_object_is_a_502_naming_it(engine, make_sidecar, answer):
    # Before: Anthropic count_tokens read keys off it: an AttributeError, a 500 and a traceback.
    server, scripted = engine
    scripted["reply"] = Reply(body=answer)
    sidecar = make_sidecar(upstream=[server.base_url])
    body = {"model": "tiny", "messages": MESSAGES}
    reply = httpx.post(sidecar.url + "/v1/messages/count_tokens", json=body, timeout=30)
    assert reply.status_code == 502
    assert "unreadable body" in reply.json()["error"]["message"]


@pytest.mark.parametrize("index", [b"-1", b"1000000000000", b"1"])
def test_choice_indices_other_than_0_to_n_minus_1_mark_the_tokens_absent(engine, make_sidecar, otlp_sink, index):
    # Before: the span carried `agl.completion.-1.token_ids` (or ...1000000000000...) and no completion 0,
    # with tokens_source "engine": the call stored as one that generated nothing.
    body = _chat_body("[5,6]", ["-0.5", "-0.25"]).replace(b'"index":0', b'"index":' + index)
    text, attributes = _call(engine, make_sidecar, otlp_sink, Reply(body=body))
    assert json.loads(text)["choices"][0]["token_ids"] is None  # still stripped for the harness
    assert attributes[semconv.TOKENS_SOURCE] == semconv.TOKENS_ABSENT
    assert not any(key.startswith("agl.completion.") and key.endswith(".token_ids") for key in attributes)


def test_an_upstream_event_that_never_ends_breaks_the_stream_instead_of_growing_memory(
    engine, make_sidecar, otlp_sink, monkeypatch
):
    # Before: the unfinished event's buffer grew with every read, without bound (the sidecar killed
    # for memory, with every call in flight through it).
    from agl_sidecar.proxy import sse

    monkeypatch.setattr(sse, "MAX_EVENT_BYTES", 64 * 1024)
    server, scripted = engine
    endless = [_chunk("[5]", prompt="[1,2]"), b"data: {" + b" " * 40000] + [b" " * 40000] * 4
    scripted["reply"] = Reply(content_type=SSE, chunks=endless)
    sidecar = make_sidecar(upstream=[server.base_url], otlp_endpoint=otlp_sink.endpoint)
    body = {"model": "tiny", "messages": MESSAGES, "stream": True}
    with pytest.raises(httpx.HTTPError):  # a broken stream, as from an engine that died
        with httpx.stream("POST", sidecar.url + "/rollouts/r-1/v1/chat/completions", json=body, timeout=10) as answer:
            answer.read()
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.ERROR_TYPE] == "upstream_stream_broken"
    assert span.status_code == 2
    assert httpx.get(sidecar.url + "/healthz").status_code == 200


@pytest.mark.parametrize("chunked", [False, True])
def test_an_answer_over_max_response_bytes_is_a_502_not_a_sidecar_grown_without_bound(
    engine, make_sidecar, otlp_sink, chunked
):
    # Before: the whole body was read into memory whatever its size (with or without a length).
    body = _chat_body("[5,6]", ["-0.5", "-0.25"])
    server, scripted = engine
    padded = body[:-1] + b',"padding":"' + b"x" * 300_000 + b'"}'
    scripted["reply"] = Reply(chunks=[padded[i : i + 65536] for i in range(0, len(padded), 65536)]) if chunked else Reply(body=padded)
    sidecar = make_sidecar(upstream=[server.base_url], otlp_endpoint=otlp_sink.endpoint, max_response_bytes=200_000)
    asked = {"model": "tiny", "messages": MESSAGES}
    answer = httpx.post(sidecar.url + "/rollouts/r-1/v1/chat/completions", json=asked, timeout=10)
    assert answer.status_code == 502 and "max_response_bytes" in answer.json()["error"]["message"]
    (span,) = otlp_sink.wait_for(lambda spans: len(spans) >= 1)
    assert span.attributes[semconv.CALL_END_REASON] == semconv.END_UPSTREAM_ERROR
    scripted["reply"] = Reply(body=body)  # an answer within the bound passes as before
    answer = httpx.post(sidecar.url + "/rollouts/r-1/v1/chat/completions", json=asked, timeout=10)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "ab"


def test_max_response_bytes_must_be_positive() -> None:
    from agl_sidecar.config import ConfigError, build

    with pytest.raises(ConfigError, match="max_response_bytes"):
        build({"upstream": ["http://127.0.0.1:1"], "max_response_bytes": 0})


def test_a_stream_that_opens_with_a_utf8_bom_is_recorded_from_its_first_event(engine, make_sidecar, otlp_sink):
    # SSE lets a stream open with a byte order mark; before, the first event (with the prompt's IDs
    # and the first token) was not recognised as data and went unrecorded.
    reply = _stream()
    reply.chunks[0] = b"\xef\xbb\xbf" + reply.chunks[0]
    text, attributes = _call(engine, make_sidecar, otlp_sink, reply)
    assert attributes[semconv.COMPLETION_TOKEN_IDS] == [5, 7] and attributes[semconv.PROMPT_TOKEN_IDS] == [1, 2]
    assert text.startswith("data: {") and text.count("data: {") == 2
