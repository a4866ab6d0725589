"""The report from stored spans and the tap's exchanges: rows matched by API and time, the lists of
fields the front did not interpret, declared structure, refusals and the verdict's rules; and the
terminal rendering keeps harness text as text."""

from __future__ import annotations

from pathlib import Path

import pytest
from agl import semconv
from rich.console import Console

from agl_trainer.harness_check import chatml
from agl_trainer.harness_check.render import render, table_row
from agl_trainer.harness_check.report import HarnessRun, build
from agl_trainer.harness_check.tap import Exchange
from agl_trainer.store import RolloutStore

from tests.dataplane.ingest import ingest
from tests.dataplane.otlp import call_span, with_attributes

T0 = 1_800_000_000_000_000_000
MS = 1_000_000
OK = HarnessRun(command=["agent"], exit_code=0, outcome="ok", message="", seconds=1.0, log_tail="")
PROMPT = [chatml.IM_START, *chatml.encode("user\nhi"), chatml.IM_END, chatml.IM_START]
ANSWER = [*chatml.encode("hello"), chatml.IM_END]


def stored(tmp_path: Path, *spans) -> tuple:
    with RolloutStore(tmp_path / "rollouts.db", grace_s=0.0) as store:
        ingest(store, spans)
        data, rows = store.load_with_rows("r")
    return data, [int(start) for start in rows.column("start_ns")]


def exchange(path: str, start_ms: int, status: int = 200, **fields) -> Exchange:
    return Exchange("POST", "/rollouts/r" + path, T0 + start_ms * MS, T0 + (start_ms + 50) * MS, status, **fields)


def test_rows_follow_the_requests_and_each_span_finds_its_own_by_api_and_time(tmp_path):
    """A chat call and a Messages call in flight together: each span goes to the latest request of
    its own API that began before it, whatever the other API did meanwhile."""
    messages = with_attributes(
        call_span("r", 7, PROMPT, ANSWER, start_ns=T0 + 3 * MS, model="claude-x"),
        agl__call__api=semconv.API_ANTHROPIC_MESSAGES,
        agl__request__fields__dropped=["context_management: not an engine option", "metadata.[red]user_id[/red]: x"],
        agl__request__fields__passed=["output_config: sent as written"],
    )
    chat = with_attributes(call_span("r", 8, PROMPT, ANSWER, start_ns=T0 + 4 * MS), agl__call__api=semconv.API_CHAT_COMPLETIONS)
    data, starts = stored(tmp_path, messages, chat)
    exchanges = [
        exchange("/v1/chat/completions", 0, model="tiny"),
        exchange("/v1/messages?beta=true", 1, model="claude-x", stream=True),
        exchange("/v1/messages/count_tokens?beta=true", 2, features=["token counting"]),
        exchange("/v1/messages?beta=true", 5, status=400, error='{"type":"error","error":{"message":"bad `x`\x1b[2J"}}'),
    ]
    report = build("agent", None, "r", OK, exchanges, data, starts, {}, 0)
    rows = report.calls
    assert [(r.number, r.path, r.status) for r in rows] == [
        (1, "/v1/chat/completions", 200), (2, "/v1/messages?beta=true", 200),
        (3, "/v1/messages/count_tokens?beta=true", 200), (4, "/v1/messages?beta=true", 400),
    ]  # fmt: skip
    assert rows[0].recorded.call_seq == 8 and rows[1].recorded.call_seq == 7
    assert rows[1].fields_dropped == ["context_management: not an engine option", "metadata.[red]user_id[/red]: x"]
    assert rows[1].fields_passed == ["output_config: sent as written"] and rows[0].fields_dropped == []
    assert rows[1].stream is True and rows[1].model == "claude-x"
    assert rows[2].recorded is None and rows[2].problems == []  # token counting makes no span, and needs none
    assert rows[3].problems == ["refused: HTTP 400"] and rows[3].refused.startswith('{"type":"error","error"')
    assert not report.ok and report.verdict == "does not work through agl yet: #4 refused: HTTP 400"
    assert report.features == ["token counting"]

    console = Console(record=True, width=200)
    render(console, report)
    text = console.export_text()
    assert "dropped: context_management: not an engine option" in text
    assert "dropped: metadata.[red]user_id[/red]: x" in text  # harness text is text, not rich markup
    assert "passed unread: output_config: sent as written" in text
    row = next(line for line in text.splitlines() if line.startswith("│ 2 "))
    assert "anthropic.messages" in row and "claude-x" in row  # two APIs, two models: each row says its own
    assert 'answer: {"type":"error","error":{"message":"bad `x`\\x1b[2J"}}' in text  # the escape shown, not run
    assert text.rstrip().splitlines()[-1] == "✗ does not work through agl yet: #4 refused: HTTP 400"
    assert table_row(report) == (
        "| agent | - | token counting | fails: #4 refused: HTTP 400 |"
    )


def test_a_model_request_answered_without_a_span_and_a_span_without_tokens_fail(tmp_path):
    absent = call_span("r", 1, PROMPT, ANSWER, start_ns=T0 + 2 * MS, tokens_source=semconv.TOKENS_ABSENT)
    data, starts = stored(tmp_path, absent)
    exchanges = [exchange("/v1/chat/completions", 0), exchange("/v1/chat/completions", 1)]
    report = build("agent", None, "r", OK, exchanges, data, starts, {"call.missing_rollout_id": 2}, 3)
    first, second = report.calls
    assert first.recorded is None and first.problems == ["no call recorded"]
    assert second.problems == ["recorded without the engine's token IDs (tokens: absent)"]
    assert report.problems == ["2 span(s) broke the span contract: call.missing_rollout_id", "3 span(s) did not reach the receiver"]
    assert not report.ok


def test_declared_agents_and_a_compaction_are_recorded_and_exercised(tmp_path):
    main = with_attributes(call_span("r", 1, PROMPT, ANSWER, start_ns=T0 + MS), agl__call__agent_id="main")
    sub = with_attributes(
        call_span("r", 2, PROMPT, ANSWER, start_ns=T0 + 2 * MS), agl__call__agent_id="sub", agl__call__parent_agent_id="main"
    )
    compacted = with_attributes(
        call_span("r", 3, [*PROMPT, *ANSWER], ANSWER, start_ns=T0 + 3 * MS), agl__call__agent_id="main", agl__call__compaction=True
    )
    data, starts = stored(tmp_path, main, sub, compacted)
    report = build("agent", "1.0", "r", OK, [], data, starts, {}, 0)
    assert [row.recorded.agent_id for row in report.calls] == ["main", "sub", "main"]
    assert report.calls[1].recorded.parent_agent_id == "main" and report.calls[2].recorded.compaction
    assert report.calls[2].placement == "new sample: the harness declared a compaction"
    assert report.features == ["sub-agents", "compaction"]
    assert [row.method for row in report.calls] == [None] * 3  # spans the tap did not see keep their rows
    assert report.ok  # the harness exited 0 after model calls recorded with tokens, none refused
    assert report.samples == 3 and [b.call for b in report.breaks] == [2]  # the sub-agent's first call
    assert table_row(report) == (
        "| agent | 1.0 | sub-agents, compaction | works: 3 call(s) recorded, 3 sample(s), 1 merge break(s) |"
    )


@pytest.mark.parametrize(
    ("outcome", "message", "problem"),
    [("harness_error", "exited with code 3", "the harness exited with code 3"),
     ("timeout", "killed after 5 s", "the harness killed after 5 s")],
)  # fmt: skip
def test_a_harness_that_fails_fails_the_check_even_with_good_calls(tmp_path, outcome, message, problem):
    data, starts = stored(tmp_path, call_span("r", 1, PROMPT, ANSWER, start_ns=T0 + MS))
    run = HarnessRun(command=["agent"], exit_code=3, outcome=outcome, message=message, seconds=5.0, log_tail="")
    report = build("agent", None, "r", run, [exchange("/v1/chat/completions", 0)], data, starts, {}, 0)
    assert report.calls[0].problems == [] and report.problems == [problem] and not report.ok


def test_the_verdict_says_a_repeated_problem_once_with_its_rows(tmp_path):
    """Claude Code retries a refused call: six refusals read as one problem on rows #1-#6."""
    refused = [exchange("/v1/messages?beta=true", i, status=400, error="{}") for i in range(6)]
    report = build("agent", None, "r", OK, [*refused, exchange("/v1/messages/count_tokens", 9, status=404, error="{}")],
                   None, [], {}, 0)  # fmt: skip
    assert report.verdict == "does not work through agl yet: #1-#6 refused: HTTP 400; #7 refused: HTTP 404"
