"""The fields the sidecar injects (token IDs, logprobs) are stripped from what the harness receives
whatever the engine's JSON spelling: vLLM's own bytes take the byte-splice fast path; the same values
spelled as another server, version or proxy writes them (spaces, pretty-printing, escaped key names,
another key order; SSE with CRLF, `data:` without a space, JSON over several `data:` lines) take the
slow path. Both give the harness the same JSON and record the same tokens. Whitespace (around colons
and commas, newlines, tabs), key order, escaped strings and number spellings are found in place
too: the harness then gets the engine's own bytes, only the stripped values nulled."""

from __future__ import annotations

import json
import random
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
from agl_sidecar.calls import wire
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
    "spaces_around_colons": lambda raw: json.dumps(json.loads(raw), separators=(" , ", " : ")).encode(),
    "tabs": lambda raw: json.dumps(json.loads(raw), separators=("\t,", ":\t")).encode(),
    "pretty": lambda raw: json.dumps(json.loads(raw), ensure_ascii=False, indent=2).encode(),
    "escaped_keys": _escaped_keys,
    "key_order": lambda raw: json.dumps(_reversed_keys(json.loads(raw)), separators=(",", ":")).encode(),
    "ascii_escapes": lambda raw: json.dumps(json.loads(raw), separators=(",", ":"), ensure_ascii=True).encode(),
}


# What the harness gets byte for byte: the spelling of the stripped JSON (its values nulled in place).
# An escaped key name is not found in place: that body is stripped by re-encoding it.
IN_PLACE = [name for name in SPELLINGS if name != "escaped_keys"]


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


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


def _recorded(kind: str, call: CallRecord) -> dict[str, Any]:
    """Everything the span is built from, decoded as the span builder decodes it."""
    logprobs_of = wire.chat_logprobs if kind == CHAT else wire.legacy_logprobs

    def ids(value: Any) -> Any:
        return value if value is None or isinstance(value, list) else wire.token_ids(value)

    return {
        "prompt": ids(call.prompt_ids),
        "choices": {
            index: (
                ids(choice.token_ids),
                choice.logprobs if isinstance(choice.logprobs, list) else logprobs_of(choice.logprobs),
                choice.finish_reason,
            )
            for index, choice in call.choices.items()
        },
        "response": (call.response_id, call.response_model, call.input_tokens, call.output_tokens),
        "tokens_absent": call.tokens_absent,
    }


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
    stripped = _stripped(original, flags.token_ids, flags.logprobs)
    assert json.loads(out) == stripped
    if spelling in IN_PLACE:
        assert out == SPELLINGS[spelling](_compact(stripped))
    vllm = _call()
    record_unary(kind, raw, flags, vllm, False)
    assert _recorded(kind, call) == _recorded(kind, vllm)
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
    vllm = _call()
    vllm_recorder = StreamRecorder(kind, flags, vllm)
    received = []
    for chunk in chunks:
        spelled = SPELLINGS[spelling](chunk)
        if spelling == "pretty":  # JSON over several lines is several data: lines in SSE
            event = b"\n".join(b"data: " + line for line in spelled.split(b"\n"))
        else:
            event = b"data: " + spelled
        out = recorder.event(event)
        vllm_recorder.event(b"data: " + chunk)
        assert out.startswith(b"data: ") and b"\n" not in out
        if spelling in IN_PLACE and spelling != "pretty":  # several lines are sent as one
            assert out[6:] == SPELLINGS[spelling](_compact(_stripped(json.loads(chunk), False, False)))
        received.append(json.loads(out[6:]))
    originals = [json.loads(c) for c in chunks]
    assert received == [_stripped(c, False, False) for c in originals]
    assert _recorded(kind, call) == _recorded(kind, vllm)
    prompt, completions = _expected_tokens(kind, originals)
    assert _ints(call.prompt_ids) == prompt
    for index, ids in completions.items():
        assert _ints(call.choices[index].token_ids) == ids


# --- any valid spelling: found in place, recorded as vLLM's ---------------------------------------
# Spellings of a double that keep its value (17 significant digits): `-0.5`, `-5.0000000000000000e-01`,
# `-5.0000000000000000E-1`.
_FLOATS: list[Callable[[float], str]] = [
    repr,
    lambda v: f"{v:.16e}",
    lambda v: f"{v:.16E}".replace("E-0", "E-"),
]


def _spell(value: Any, seed: int, ws: str, path: str = "") -> str:
    """`value` as JSON spelled as drawn from `seed`: whitespace from `ws` around every colon, comma
    and bracket, keys in another order, strings with or without `\\u` escapes, floats in exponent
    forms. A path is spelled the same whatever the values elsewhere, so the stripped body comes out
    as the engine's body with the stripped values nulled."""
    rng = random.Random(f"{seed}:{path}")

    def gap() -> str:
        return "".join(rng.choice(ws) for _ in range(rng.choice((0, 0, 1, 2))))

    if isinstance(value, dict):
        keys = list(value)
        if rng.random() < 0.5:
            rng.shuffle(keys)
        members = [
            gap() + json.dumps(k) + gap() + ":" + gap() + _spell(value[k], seed, ws, f"{path}/{k}") + gap()
            for k in keys
        ]
        return "{" + (",".join(members) if members else gap()) + "}"
    if isinstance(value, list):
        items = [gap() + _spell(v, seed, ws, f"{path}/{i}") + gap() for i, v in enumerate(value)]
        return "[" + (",".join(items) if items else gap()) + "]"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=rng.random() < 0.5)
    if isinstance(value, float):
        return rng.choice(_FLOATS)(value)
    return json.dumps(value)


def _accented(value: Any, key: str = "") -> Any:
    """`value` with "é" in the generated text, where an engine writes `\\u00e9` or the UTF-8 bytes."""
    if isinstance(value, dict):
        return {k: _accented(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_accented(v, key) for v in value]
    return value + " café" if key in ("content", "text") and isinstance(value, str) else value


def _long(kind: str, value: dict[str, Any]) -> dict[str, Any]:
    """A long prompt (the body is over wire.LIFT_MIN_BYTES, so its IDs are lifted out before decoding)."""
    if kind == CHAT and value.get("prompt_token_ids"):
        return {**value, "prompt_token_ids": value["prompt_token_ids"] * 300}
    return value


@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("kind", "name"), UNARY)
def test_a_unary_body_in_any_valid_spelling_is_stripped_in_place_and_recorded_as_vllms(
    kind, name, seed, long
):
    original = json.loads(capture(name))
    original = _accented(_long(kind, original) if long else original)
    flags = _flags(kind, {})
    call = _call()
    out = record_unary(kind, _spell(original, seed, " \t\n\r").encode(), flags, call, False)
    assert out == _spell(_stripped(original, False, False), seed, " \t\n\r").encode()
    vllm = _call()
    record_unary(kind, _compact(original), flags, vllm, False)
    assert _recorded(kind, call) == _recorded(kind, vllm) and not call.tokens_absent


@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("kind", "name"), STREAMS)
def test_stream_chunks_in_any_valid_spelling_are_stripped_in_place_and_recorded_as_vllms(
    kind, name, seed, long
):
    flags = _flags(kind, {})
    call, vllm = _call(), _call()
    recorder, vllm_recorder = StreamRecorder(kind, flags, call), StreamRecorder(kind, flags, vllm)
    for i, chunk in enumerate(_chunks(name)):
        original = _accented(_long(kind, json.loads(chunk)) if long else json.loads(chunk))
        # One `data:` line: no line ends in the whitespace.
        out = recorder.event(b"data: " + _spell(original, seed + i, " \t").encode())
        assert out == b"data: " + _spell(_stripped(original, False, False), seed + i, " \t").encode()
        vllm_recorder.event(b"data: " + _compact(original))
    assert _recorded(kind, call) == _recorded(kind, vllm) and not call.tokens_absent


def _hand_written(kind: str, stream: bool, sp: str, logprob: str | None) -> bytes:
    """A one-choice body spelled with `sp` after every colon and comma, a logprob spelled `logprob`
    and `\\u00e9` in its strings; None: as the harness must get it (the injected values nulled)."""
    ids, prompt = ("null", "null") if logprob is None else (f"[7,{sp}8]", f"[1,{sp}2]")
    if kind == CHAT:
        logprobs = "null" if logprob is None else (
            f'{{"content":{sp}[{{"token":{sp}"\\u00e9",{sp}"logprob":{sp}{logprob},'
            f'{sp}"bytes":{sp}[195,{sp}169],{sp}"top_logprobs":{sp}[]}}]}}'
        )
        message = f'"{"delta" if stream else "message"}":{sp}{{"content":{sp}"caf\\u00e9"}}'
        choice = (
            f'{{"index":{sp}0,{sp}{message},{sp}"logprobs":{sp}{logprobs},{sp}"finish_reason":{sp}null,'
            f'{sp}"token_ids":{sp}{ids}}}'
        )
        return f'{{"id":{sp}"c",{sp}"choices":{sp}[{choice}],{sp}"prompt_token_ids":{sp}{prompt}}}'.encode()
    logprobs = "null" if logprob is None else (
        f'{{"tokens":{sp}["\\u00e9"],{sp}"token_logprobs":{sp}[{logprob}]}}'
    )
    choice = (
        f'{{"index":{sp}0,{sp}"text":{sp}"caf\\u00e9",{sp}"logprobs":{sp}{logprobs},'
        f'{sp}"finish_reason":{sp}"stop",{sp}"prompt_token_ids":{sp}{prompt},{sp}"token_ids":{sp}{ids}}}'
    )
    return f'{{"id":{sp}"c",{sp}"choices":{sp}[{choice}]}}'.encode()


@pytest.mark.parametrize("logprob", ["-0.0", "-5E-1", "-5e-1", "-50e-2", "-0.5", "0", "-1e0", "-1E+0"])
@pytest.mark.parametrize("spacing", ["", " ", "\t "])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", [CHAT, COMPLETIONS])
def test_a_logprob_in_any_number_spelling_is_recorded_as_its_value(kind, stream, spacing, logprob):
    body = _hand_written(kind, stream, spacing, logprob)
    call = _call()
    if stream:
        out = StreamRecorder(kind, _flags(kind, {}), call).event(b"data: " + body)[6:]
    else:
        out = record_unary(kind, body, _flags(kind, {}), call, False)
    assert out == _hand_written(kind, stream, spacing, None)
    recorded = _recorded(kind, call)
    assert recorded["prompt"] == [1, 2] and recorded["choices"][0][0] == [7, 8]
    assert [repr(v) for v in recorded["choices"][0][1]] == [repr(float(logprob))]  # -0.0 stays -0.0


_NULLED = b'{"choices":[{"index":0,"message":%s,"token_ids":null}]}'


@pytest.mark.parametrize(
    "message",
    [
        # a key that only ends in the name (an escaped quote before it), with the same value, first
        b'{"content":"x","\\"token_ids":[5]}',
        # the name as a string value, alone and followed by a colon in the text
        b'{"content":"token_ids","role":"token_ids"}',
        b'{"content":"\\"token_ids\\": [5]","role" : "token_ids" }',
        # the name as a member of another object, with another value
        b'{"content":"x","token_ids" : [6]}',
    ],
)
@pytest.mark.parametrize("spacing", [b":", b" : ", b":\n  "])
def test_only_the_choices_member_of_that_name_is_nulled(message, spacing):
    body = b'{"choices":[{"index":0,"message":%s,"token_ids"%s[5]}]}' % (message, spacing)
    call = _call()
    out = record_unary(CHAT, body, _flags(CHAT, {}), call, False)
    assert out == b'{"choices":[{"index":0,"message":%s,"token_ids"%snull}]}' % (message, spacing)
    assert _recorded(CHAT, call)["choices"][0][0] == [5]
    # The stream's one-search locator finds what the general one finds, decoys first or not.
    five = msgspec.Raw(b"[5]")
    located = wire.value_at(body, b'"token_ids":', five)
    assert located == body.rindex(b"[5]") and wire.first_value_at(body, b'"token_ids":', five) == located


_CHUNK = (
    b'{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":%s,'
    b'"logprobs"%s{"content":[{"token":"a","logprob":-0.5,"bytes":[97],"top_logprobs":[]}]},'
    b'"finish_reason":null,"token_ids"%s[5]}]}'
)


@pytest.mark.parametrize(
    "delta",
    [
        b'{"content":"a"}',
        # members of those names nested before the choice's, with other values: found past them
        b'{"content":"a","extra":{"token_ids":[9],"logprobs":null}}',
        b'{"content":"\\"token_ids\\":[5] \\"logprobs\\":","extra":{"logprobs":{"content":[]}}}',
    ],
)
@pytest.mark.parametrize("spacing", [b":", b" : ", b": "])
def test_a_stream_chunk_is_stripped_at_its_choices_members_whatever_comes_before_them(delta, spacing):
    """The stream's inline locator (vLLM's compact spelling, one search a value) and the general one
    it falls back to cut the same members: the choice's, not a decoy of the same name."""
    payload = _CHUNK % (delta, spacing, spacing)
    call = _call()
    out = StreamRecorder(CHAT, _flags(CHAT, {}), call).event(b"data: " + payload)
    expected = payload.replace(b"%s{" % spacing + b'"content":[{"token"', b"%snull,@" % spacing, 1)
    expected = expected[: expected.index(b"@")] + expected[expected.index(b'"finish_reason"'):]
    expected = expected.replace(b'"token_ids"%s[5]}]}' % spacing, b'"token_ids"%snull}]}' % spacing)
    assert out == b"data: " + expected
    recorded = _recorded(CHAT, call)["choices"][0]
    assert recorded[0] == [5] and recorded[1] == [-0.5]


@pytest.mark.parametrize(
    "body",
    [
        b"", b'"token_ids"', b'{"token_ids"', b'{"token_ids":', b'{"token_ids" ', b'{"token_ids"  :  ',
        b'{"a":"token_ids"}', b'{"token_ids":[5', b'{"token_ids": [5, 6', b'{"x":1,"token_ids"\t',
    ],
)
def test_locating_a_value_in_a_cut_or_odd_body_finds_nothing_and_raises_nothing(body):
    assert wire.value_at(body, b'"token_ids":', msgspec.Raw(b"[5]")) == -1
    assert wire.first_value_at(body, b'"token_ids":', msgspec.Raw(b"[5]")) == -1
    assert wire.null_out(body, [(b'"token_ids":', msgspec.Raw(b"[5]"))]) is None
    assert wire.lift_int_array(body, b'"token_ids":') == (body, None)


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
