"""The viewer in a real browser (Debian's headless Chromium): the pages render the store's data,
merge breaks and decoded text, and harness text (a hostile rollout id) stays text."""

from __future__ import annotations

import html
import re
import urllib.parse

import pytest

from tests.support.required import requires
from tests.viewer import browser
from tests.viewer.stores import BROKEN_ID, FIELDS_PASSED, HELD_MS, HOSTILE_ID, MERGED_ID, PARTNER_ID, UPSTREAM

EXECUTABLE, WHY = browser.chromium()
pytestmark = [pytest.mark.slow, requires(EXECUTABLE is not None, WHY)]  # under CI=true: fails if missing


def rollout_url(server, rollout_id: str) -> str:
    return server.url + "#/rollout?" + urllib.parse.urlencode({"id": rollout_id})


def test_the_rollouts_page_lists_the_stores_rollouts(server):
    dom = browser.dump_dom(EXECUTABLE, server.url + "#/", expect='id="rollouts"')
    table = dom[dom.index('<table id="rollouts"') :]
    for rollout_id in (MERGED_ID, PARTNER_ID, BROKEN_ID):
        assert f">{rollout_id}</a>" in table
    assert "1–4 of 4" in dom
    assert "<svg" in dom and "step 1: reward" in dom  # the reward curve, drawn from JSON


def test_a_rollout_page_shows_decoded_text_and_its_merge_break(server):
    dom = browser.dump_dom(EXECUTABLE, rollout_url(server, BROKEN_ID), expect="merge break (retokenization)")
    assert "merge break (retokenization)" in dom and "before call 1" in dom
    tokens = re.findall(r'<span class="tok r-(\w)" title="[^"]*">([^<]*)</span>', dom)
    assert "".join(text for role, text in tokens if role == "c") == html.escape(
        "hello world<|im_end|>hello world<|im_end|>", quote=False
    )
    assert 'title="#6 · token' in dom and "policy v0 · logprob -0.5" in dom  # hover: version and logprob


def test_a_merged_rollout_colours_prompt_completion_and_tool_output(server, tmp_path):
    url = rollout_url(server, MERGED_ID)
    dom = browser.dump_dom(EXECUTABLE, url, expect="Sample 0")
    roles = {role for role, _ in re.findall(r'<span class="tok r-(\w)" title="[^"]*">([^<]*)</span>', dom)}
    assert roles == {"p", "c", "t"}
    assert "call 1 ▸" in dom and "merged → sample 0" in dom  # the call tree: call 1 continues call 0
    # call 1 was held by a paused sidecar: a hatched segment on its bar, its held ms and attribution
    assert dom.count('class="bar held"') == 1 and f">{HELD_MS} ms</td>" in dom
    assert f"upstream {UPSTREAM}, api openai.chat_completions" in dom
    # the request's fields the front did not interpret: counted, each listed (harness text as text)
    assert "<summary>2 dropped, 1 passed</summary>" in dom
    assert "<li>dropped: metadata.&lt;b&gt;user_id&lt;/b&gt;: not an engine option</li>" in dom
    assert f"<li>passed: {FIELDS_PASSED[0]}</li>" in dom and "<b>user_id</b>" not in dom
    shot = browser.screenshot(EXECUTABLE, url, tmp_path / "rollout.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_a_hostile_rollout_id_renders_as_text_not_as_an_element(server, tmp_path):
    home = browser.dump_dom(EXECUTABLE, server.url + "#/", expect='id="rollouts"')
    page = browser.dump_dom(EXECUTABLE, rollout_url(server, HOSTILE_ID), expect='id="rollout-id"')
    for dom in (home, page):
        assert "<img" not in dom and "<i>task</i>" not in dom and dom.count("<script") == 1  # app.js only
        assert "&lt;img src=x onerror=alert(1)&gt;\\x1b[31m\"\\u202e" in dom  # ESC and the bidi override shown
    tokens = re.findall(r'<span class="tok r-\w" title="[^"]*">([^<]*)</span>', page)
    assert "<b>bold</b> <script>alert(2)</script>" in html.unescape("".join(tokens))  # the completion, as text
    browser.screenshot(EXECUTABLE, server.url + "#/", tmp_path / "rollouts.png")
    assert (tmp_path / "rollouts.png").stat().st_size > 20_000


def test_a_step_page_shows_advantages(server):
    dom = browser.dump_dom(EXECUTABLE, server.url + "#/step?step=1", expect='id="step-rollouts"')
    assert "Training step 1" in dom and f">{MERGED_ID}</a>" in dom
    assert ">0.5</td>" in dom and ">-0.5</td>" in dom  # advantage = reward − group mean


def test_reward_times_read_as_times_not_nanoseconds(server):
    dom = browser.dump_dom(EXECUTABLE, rollout_url(server, MERGED_ID), expect="<h2>Rewards</h2>")
    table = dom[dom.index("<h2>Rewards</h2>") :]
    table = table[: table.index("</table>")]
    # the reward spans end 1 µs after T0, when call 0 started: "+0.00 ms · <local date and time>"
    assert table.count("+0.00 ms · ") == 2 and "2023" in table  # T0 is 2023-11-14 22:13:20 UTC
    assert ">1700000000000001000<" not in table and 'title="1700000000000001000 ns"' in table
