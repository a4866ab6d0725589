"""What a translating front did not interpret (agl.request.fields.dropped / .passed) from the
sidecar's span encoder through the receiver (OTLP protobuf and JSON) into the store (schema 6) and
the viewer's API; entries past the receiver's bounds are left out one by one, never the span."""

from __future__ import annotations

import sqlite3

import httpx
import pytest
from agl_trainer.receiver.contract import FIELD_ENTRY_MAX_CHARS, FIELD_LIST_MAX_ENTRIES
from agl_trainer.store import RolloutStore
from agl_trainer.store.schema import SCHEMA_VERSION
from google.protobuf import json_format

from tests.dataplane.ingest import ingest
from tests.dataplane.test_call_attribution_columns import sidecar_request
from tests.dataplane.otlp import call_span, request, rollout_span, with_attributes
from tests.viewer.conftest import get, start

DROPPED = ("context_management: not an engine option", "tools[*].cache_control: a prompt-cache hint")
PASSED = ("output_config: sent to the engine as written",)


async def test_the_lists_reach_the_store_and_the_viewer_from_the_sidecars_encoder(receiver, store, store_path):
    reply = httpx.post(f"{receiver.url}/v1/traces", content=await sidecar_request("f-1", fields_dropped=DROPPED, fields_passed=PASSED),
                       headers={"content-type": "application/x-protobuf"}, timeout=30)  # fmt: skip
    assert reply.status_code == 200
    [call] = store.load("f-1").calls
    assert (call.fields_dropped, call.fields_passed) == (DROPPED, PASSED)
    with start(store_path, index=False) as server:
        status, body = get(server, "/api/rollout?id=f-1")
    assert status == 200
    [shown] = body["calls"]
    assert (shown["fields_dropped"], shown["fields_passed"]) == (list(DROPPED), list(PASSED))
    assert not {"fields_dropped", "fields_passed"} & shown["extra"].keys()  # the call's own fields


def test_a_call_without_the_lists_has_none_and_a_plain_store_row_is_null(store, store_path):
    ingest(store, [call_span("r", 0, [1], [2]), rollout_span("r")])
    [call] = store.load("r").calls
    assert (call.fields_dropped, call.fields_passed) == ((), ())
    with sqlite3.connect(store_path) as db:
        assert db.execute("SELECT fields_dropped, fields_passed FROM calls").fetchall() == [(None, None)]


LONG = "x" * (FIELD_ENTRY_MAX_CHARS + 1)


@pytest.mark.parametrize("spelling", ["protobuf", "json"])
@pytest.mark.parametrize(
    ("value", "kept", "left_out"),
    [
        (["a: why", LONG, "b: why"], ("a: why", "b: why"), 1),
        (["a: why", "b: \x1b[31mred"], ("a: why",), 1),
        (["a: why", "b: \u0085next line"], ("a: why",), 1),
        (["a: why", 7, "c: why"], ("a: why", "c: why"), 1),
        ([f"f{i}: why" for i in range(FIELD_LIST_MAX_ENTRIES + 3)],
         tuple(f"f{i}: why" for i in range(FIELD_LIST_MAX_ENTRIES)), 3),
        (["x" * FIELD_ENTRY_MAX_CHARS, "é: ünïcode"], ("x" * FIELD_ENTRY_MAX_CHARS, "é: ünïcode"), 0),
    ],
    ids=["too-long", "escape", "c1-control", "not-a-string", "too-many", "at-the-bounds"],
)  # fmt: skip
def test_a_bad_or_excess_entry_is_left_out_alone_and_counted(receiver, store, value, kept, left_out, spelling):
    span = with_attributes(call_span("r", 0, [1, 2], [3]), agl__request__fields__dropped=value)
    body = request([span, rollout_span("r")])
    if spelling == "json":
        content, media = json_format.MessageToJson(body).encode(), "application/json"
    else:
        content, media = body.SerializeToString(), "application/x-protobuf"
    reply = httpx.post(f"{receiver.url}/v1/traces", content=content, headers={"content-type": media}, timeout=30)
    assert reply.status_code == 200
    assert store.stats().violations == {}  # the span is stored: the list cost only its entries
    [call] = store.load("r").calls
    assert call.completion_ids.tolist() == [3]
    assert call.fields_dropped[: len(kept)] == kept
    if left_out:
        assert len(call.fields_dropped) == len(kept) + 1
        assert call.fields_dropped[-1].startswith(f"...: {left_out} more entr")
    else:
        assert len(call.fields_dropped) == len(kept)


@pytest.mark.parametrize("value", ["context_management: a string, not an array", [1, 2, 3], [0.5]])
def test_a_value_that_is_not_a_string_array_becomes_one_entry_saying_so(store, value):
    span = with_attributes(call_span("r", 0, [1, 2], [3]), agl__request__fields__passed=value)
    assert ingest(store, [span, rollout_span("r")]).violations == {}
    [call] = store.load("r").calls
    [entry] = call.fields_passed
    assert entry.startswith("...: the sender's value was not a string array")


def test_a_schema_5_store_gains_the_columns_in_place_and_keeps_its_rows(store_path):
    with RolloutStore(store_path, grace_s=0.0) as store:
        ingest(store, [call_span("old", 0, [1, 2], [3]), rollout_span("old")])
    with sqlite3.connect(store_path) as db:  # back to schema 5
        for column in ("fields_dropped", "fields_passed"):
            db.execute(f"ALTER TABLE calls DROP COLUMN {column}")
        db.execute("PRAGMA user_version=5")
    with RolloutStore(store_path, grace_s=0.0) as store:
        [old] = store.load("old").calls
        assert old.completion_ids.tolist() == [3] and old.fields_dropped == ()
        listed = with_attributes(call_span("new", 0, [1], [2]), agl__request__fields__passed=list(PASSED))
        ingest(store, [listed, rollout_span("new")])
        assert store.load("new").calls[0].fields_passed == PASSED
    with sqlite3.connect(store_path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 6


def test_a_column_that_is_not_a_json_string_array_reads_as_empty(store, store_path):
    """A row this store did not write (a hand edit) is shown as no entries, not an error."""
    ingest(store, [call_span("r", 0, [1], [2]), rollout_span("r")])
    with sqlite3.connect(store_path) as db:
        db.execute("UPDATE calls SET fields_dropped = '{not json', fields_passed = '[1, 2]'")
    [call] = store.load("r").calls
    assert (call.fields_dropped, call.fields_passed) == ((), ())
