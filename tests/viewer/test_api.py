"""The viewer's JSON API over real HTTP, on a store built from spans the way the receiver stores them."""

from __future__ import annotations

import hashlib
import json
import urllib.parse

import pytest
from agl_trainer.store import RolloutStore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span
from tests.support.waiting import wait_until
from tests.viewer.conftest import get, start
from tests.viewer.stores import (
    BROKEN_ID, FIELDS_DROPPED, FIELDS_PASSED, HELD_MS, HOSTILE_ID, MERGED_ID, PARTNER_ID, UPSTREAM,
)


def ids(body):
    return [row["rollout_id"] for row in body["rows"]]


def test_rollouts_lists_every_rollout_newest_first_with_calls_rewards_and_merge_breaks(server):
    status, body = get(server, "/api/rollouts")
    assert status == 200 and body["total"] == 4
    assert ids(body) == [HOSTILE_ID, BROKEN_ID, PARTNER_ID, MERGED_ID]
    rows = {row["rollout_id"]: row for row in body["rows"]}
    assert rows[MERGED_ID]["calls"] == 2 and rows[MERGED_ID]["reward"] == 1.0
    assert (rows[MERGED_ID]["min_version"], rows[MERGED_ID]["max_version"]) == (0, 1)
    assert rows[MERGED_ID]["merge_breaks"] == 0 and rows[MERGED_ID]["trained_step"] == 1
    assert rows[BROKEN_ID]["merge_breaks"] == 1 and rows[BROKEN_ID]["break_kinds"] == {"retokenization": 1}
    assert rows[HOSTILE_ID]["mode"] == "val" and rows[HOSTILE_ID]["trained_step"] is None


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("mode=val", [HOSTILE_ID]),
        ("mode=train&sort=reward&order=asc", [PARTNER_ID, BROKEN_ID, MERGED_ID]),  # ties: older first
        ("task=task-b", [BROKEN_ID]),
        ("min_breaks=1", [BROKEN_ID]),
        ("max_breaks=0&min_calls=2", [MERGED_ID]),
        ("min_reward=0.5&sort=reward", [MERGED_ID, HOSTILE_ID]),
        ("step=1&sort=calls&order=asc", [PARTNER_ID, MERGED_ID, BROKEN_ID]),
        ("step=none", [HOSTILE_ID]),
        ("min_version=1", [MERGED_ID]),
        ("state=ready", [HOSTILE_ID]),
        ("cause=timeout", []),
        ("id=" + urllib.parse.quote("<img"), [HOSTILE_ID]),
        ("id=%25", []),  # LIKE wildcards in a prefix are literal
        ("limit=2&offset=1", [BROKEN_ID, PARTNER_ID]),
    ],
)
def test_filters_sort_and_pages(server, query, expected):
    status, body = get(server, "/api/rollouts?" + query)
    assert status == 200, body
    assert ids(body) == expected
    if "limit" not in query:
        assert body["total"] == len(expected)


def test_a_rollout_with_merged_calls_decodes_its_tokens_and_marks_every_role(server):
    status, body = get(server, "/api/rollout?id=" + MERGED_ID)
    assert status == 200 and body["decoded"] is True and body["reward"] == 1.0
    [sample] = body["samples"]
    assert sample["call_seqs"] == [0, 1]
    text = "".join(sample["text"])
    assert "user hello world" in text and "the answer is 42" in text and "tool says hello" in text
    roles = sample["roles"]
    answer = "".join(t for t, r in zip(sample["text"], roles, strict=True) if r == "c")
    context = "".join(t for t, r in zip(sample["text"], roles, strict=True) if r == "t")
    prompt = "".join(t for t, r in zip(sample["text"], roles, strict=True) if r == "p")
    assert answer == "the answer is 42<|im_end|>hello world<|im_end|>"
    assert context == "<|im_start|>tool says hello<|im_end|><|im_start|>"
    assert prompt.startswith("<|im_start|>user hello world")
    trained_versions = {v for v, r in zip(sample["versions"], roles, strict=True) if r == "c"}
    assert trained_versions == {0, 1}
    assert all(lp is not None and lp < 0 for lp, r in zip(sample["logprobs"], roles, strict=True) if r == "c")
    calls = {call["call_seq"]: call for call in body["calls"]}
    assert calls[0]["reward"] == 0.25 and calls[1]["placement"]["merged"] is True
    assert calls[1]["placement"]["parent"] == 0  # the call tree, from assembly's placements
    assert calls[1]["start_ns"] - calls[0]["start_ns"] == 50_000_000
    assert calls[0]["end_ns"] - calls[0]["start_ns"] == 40_000_000
    # the sidecar's account of each call, from its span's attributes
    assert (calls[1]["held_ms"], calls[1]["upstream"], calls[1]["api"]) == (HELD_MS, UPSTREAM, "openai.chat_completions")
    assert (calls[0]["held_ms"], calls[0]["upstream"], calls[0]["api"]) == (None, None, None)
    assert not {"held_ms", "upstream", "api"} & calls[1]["extra"].keys()  # the call's own fields, not extras
    # what the front did not interpret in the call's request (agl.request.fields.*)
    assert (calls[1]["fields_dropped"], calls[1]["fields_passed"]) == (FIELDS_DROPPED, FIELDS_PASSED)
    assert (calls[0]["fields_dropped"], calls[0]["fields_passed"]) == ([], [])
    # both rewards end at the same time: their order is by span id, so compare as a set
    assert sorted((r["name"], r["value"], r["call_seq"] is None) for r in body["rewards"]) == [
        ("reward", 0.25, False),
        ("reward", 1.0, True),
    ]


def test_a_broken_rollout_shows_its_merge_break_with_its_class(server):
    status, body = get(server, "/api/rollout?id=" + BROKEN_ID + "&attempt=0")
    assert status == 200
    [failure] = body["merge_failures"]
    assert (failure["call_seq"], failure["previous_call_seq"], failure["kind"]) == (1, 0, "retokenization")
    assert failure["classified_by"] == "tokenizer"  # the viewer's tokenizer classifies on text
    assert [s["call_seqs"] for s in body["samples"]] == [[0], [1]]


def test_without_a_model_tokens_are_ids(built):
    store, _ = built
    with start(store, None, index=False) as server:
        status, body = get(server, "/api/rollout?id=" + MERGED_ID)
        assert status == 200 and body["decoded"] is False
        [sample] = body["samples"]
        assert sample["text"] == [str(t) for t in sample["ids"]]
        status, listing = get(server, "/api/rollouts")  # no indexer: breaks unknown, the rest there
        assert listing["total"] == 4 and all(row["merge_breaks"] is None for row in listing["rows"])


def test_hostile_ids_and_text_come_back_verbatim_as_json_strings(server):
    status, body = get(server, "/api/rollout?id=" + urllib.parse.quote(HOSTILE_ID))
    assert status == 200 and body["info"]["rollout_id"] == HOSTILE_ID and body["info"]["task_id"] == "<i>task</i>"
    assert "<script>alert(2)</script>" in "".join(body["samples"][0]["text"])


def test_a_step_shows_its_rollouts_advantages_and_staleness(server):
    status, body = get(server, "/api/step?step=1")
    assert status == 200 and body["trained_version"] == 0
    rows = {row["rollout_id"]: row for row in body["rollouts"]}
    assert set(rows) == {MERGED_ID, PARTNER_ID, BROKEN_ID}
    assert rows[MERGED_ID]["group_size"] == 2 and rows[MERGED_ID]["advantage"] == pytest.approx(0.5)
    assert rows[PARTNER_ID]["advantage"] == pytest.approx(-0.5)
    assert rows[MERGED_ID]["advantage_normalized"] == pytest.approx(0.5 / 0.5**0.5 / 1, rel=1e-3)
    assert rows[BROKEN_ID]["group_size"] == 1 and rows[BROKEN_ID]["advantage"] == 0.0
    assert rows[MERGED_ID]["staleness"] == 0  # its oldest call is version 0, trained by version 0
    assert body["metrics"] is None


def test_overview_counts_steps_and_the_reward_curve_from_the_store(server):
    status, body = get(server, "/api/overview")
    assert status == 200 and body["counts"]["rollouts"] == 4 and body["counts"]["trained"] == 3
    assert [s["step"] for s in body["steps"]] == [1] and body["curve_source"] == "store"
    assert body["curve"] == [{"step": 1, "reward": pytest.approx(1 / 3), "entropy": None}]


def test_metrics_and_harness_logs_from_the_run_dir(built, tmp_path):
    store, _ = built
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "time": 1.0, "reward/mean": 0.4, "actor/entropy": 1.5, "policy_version": 1.0})
        + "\n{half a line"
    )
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / f"{MERGED_ID}.log").write_text("harness said hi\n")
    with start(store, None, run_dir=tmp_path, index=False) as server:
        _, overview = get(server, "/api/overview")
        assert overview["curve_source"] == "metrics.jsonl"
        assert overview["curve"] == [
            {"step": 1, "reward": 0.4, "entropy": 1.5, "val_reward": None, "val_sampled": None}
        ]
        _, step = get(server, "/api/step?step=1")
        assert step["metrics"]["reward/mean"] == 0.4 and step["trained_version"] == 0
        _, rollout = get(server, "/api/rollout?id=" + MERGED_ID)
        assert rollout["log"]["tail"] == "harness said hi\n"
        _, other = get(server, "/api/rollout?id=" + BROKEN_ID)
        assert other["log"] is None


def test_reward_times_are_readable_and_old_float_steps_are_read(built, tmp_path):
    store, _ = built
    _, body = get_rollout(store, MERGED_ID)
    first_start = min(call["start_ns"] for call in body["calls"])
    for reward in body["rewards"]:
        assert reward["end_s"] == pytest.approx(reward["end_ns"] / 1e9)
        assert reward["after_ns"] == reward["end_ns"] - first_start
    # metrics.jsonl written before the writer kept steps integers: training rows had "step": 1.0
    rows = [{"step": 0, "val/reward": 0.5}, {"step": 1.0, "reward/mean": 0.25, "actor/entropy": 2.0}]
    rows += [{"step": 2.0, "reward/mean": 0.75}, {"step": 2, "val/reward": 0.9, "val/sampled/reward": 0.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with start(store, None, run_dir=tmp_path, index=False) as server:
        _, overview = get(server, "/api/overview")
    assert overview["curve"] == [
        {"step": 0, "reward": None, "entropy": None, "val_reward": 0.5, "val_sampled": None},
        {"step": 1, "reward": 0.25, "entropy": 2.0, "val_reward": None, "val_sampled": None},
        {"step": 2, "reward": 0.75, "entropy": None, "val_reward": 0.9, "val_sampled": 0.6},
    ]


def get_rollout(store, rollout_id):
    with start(store, None, index=False) as server:
        return get(server, "/api/rollout?id=" + rollout_id)


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/api/rollouts?sort=secret", 400, "sort must be one of"),
        ("/api/rollouts?order=sideways", 400, "order must be asc or desc"),
        ("/api/rollouts?limit=0", 400, "limit must be between 1 and 500"),
        ("/api/rollouts?limit=abc", 400, "limit must be an integer"),
        ("/api/rollouts?offset=-1", 400, "offset must be between"),
        ("/api/rollouts?min_reward=nan", 400, "min_reward must be a finite number"),
        ("/api/rollouts?min_calls=1e99", 400, "min_calls must be an integer"),
        ("/api/rollouts?step=99999999999999999999", 400, "step must be between"),
        ("/api/rollouts?mode=test", 400, "mode must be train or val"),
        ("/api/rollouts?state=lost", 400, "state must be one of"),
        ("/api/rollouts?task=a&task=b", 400, "given twice"),
        ("/api/rollouts?task=%00", 400, "NUL"),
        ("/api/rollout", 400, "give the rollout's id"),
        ("/api/rollout?id=nope", 404, "no rollout 'nope'"),
        ("/api/rollout?id=" + MERGED_ID + "&attempt=7", 404, "attempt 7"),
        ("/api/rollout?id=" + MERGED_ID + "&attempt=x", 400, "attempt must be an integer"),
        ("/api/step?step=1.5", 400, "step must be an integer"),
        ("/api/step?step=42", 404, "no training step 42"),
        ("/api/nothing", 404, "Not Found"),
        ("/static/..%2Fqueries.py", 404, "no such file"),
    ],
)
def test_bad_requests_are_4xx_json_naming_the_problem(server, path, status, message):
    got, body = get(server, path)
    assert got == status and message in body["error"]


_params = st.dictionaries(
    st.sampled_from(["sort", "order", "limit", "offset", "mode", "state", "task", "id", "step", "cause",
                     "min_reward", "max_reward", "min_calls", "max_breaks", "min_version", "attempt"]),
    st.one_of(st.text(max_size=30), st.integers().map(str), st.floats().map(str)),
    max_size=5,
)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=_params, path=st.sampled_from(["rollouts", "rollout", "step", "overview"]))
def test_no_input_makes_the_api_fail_with_5xx(server, params, path):
    status, body = get(server, f"/api/{path}?" + urllib.parse.urlencode(params))
    assert status < 500, body
    assert status == 200 or "error" in body


def test_reads_while_a_writer_writes_and_never_changes_the_store(tmp_path):
    path = tmp_path / "rollouts.db"
    writer = RolloutStore(path, grace_s=0.0)
    ingest(writer, [call_span("first", 0, [1, 2], [3]), reward_span("first", 1.0), rollout_span("first")])
    with start(path) as server:
        assert get(server, "/api/rollouts")[1]["total"] == 1
        ingest(writer, [call_span("second", 0, [1, 2], [3, 4]), rollout_span("second")])
        assert ids(get(server, "/api/rollouts")[1]) == ["second", "first"]
        wait_until(lambda: get(server, "/api/rollouts?min_calls=1&max_breaks=0")[1]["total"] == 2, "indexing")
        writer.close()
        before = hashlib.sha256(path.read_bytes()).hexdigest()
        for query in ("/api/overview", "/api/rollouts", "/api/rollout?id=first", "/api/rollout?id=second"):
            assert get(server, query)[0] == 200
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_a_missing_or_foreign_store_is_refused_clearly(tmp_path):
    from agl_trainer.viewer import Viewer
    from agl_trainer.store.queries import QueryError as ViewerError

    with pytest.raises(ViewerError, match="no store at"):
        Viewer(tmp_path / "none.db")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(ViewerError, match="not an agl rollout store"):
        Viewer(junk)
    assert not (tmp_path / "none.db").exists()


def test_static_files_ship_with_the_package_and_carry_a_strict_csp(server):
    import urllib.request

    for name in ("", "static/app.js", "static/app.css"):
        with urllib.request.urlopen(server.url + name, timeout=30) as response:
            assert response.status == 200
            assert "script-src 'self'" in response.headers["Content-Security-Policy"]
            body = response.read().decode()
            assert body.strip()
            if name == "static/app.js":  # harness text goes in through textContent only
                assert "innerHTML" not in body.replace("never innerHTML", "")


def test_the_call_tree_of_interleaved_sub_agent_calls_and_extra_call_columns(tmp_path):
    """A main thread (calls 0, 2) and a sub-agent (1, 3) interleaved: two roots, each continued by
    its own thread's next call. A column a newer store adds to `calls` (one this agl does not
    know) reaches the page as it is, under `extra`."""
    import sqlite3

    path = tmp_path / "rollouts.db"
    main, sub = [1, 2, 3, 4], [50, 51, 52]
    with RolloutStore(path, grace_s=0.0) as store:
        ingest(store, [
            call_span("tree", 0, main, [10, 11]),
            call_span("tree", 1, sub, [60]),
            call_span("tree", 2, [*main, 10, 11, 20, 21], [12]),
            call_span("tree", 3, [*sub, 60, 70], [61, 62]),
            reward_span("tree", 1.0), rollout_span("tree"),
        ])  # fmt: skip
        store.refresh_completion()
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE calls ADD COLUMN zone TEXT")
    db.execute("UPDATE calls SET zone = 'us-east' WHERE call_seq = 2")
    db.commit()
    db.close()
    with start(path, index=False) as server:
        status, body = get(server, "/api/rollout?id=tree")
    assert status == 200
    parents = {p["call_seq"]: p.get("parent") for p in body["placements"]}
    assert parents == {0: None, 1: None, 2: 0, 3: 1}
    assert [s["call_seqs"] for s in body["samples"]] == [[0, 2], [1, 3]]
    zones = {c["call_seq"]: c["extra"].get("zone") for c in body["calls"]}
    assert zones == {0: None, 1: None, 2: "us-east", 3: None}


def test_a_page_elsewhere_cannot_read_the_viewer_through_dns_rebinding(server):
    import http.client

    port = int(server.url.rsplit(":", 1)[1].strip("/"))
    for host, status in (("evil.example:80", 403), (f"localhost:{port}", 200), (f"127.0.0.1:{port}", 200)):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/api/overview", headers={"Host": host})
        response = connection.getresponse()
        body = json.loads(response.read())
        connection.close()
        assert response.status == status, (host, body)
    assert "loopback host name" in get_error_for_rebinding(server)


def get_error_for_rebinding(server) -> str:
    import http.client

    port = int(server.url.rsplit(":", 1)[1].strip("/"))
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/", headers={"Host": "attacker.test"})
    response = connection.getresponse()
    return json.loads(response.read())["error"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:8500", ("127.0.0.1", 8500)), ("[::1]:0", ("::1", 0)), (":9000", ("127.0.0.1", 9000)),
     ("0.0.0.0:80", ("0.0.0.0", 80))],
)  # fmt: skip
def test_listen_addresses(text, expected):
    from agl_trainer.viewer import parse_listen

    assert parse_listen(text) == expected


@pytest.mark.parametrize("text", ["localhost", "host:port", "1.2.3.4:70000", ""])
def test_bad_listen_addresses(text):
    from agl_trainer.viewer import ListenError, parse_listen

    with pytest.raises(ListenError, match="HOST:PORT"):
        parse_listen(text)
