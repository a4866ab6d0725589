"""Span building off the hot path: token arrays decoded in slices (with a cache of repeated
slices), jobs bigger than a slice built in order in a background task that defers to active calls,
one-slice jobs at once."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from agl import semconv
from agl_sidecar.spans import otlp, token_arrays
from agl_sidecar.calls.attribution import Identity
from agl_sidecar.spans.foreground import Foreground
from agl_sidecar.calls.record import CallRecord
from agl_sidecar.spans.recorder import SpanRecorder
from agl_sidecar.spans.token_arrays import SliceCache, encode_token_ids
from tests.support.otlp_sink import RecorderSpans
from tests.support.waiting import wait_until_async


def _run(generator):
    """Drive a builder generator to its return value, counting its slices."""
    steps = 0
    while True:
        try:
            next(generator)
            steps += 1
        except StopIteration as done:
            return done.value, steps


@pytest.mark.parametrize("length", [0, 1, 4095, 4096, 4097, 35000])
def test_json_token_arrays_encode_like_the_ids_in_slices(length):
    ids = [random.randrange(0, 200_000) for _ in range(length)]
    cache = SliceCache()
    encoded, steps = _run(encode_token_ids(msgspec.Raw(msgspec.json.encode(ids)), cache))
    expected = otlp.IntArray.of(ids)
    assert encoded.length == length and encoded.elements == expected.elements
    if length == 35000:  # ~200 KB of JSON: decoded a slice per step, never in one go
        assert steps >= 35000 * 6 // token_arrays.SLICE_JSON_BYTES
    listed, _ = _run(encode_token_ids(ids, cache))  # a stream's assembled list, the same bytes
    assert listed.elements == expected.elements


def test_repeated_slices_come_from_the_cache_and_a_longer_prompt_reuses_its_prefix():
    cache = SliceCache()
    prompt = [random.randrange(0, 150_000) for _ in range(30_000)]
    first, _ = _run(encode_token_ids(msgspec.Raw(msgspec.json.encode(prompt)), cache))
    assert cache.hits == 0 and cache.misses > 4
    # The next turn of the conversation: the same prefix plus new tokens.
    extended = prompt + [random.randrange(0, 150_000) for _ in range(5_000)]
    second, steps = _run(encode_token_ids(msgspec.Raw(msgspec.json.encode(extended)), cache))
    assert second.elements == otlp.IntArray.of(extended).elements
    assert second.elements.startswith(first.elements)
    assert cache.hits >= 30_000 * 6 // token_arrays.SLICE_JSON_BYTES - 1
    assert steps <= 5_000 * 7 // token_arrays.SLICE_JSON_BYTES + 2  # only the new slices are decoded


def test_json_with_spaces_null_and_non_integer_arrays():
    ids = list(range(10_000))
    spaced = msgspec.Raw(b"[" + b", ".join(str(i).encode() for i in ids) + b"]")
    encoded, _ = _run(encode_token_ids(spaced, SliceCache()))
    assert encoded.elements == otlp.IntArray.of(ids).elements
    assert _run(encode_token_ids(msgspec.Raw(b"null"), SliceCache()))[0] is None
    strings = msgspec.Raw(msgspec.json.encode([f"a,{i}" for i in range(10_000)]))  # commas inside strings
    with pytest.raises(msgspec.ValidationError):
        _run(encode_token_ids(strings, SliceCache()))


def test_slice_cache_stays_within_its_bytes():
    cache = SliceCache(max_bytes=100_000)
    for _ in range(10):
        ids = [random.randrange(0, 150_000) for _ in range(40_000)]
        _run(encode_token_ids(msgspec.Raw(msgspec.json.encode(ids)), cache))
    assert 0 < cache.bytes <= 100_000
    off = SliceCache(max_bytes=0)  # token_cache_bytes: 0
    raw = msgspec.Raw(msgspec.json.encode(list(range(20_000))))
    for _ in range(2):
        _run(encode_token_ids(raw, off))
    assert off.hits == 0 and off.bytes == 0


def _prompt(value: bytes, cache: SliceCache) -> tuple[otlp.IntArray | None, int]:
    return _run(encode_token_ids(msgspec.Raw(value), cache, prompt=True))


@pytest.mark.parametrize("spaced", [False, True])
def test_a_prompt_seen_before_is_found_whole_and_its_next_turn_decodes_only_the_new_ids(spaced):
    def spell(ids: list[int]) -> bytes:
        return b"[" + b", ".join(str(i).encode() for i in ids) + b"]" if spaced else msgspec.json.encode(ids)

    cache = SliceCache()
    prompt = [random.randrange(0, 150_000) for _ in range(30_000)]
    first, _ = _prompt(spell(prompt), cache)
    again, steps = _prompt(spell(prompt), cache)
    assert again is first and steps == 0  # the same prompt: one comparison
    misses = cache.misses
    extended = prompt + [random.randrange(0, 150_000) for _ in range(3_000)]
    second, steps = _prompt(spell(extended), cache)
    assert second.elements == otlp.IntArray.of(extended).elements and second.length == len(extended)
    assert cache.misses - misses <= 3 * 7 * 1_000 // token_arrays.SLICE_JSON_BYTES + 1  # only the new IDs
    # Another branch from the first prompt is found from it too; the second is still kept.
    branch = prompt + [7, 8, 9]
    assert _prompt(spell(branch), cache)[0].elements == otlp.IntArray.of(branch).elements
    assert _prompt(spell(extended), cache)[0] is second


def test_a_kept_prompt_is_taken_only_up_to_a_whole_id():
    cache = SliceCache()
    prompt = list(range(1000, 2000))
    _prompt(msgspec.json.encode(prompt), cache)
    # The kept text `[1000,...,1999` begins these too, but ends inside an ID or before a non-ID.
    for ids in (prompt[:-1] + [19990, 5], prompt[:-1] + [199]):
        assert _prompt(msgspec.json.encode(ids), cache)[0].elements == otlp.IntArray.of(ids).elements
    with pytest.raises(msgspec.ValidationError):
        _prompt(msgspec.json.encode(prompt + ["x"]), cache)
    with pytest.raises(msgspec.DecodeError):  # malformed after the kept IDs: refused, not taken as equal
        _prompt(msgspec.json.encode(prompt) + b"]", cache)
    assert _prompt(b"null", cache)[0] is None


def test_kept_prompts_stay_within_the_cache_bytes():
    cache = SliceCache(max_bytes=400_000)
    head = [random.randrange(0, 150_000) for _ in range(100)]
    for _ in range(20):  # conversations that start alike, then differ
        ids = head + [random.randrange(0, 150_000) for _ in range(20_000)]
        assert _prompt(msgspec.json.encode(ids), cache)[0].elements == otlp.IntArray.of(ids).elements
    assert 0 < cache.bytes <= 400_000


def _call(rollout: str, prompt: list[int], completion: list[int]) -> CallRecord:
    call = CallRecord(api="openai.chat", operation="chat", identity=Identity(rollout_id=rollout), trace_parent=None,
                      start_ns=1, model="tiny")
    call.prompt_ids = msgspec.Raw(msgspec.json.encode(prompt))
    choice = call.choice(0)
    choice.token_ids = msgspec.Raw(msgspec.json.encode(completion))
    choice.logprobs = msgspec.Raw(b'{"content":[{"logprob":-0.25}]}')
    return call


async def test_spans_are_built_in_the_background_in_order():
    exporter = RecorderSpans()
    recorder = SpanRecorder(exporter)  # type: ignore[arg-type]
    recorder.start()
    prompt = list(range(20_000))
    call = _call("r1", prompt, [7])
    call.seq = recorder.next_seq(call.identity)
    recorder.finish(call)
    recorder.reward(Identity(rollout_id="r1"), 1.0, "task", 0, None, {})
    recorder.rollout_end(Identity(rollout_id="r1"), semconv.STATUS_SUCCEEDED, None)
    assert exporter.spans == [] and recorder.backlog == 3  # finish() only queued the work
    assert await recorder.drain(5)
    names = [name for name, _ in exporter.decoded()]
    assert names == ["chat tiny", semconv.SPAN_REWARD, semconv.SPAN_ROLLOUT]
    attrs = exporter.decoded()[0][1]
    assert attrs[semconv.PROMPT_TOKEN_IDS] == prompt and attrs[semconv.COMPLETION_TOKEN_IDS] == [7]
    assert attrs[semconv.COMPLETION_LOGPROBS] == [-0.25] and attrs[semconv.GEN_AI_USAGE_INPUT_TOKENS] == 20_000
    assert recorder.calls_recorded == 1
    await recorder.close()


async def test_the_builder_waits_for_active_calls_but_not_forever():
    foreground = Foreground()
    exporter = RecorderSpans()
    recorder = SpanRecorder(exporter, foreground=foreground, max_defer_s=0.3)  # type: ignore[arg-type]
    recorder.start()
    foreground.enter()  # a call is being proxied
    recorder.finish(_call("r1", list(range(30_000)), [1]))
    await wait_until_async(lambda: foreground.background_waiting, "the builder putting the span off", timeout=5)
    assert exporter.spans == []  # deferred to the active call
    foreground.leave()
    assert await recorder.drain(2) and len(exporter.spans) == 1

    foreground.enter()  # a call that stays active: the span is built anyway after max_defer_s
    recorder.finish(_call("r2", list(range(30_000)), [1]))
    assert await recorder.drain(3) and len(exporter.spans) == 2
    foreground.leave()
    await recorder.close()


async def test_the_span_being_built_is_counted_until_it_is_handed_on():
    """A monitor waiting for nothing pending reads spans_building: the job the builder holds (taken
    from the queue, put off for an active call or between slices) is still pending."""
    foreground = Foreground()
    exporter = RecorderSpans()
    recorder = SpanRecorder(exporter, foreground=foreground, max_defer_s=60)  # type: ignore[arg-type]
    recorder.start()
    foreground.enter()
    recorder.finish(_call("r1", list(range(30_000)), [1]))
    await wait_until_async(lambda: foreground.background_waiting, "the builder holding the span", timeout=5)
    assert exporter.spans == [] and recorder.backlog == 1
    foreground.leave()
    assert await recorder.drain(5) and len(exporter.spans) == 1 and recorder.backlog == 0
    await recorder.close()


def _after_one_call(settle_s: float) -> tuple[Foreground, RecorderSpans, SpanRecorder]:
    """A running builder and one call answered (nothing else in flight), its span (more than one
    slice of JSON) queued."""
    foreground = Foreground(settle_s=settle_s)
    exporter = RecorderSpans()
    recorder = SpanRecorder(exporter, foreground=foreground, max_defer_s=60)  # type: ignore[arg-type]
    recorder.start()
    foreground.begin()
    recorder.finish(_call("r1", list(range(10_000)), [1]))
    foreground.end()
    return foreground, exporter, recorder


async def test_after_the_last_call_the_builder_settles_then_builds():
    foreground, exporter, recorder = _after_one_call(settle_s=0.3)
    # the builder has the call and puts it off
    await wait_until_async(lambda: foreground.background_waiting, "the builder putting the span off", timeout=5)
    assert exporter.spans == []  # a harness that calls again at once would call now
    assert await recorder.drain(2) and len(exporter.spans) == 1  # after settle_s, with no next call
    await recorder.close()


async def test_a_span_is_built_while_the_next_call_waits_on_the_engine(monkeypatch):
    waits = 0  # how often the builder has gone (back) to waiting for a quiet loop
    real_next_change = Foreground._next_change

    async def counted(self: Foreground, timeout_s: float) -> None:
        nonlocal waits
        waits += 1
        await real_next_change(self, timeout_s)

    monkeypatch.setattr(Foreground, "_next_change", counted)
    foreground, exporter, recorder = _after_one_call(settle_s=60)
    # the builder has the call and puts it off
    await wait_until_async(lambda: foreground.background_waiting, "the builder putting the span off", timeout=5)
    assert exporter.spans == []  # settling: the next call may be on its way
    foreground.begin()  # it is: while the proxy works on it, the builder still waits
    before = waits
    assert foreground._changed is not None
    foreground._changed.set()  # wake the builder, as any change of state would: it looks again...
    await wait_until_async(lambda: waits > before, "the builder looking again and going back to wait", timeout=5)
    assert exporter.spans == [] and foreground.background_waiting  # ...and still waits: a call is active
    engine = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(foreground.waiting(engine))
    assert await recorder.drain(2) and len(exporter.spans) == 1  # built during the engine's time
    assert not engine.done()
    engine.set_result(None)
    await waiting
    foreground.end()
    await recorder.close()


async def test_a_span_that_fails_to_build_is_counted_and_the_builder_goes_on(monkeypatch):
    exporter = RecorderSpans()
    recorder = SpanRecorder(exporter)  # type: ignore[arg-type]
    recorder.start()
    real_span = otlp.span
    calls = iter([RuntimeError("encoder bug")])

    def flaky_span(**kwargs):
        for error in calls:
            raise error
        return real_span(**kwargs)

    monkeypatch.setattr(otlp, "span", flaky_span)
    recorder.finish(_call("r1", [1, 2], [3]))
    recorder.finish(_call("r2", [1, 2], [3]))
    assert await recorder.drain(2)
    assert recorder.build_failures == 1 and exporter.counters.spans_failed == 1 and len(exporter.spans) == 1
    await recorder.close()


async def test_close_builds_what_is_still_queued():
    exporter = RecorderSpans()
    foreground = Foreground()
    recorder = SpanRecorder(exporter, foreground=foreground, max_defer_s=60)  # type: ignore[arg-type]
    recorder.start()
    foreground.enter()
    for i in range(3):
        recorder.finish(_call(f"r{i}", list(range(10_000)), [1]))
    await recorder.close(timeout_s=0.05)  # the drain times out behind the active call
    assert len(exporter.spans) == 3 and recorder.backlog == 0


async def test_a_span_of_one_slice_is_built_at_once_unless_spans_are_queued_before_it():
    """Small spans skip the builder task (its turns of the loop cost more than the slice); order
    still holds: behind a queued span, a small one waits its turn."""
    foreground = Foreground()
    exporter = RecorderSpans()
    recorder = SpanRecorder(exporter, foreground=foreground, max_defer_s=60)  # type: ignore[arg-type]
    recorder.start()
    one_slice = token_arrays.SLICE_JSON_BYTES // 10  # IDs of 8 JSON bytes ("1000000,"): a slice holds more
    recorder.finish(_call("small", list(range(1_000_000, 1_000_000 + one_slice)), [1]))
    assert len(exporter.spans) == 1 and recorder.backlog == 0  # built inside finish()
    foreground.enter()  # an active call: the builder puts queued work off
    recorder.finish(_call("big", list(range(1_000_000, 1_000_000 + 2 * one_slice)), [1]))
    recorder.finish(_call("small-after", [1, 2, 3], [4]))
    assert len(exporter.spans) == 1 and recorder.backlog == 2  # the small one waits behind the big one
    foreground.leave()
    assert await recorder.drain(5)
    rollouts = [attrs[semconv.ROLLOUT_ID] for _, attrs in exporter.decoded()]
    assert rollouts == ["small", "big", "small-after"]
    await recorder.close()


def test_without_a_running_builder_spans_are_built_at_once():
    exporter = RecorderSpans()
    recorder = SpanRecorder(exporter)  # type: ignore[arg-type]
    recorder.finish(_call("r1", [1, 2, 3], [4]))
    assert len(exporter.spans) == 1


@pytest.mark.parametrize(
    ("progress", "version", "runs"),
    [
        ([{"chatcmpl-z": 0}], 1, None),  # frozen before its first token: all of it version 1's
        ([{"chatcmpl-z": 0}, {"chatcmpl-z": 2}], 1, [0, 1, 2, 2]),  # then a second switch inside it
        ([{"chatcmpl-z": 2}], 0, [0, 0, 2, 1]),  # a switch inside: the span keeps its entry version
    ],
)
async def test_a_call_whose_first_token_came_after_a_switch_is_spanned_under_that_version(progress, version, runs):
    """The span contract: `agl.completion.policy_versions` starts with the span's `agl.policy.version`. A call
    that entered under version 0 but was frozen before its first token has none of version 0's tokens, so
    its span names the version that sampled its first token."""
    from agl_sidecar.calls.switches import SwitchLog

    exporter = RecorderSpans()
    recorder = SpanRecorder(exporter)  # type: ignore[arg-type]
    recorder.start()
    call = _call("r-switch", list(range(8)), [5, 6, 7, 8])
    call.choice(0).logprobs = msgspec.Raw(b'{"content":[' + b",".join([b'{"logprob":-0.5}'] * 4) + b"]}")
    call.seq, call.response_id, call.policy_version = recorder.next_seq(call.identity), "chatcmpl-z", 0
    call.switches = SwitchLog()
    for new_version, report in enumerate(progress, start=1):
        call.switches.record(new_version, report)
    recorder.finish(call)
    assert await recorder.drain(5)
    (name, attrs), = exporter.decoded()
    assert attrs[semconv.POLICY_VERSION] == version
    assert attrs.get(semconv.COMPLETION_POLICY_VERSIONS) == runs
