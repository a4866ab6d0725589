"""The viewer and the sidecar's call numbers: seqs are clock readings near 2^59, past the integers a
JavaScript number holds exactly (2^53), so the API sends each seq beyond that as a decimal string and
the page shows every digit on hover; the page numbers a rollout's calls 0, 1, 2 (a seq is unreadable
as a name); a per-call reward named by position (0 = the rollout's first call) shows on the call it
trains, as assembly places it. Before, such a reward showed on no call, and seqs lost their last
digits in the page."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from agl_trainer.store import RolloutStore

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, reward_span, rollout_span
from tests.support.required import requires
from tests.viewer import browser
from tests.viewer.conftest import get, start
from tests.viewer.stores import T0, save_tokenizer
from agl_testing.tiny_tokenizer import encode, special

CLOCK_ID = "clock-numbered"
FIRST = (1 << 59) + 1  # 576460752303423489: a JS number reads it as ...488
SECOND = FIRST + 257
EXECUTABLE, WHY = browser.chromium()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    folder = tmp_path_factory.mktemp("clock")
    start_id, end = special("<|im_start|>"), special("<|im_end|>")
    prompt = [start_id, *encode("user hello world"), end, start_id]
    answer = [*encode("the answer is 42"), end]
    spans = [
        call_span(CLOCK_ID, FIRST, prompt, answer, start_ns=T0, end_ns=T0 + 10_000_000),
        call_span(CLOCK_ID, SECOND, [*prompt, *answer, start_id], answer, start_ns=T0 + 20_000_000,
                  end_ns=T0 + 30_000_000),  # fmt: skip
        reward_span(CLOCK_ID, 0.75, call_seq=1),  # by position: the second call
        reward_span(CLOCK_ID, 1.0),
        rollout_span(CLOCK_ID),
    ]
    with RolloutStore(folder / "rollouts.db", grace_s=0.0) as store:
        ingest(store, spans)
        store.refresh_completion()
    with start(folder / "rollouts.db", save_tokenizer(folder / "tokenizer")) as running:
        yield running


def test_seqs_past_2_53_are_exact_strings_and_a_reward_by_position_is_on_its_call(server) -> None:
    status, body = get(server, "/api/rollout?id=" + CLOCK_ID)
    assert status == 200
    calls = {call["call_seq"]: call for call in body["calls"]}
    assert set(calls) == {str(FIRST), str(SECOND)}  # strings: JSON.parse keeps every digit
    assert calls[str(SECOND)]["reward"] == 0.75 and calls[str(FIRST)]["reward"] is None
    assert calls[str(SECOND)]["placement"]["parent"] == str(FIRST)
    assert {p["call_seq"] for p in body["placements"]} == {str(FIRST), str(SECOND)}
    assert [s["call_seqs"] for s in body["samples"]] == [[str(FIRST), str(SECOND)]]
    assert {b["call_seq"] for b in body["samples"][0]["boundaries"]} == {str(FIRST), str(SECOND)}
    per_call = [r for r in body["rewards"] if r["call_seq"] is not None]
    assert per_call == [{**per_call[0], "call_seq": 1, "for_call": str(SECOND)}]  # as sent, and whose it is
    assert [call["number"] for call in body["calls"]] == [0, 1]  # in the rollout, in seq order
    assert body["call_numbers"] == {str(FIRST): 0, str(SECOND): 1}  # for every seq the page names
    # JSON.parse's reading of the text, in Python: every seq survives a double
    text = json.dumps(body)
    assert str(FIRST) in text and float(str(FIRST)) != FIRST


@pytest.mark.slow
@requires(EXECUTABLE is not None, WHY)
def test_the_page_shows_every_digit_and_the_reward_on_its_call(server) -> None:
    url = server.url + "#/rollout?" + urllib.parse.urlencode({"id": CLOCK_ID})
    dom = browser.dump_dom(EXECUTABLE, url, expect="Sample 0")
    first, second = (f'title="seq {seq} (unique across restarts)">' for seq in (FIRST, SECOND))
    assert first + "#0<" in dom and second + "#1<" in dom  # numbered, every digit of the seq on hover
    assert second + "call 1 ▸<" in dom  # the sample's boundary
    assert str(FIRST - 1) not in dom  # what a JS number would have shown
    calls = dom[dom.index('id="calls"') :]
    row = calls[calls.index(second + "#1<") :]  # its row in the calls table
    row = row[: row.index("</tr>")]
    assert ">0.75</td>" in row  # the reward given by position, on the call it trains
    rewards = dom[dom.index("<h2>Rewards</h2>") :]
    assert second + "call #1<" in rewards[: rewards.index("</table>")]
