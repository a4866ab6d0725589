"""Stores for the viewer's tests, built from spans the way the receiver stores them."""

from __future__ import annotations

from pathlib import Path

from agl_trainer.store import RolloutStore

from tests.dataplane.ingest import ingest
from agl import semconv
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from tests.dataplane.otlp import any_value, call_span, reward_span, rollout_span
from agl_testing.tiny_tokenizer import encode, special, tiny_tokenizer

HOSTILE_ID = '<img src=x onerror=alert(1)>\x1b[31m"\u202e'
MERGED_ID = "merged-rollout"
PARTNER_ID = "partner-rollout"  # MERGED_ID's group mate at step 1 (reward 0 against its 1)
BROKEN_ID = "broken-rollout"
T0 = 1_700_000_000_000_000_000
HELD_MS = 12.5  # MERGED_ID's call 1 waited this long while training paused the sidecar
UPSTREAM = "http://127.0.0.1:8001"
# What the front did not interpret in MERGED_ID's call 1 (the second entry is harness text: shown as text).
FIELDS_DROPPED = ["context_management: not an engine option", "metadata.<b>user_id</b>: not an engine option"]
FIELDS_PASSED = ["output_config: sent to the engine as written"]


def save_tokenizer(folder: Path) -> Path:
    tiny_tokenizer().save_pretrained(folder)
    return folder


def held(span):
    """`span` as the sidecar sends a call it held: its held time, its attribution and the request's
    fields the front did not interpret."""
    span.attributes.extend(
        KeyValue(key=key, value=any_value(value))
        for key, value in (
            (semconv.CALL_HELD_MS, HELD_MS),
            (semconv.CALL_UPSTREAM, UPSTREAM),
            (semconv.CALL_API, semconv.API_CHAT_COMPLETIONS),
            (semconv.REQUEST_FIELDS_DROPPED, FIELDS_DROPPED),
            (semconv.REQUEST_FIELDS_PASSED, FIELDS_PASSED),
        )
    )
    return span


def build(path: Path) -> Path:
    """Four rollouts: two calls that merge (a tool result between them; the second held by a
    paused sidecar), two calls whose second
    prompt re-encodes the first's completion (a retokenization break), and a hostile id whose
    completion holds HTML and control characters, and a one-call group mate of the first. All but
    the hostile one trained at step 1; every one has a reward."""
    start, end = special("<|im_start|>"), special("<|im_end|>")
    prompt = [start, *encode("user hello world"), end, start]
    answer = [*encode("the answer is 42"), end]
    tool = [start, *encode("tool says hello"), end, start]
    second = [*encode("hello world"), end]
    spans = [
        call_span(MERGED_ID, 0, prompt, answer, start_ns=T0, end_ns=T0 + 40_000_000, version=0),
        held(call_span(MERGED_ID, 1, [*prompt, *answer, *tool], second, start_ns=T0 + 50_000_000, end_ns=T0 + 90_000_000, version=1)),
        reward_span(MERGED_ID, 1.0),
        reward_span(MERGED_ID, 0.25, call_seq=0),
        rollout_span(MERGED_ID),
    ]
    spans += [
        call_span(PARTNER_ID, 0, prompt, answer, start_ns=T0, end_ns=T0 + 30_000_000, version=0),
        reward_span(PARTNER_ID, 0.0),
        rollout_span(PARTNER_ID),
    ]
    generated = encode("hello world")
    retokenized = [t for c in "hello world" for t in encode(c)]  # the same text, other tokens
    spans += [
        call_span(BROKEN_ID, 0, prompt, [*generated, end], task_id="task-b", start_ns=T0, end_ns=T0 + 10_000_000),
        call_span(BROKEN_ID, 1, [*prompt, *retokenized, end, *tool], second, task_id="task-b", start_ns=T0 + 20_000_000, end_ns=T0 + 30_000_000),
        reward_span(BROKEN_ID, 0.0),
        rollout_span(BROKEN_ID, task_id="task-b"),
    ]
    hostile_text = encode("<b>bold</b> <script>alert(2)</script>")
    spans += [
        call_span(HOSTILE_ID, 0, prompt, [*hostile_text, end], task_id="<i>task</i>", start_ns=T0, end_ns=T0 + 5_000_000),
        reward_span(HOSTILE_ID, 0.5),
        rollout_span(HOSTILE_ID, task_id="<i>task</i>", mode="val"),
    ]
    with RolloutStore(path, grace_s=0.0) as store:
        ingest(store, spans)
        store.refresh_completion()
        store.mark_trained([MERGED_ID, PARTNER_ID, BROKEN_ID], 1)
    return path
