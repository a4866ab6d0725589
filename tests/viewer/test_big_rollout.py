"""One big rollout never stalls the viewer: a 20,000-call rollout is served a page at a time; a
request has a time budget (504 over it) and a bounded pool (503 when busy); a request whose client
left is stopped, so abandoned requests do not hang the API (8 of them did)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
from agl_trainer.store import RolloutStore
from agl_trainer.store.records import CallSpan, RewardSpan, RolloutSpan
from agl_trainer.viewer import Viewer, ViewerServer, detail

from tests.support.waiting import wait_until

BIG = "big-20000-calls"
T0 = 1_700_000_000_000_000_000


def write_big_rollout(path: Path, calls: int) -> None:
    """A thread of `calls` calls, each prompt extending the last call by reference (as the sidecar
    records them): 28 new tokens a call, 560k tokens in one sample at 20,000 calls."""
    rng = np.random.default_rng(0)
    records: list = []
    length = 0
    for seq in range(calls):
        suffix = rng.integers(5, 300, 24 if seq else 48).astype(np.int32)
        completion = rng.integers(5, 300, 4).astype(np.int32)
        records.append(CallSpan(
            span_id=os.urandom(8), call_seq=seq, name="chat big", end_ns=T0 + seq * 1000 + 500, prompt_ids=suffix,
            completion_ids=completion, logprobs=np.full(4, -0.25, np.float32),
            prompt_ref_seq=None if seq == 0 else seq - 1, prompt_ref_length=None if seq == 0 else length,
            prompt_length=None, policy_version=0, finish_reason="stop", end_reason="completed",
            tokens_source="engine", trace_id=b"\x01" * 16, rollout_id=BIG, attempt=0, task_id="t", mode="train",
            start_ns=T0 + seq * 1000, status_code=0,
        ))  # fmt: skip
        length += suffix.size + completion.size
    records.append(RewardSpan(span_id=os.urandom(8), name="reward", value=1.0, call_seq=None, end_ns=T0,
                              trace_id=b"\x01" * 16, rollout_id=BIG, attempt=0, task_id="t"))  # fmt: skip
    records.append(RolloutSpan(trace_id=b"\x01" * 16, span_id=os.urandom(8), rollout_id=BIG, attempt=0, task_id="t",
                               mode="train", status="succeeded", start_ns=T0, end_ns=T0 + calls * 1000, error=None))  # fmt: skip
    with RolloutStore(path, durability="normal", grace_s=0.0) as store:
        store.write_batches([records])
        store.refresh_completion()


def get(server: ViewerServer, path: str) -> tuple[int, dict]:
    port = int(server.url.rstrip("/").rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    connection.request("GET", path)
    response = connection.getresponse()
    body = json.loads(response.read())
    connection.close()
    return response.status, body


def test_a_20000_call_rollout_is_served_a_page_at_a_time(tmp_path: Path) -> None:
    # Before: assembling it did not finish in 120 s, and its page would have held every token.
    path = tmp_path / "big.db"
    write_big_rollout(path, 20_000)
    with ViewerServer(Viewer(path, index=False), "127.0.0.1:0") as server:
        status, body = get(server, f"/api/rollout?id={BIG}")
        assert status == 200, body
        page = body["page"]
        assert (page["calls_total"], page["samples_total"], len(body["calls"]), len(body["placements"])) == (20_000, 1, 500, 500)
        [sample] = body["samples"]
        assert sample["length"] == 48 + 4 + 19_999 * 28 and sample["offset"] == 0
        assert len(sample["ids"]) == len(sample["roles"]) == len(sample["logprobs"]) == len(sample["text"]) == 20_000
        assert all(b["position"] < 20_000 for b in sample["boundaries"])
        end = sample["length"] - 20  # the last 20 tokens
        status, last = get(server, f"/api/rollout?id={BIG}&calls_offset=19900&tokens_offset={end}&tokens_limit=100")
        assert status == 200 and [c["call_seq"] for c in last["calls"]] == list(range(19_900, 20_000))
        [tail] = last["samples"]
        # the window's last 4 tokens are call 19,999's completion, trained; its boundary is within the window
        assert tail["offset"] == end and tail["roles"][-5:] == "tcccc" and len(tail["ids"]) == 20
        assert {"position": 16, "call_seq": 19_999, "completion": True} in tail["boundaries"]
        status, bad = get(server, f"/api/rollout?id={BIG}&tokens_limit=0")
        assert status == 400 and "tokens_limit" in bad["error"]


@pytest.fixture()
def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.db"
    write_big_rollout(path, 300)
    return path


def test_over_its_budget_a_request_is_a_504_and_its_work_stops(small: Path) -> None:
    viewer = Viewer(small, index=False, budget_s=0.0)
    with ViewerServer(viewer, "127.0.0.1:0") as server:
        status, body = get(server, f"/api/rollout?id={BIG}")
        assert status == 504 and "budget" in body["error"] and "calls_limit" in body["error"]
        wait_until(lambda: viewer.pool.pending == 0, "the stopped request's work to end")
        assert viewer.pool.stats["over_budget"] == 1 and viewer.pool.stats["stopped"] == 1


def test_abandoned_requests_are_stopped_and_never_hang_the_api(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()  # holds each request's work until its client has gone
    real = detail.rollout

    def held(*args, **kwargs):
        gate.wait(timeout=60)
        return real(*args, **kwargs)

    monkeypatch.setattr(detail, "rollout", held)
    viewer = Viewer(small, index=False, workers=2)
    with ViewerServer(viewer, "127.0.0.1:0") as server:
        port = int(server.url.rstrip("/").rsplit(":", 1)[1])
        for _ in range(8):  # 8 clients ask for the rollout and leave
            client = socket.create_connection(("127.0.0.1", port))
            client.sendall(f"GET /api/rollout?id={BIG} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            client.close()
        wait_until(lambda: viewer.pool.stats["abandoned"] == 8, "the server to see 8 clients leave")
        gate.set()
        wait_until(lambda: viewer.pool.pending == 0, "the abandoned work to stop")
        assert viewer.pool.stats["stopped"] == 8  # each stopped at its first check, none ran to the end
        assert get(server, "/api/overview")[0] == 200
        assert get(server, f"/api/rollout?id={BIG}")[0] == 200


def test_more_requests_than_admitted_are_a_503_at_once(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = detail.rollout
    monkeypatch.setattr(detail, "rollout", lambda *a, **k: (gate.wait(timeout=60), real(*a, **k))[1])
    viewer = Viewer(small, index=False, workers=1, max_pending=2)
    with ViewerServer(viewer, "127.0.0.1:0") as server:
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(get(server, f"/api/rollout?id={BIG}")[0]))
                   for _ in range(2)]  # fmt: skip
        for thread in threads:
            thread.start()
        wait_until(lambda: viewer.pool.pending == 2, "two requests admitted")
        status, body = get(server, "/api/overview")
        assert status == 503 and "busy" in body["error"]
        gate.set()
        for thread in threads:
            thread.join(timeout=60)
        assert results == [200, 200] and get(server, "/api/overview")[0] == 200


@pytest.mark.slow
def test_the_page_of_a_big_rollout_says_what_it_shows_and_links_the_rest(tmp_path: Path) -> None:
    from tests.support.required import on_ci
    from tests.viewer import browser

    executable, why = browser.chromium()
    if executable is None:  # under CI=true a missing browser fails (support/required.py)
        pytest.fail(why) if on_ci() else pytest.skip(why)
    path = tmp_path / "big.db"
    write_big_rollout(path, 600)
    with ViewerServer(Viewer(path, index=False), "127.0.0.1:0") as server:
        dom = browser.dump_dom(executable, f"{server.url}#/rollout?id={BIG}&tokens_limit=1000", expect="Sample 0")
    total = 48 + 4 + 599 * 28
    assert "calls 1–500 of 600" in dom and f"tokens 1–1000 of {total}" in dom
    assert f'href="#/rollout?id={BIG}&amp;tokens_limit=1000&amp;calls_offset=500"' in dom
    assert f'href="#/rollout?id={BIG}&amp;tokens_limit=1000&amp;tokens_offset=1000"' in dom
