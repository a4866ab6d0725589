"""`agl harness check` end to end: tiny Python harnesses run against a real sidecar subprocess, the
scripted engine, the receiver and a store, through `agl`'s own entry point; the report says what the
harness got and what was recorded, and the exit code is the verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agl_trainer.cli import main

HARNESSES = Path(__file__).parent / "harnesses"
pytestmark = pytest.mark.slow  # each check starts a sidecar and a Python harness: seconds


def harness(name: str) -> list[str]:
    return [sys.executable, str(HARNESSES / name)]


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(["harness", "check", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def tool_then_answer(tmp_path: Path) -> Path:
    script = tmp_path / "script.yaml"
    script.write_text("turns:\n  - tool_calls: [{name: ls, arguments: {}}]\n  - content: It holds notes.txt.\n")
    return script


def test_two_calls_with_a_tool_result_between_merge_into_one_sample(capsys, tool_then_answer):
    code, report = check(capsys, "--script", str(tool_then_answer), "--", *harness("tool_loop.py"))
    assert code == 0 and report["ok"] is True, report["verdict"]
    first, second = report["calls"]
    assert [c["path"] for c in report["calls"]] == ["/v1/chat/completions"] * 2
    assert [c["status"] for c in report["calls"]] == [200, 200]
    assert (first["stream"], second["stream"]) == (True, False)
    assert first["answer"] == '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    assert second["answer"] == "It holds notes.txt."
    for call in report["calls"]:
        recorded = call["recorded"]
        assert recorded["token_ids"] and recorded["logprobs"] and recorded["policy_version"] == 0
        assert call["model"] == "tiny" and call["problems"] == [] and call["refused"] is None
    assert first["recorded"]["finish_reason"] == "tool_calls" and second["recorded"]["finish_reason"] == "stop"
    # the second prompt is the first's sequence, the tool's result and the new turn: one sample
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
    assert (first["sample"], second["sample"]) == (0, 0) and second["placement"] == "merged onto #1"
    assert report["samples"] == 1 and report["breaks"] == []
    assert report["features"] == ["streaming", "tools", "tool results"]
    assert report["verdict"].endswith("they merge into one sample")
    assert "It holds notes.txt." in report["harness"]["log_tail"]  # the harness got the scripted answer


def test_a_second_call_that_rewrites_the_history_is_a_classified_break(capsys):
    code, report = check(capsys, "--", *harness("rewrites_history.py"))
    assert code == 0, report["verdict"]  # a break costs a merge, not the harness's place in training
    first, second = report["calls"]
    assert (first["sample"], second["sample"]) == (0, 1)
    assert second["placement"] == "new sample: extends no earlier call"
    [item] = report["breaks"]
    assert (item["call"], item["previous_call"], item["kind"], item["classified_by"]) == (2, 1, "other", "tokenizer")
    # the text at the break: the system prompt the harness edited
    assert item["position"] == len("<|im_start|>system\nBe ") - len("<|im_start|>") + 1  # one special token
    assert item["expected"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi.")
    assert item["got"].startswith("<|im_start|>system\nBe very brief.")
    assert report["samples"] == 2 and report["verdict"].endswith("they make 2 samples (1 other break)")


def test_an_unknown_field_through_messages_is_listed_as_dropped_or_passed(capsys):
    """The rule for what the sidecar does not know (docs/protocols.md): an additive field is never a
    400; the span lists what became of it, and the check shows the list."""
    code, report = check(capsys, "--", *harness("unknown_field.py"))
    [call] = report["calls"]
    assert (call["path"], call["api"]) == ("/v1/messages", "anthropic.messages")
    assert call["status"] == 200 and call["refused"] is None, call["refused"]
    listed = call["fields_dropped"] + call["fields_passed"]
    assert [e for e in listed if e.split(":")[0].removeprefix("$.") == "agl_check_unknown_field"], listed
    assert code == 0 and report["ok"] is True


def test_a_refused_request_is_listed_with_its_body_and_fails_the_check(capsys):
    code, report = check(capsys, "--", *harness("refused.py"))
    assert code == 1 and report["ok"] is False
    good, bad = report["calls"]
    assert (good["status"], good["recorded"]["token_ids"], good["problems"]) == (200, True, [])
    assert bad["status"] == 400 and bad["recorded"] is None and bad["problems"] == ["refused: HTTP 400"]
    assert "max_tokens" in bad["refused"]  # the sidecar's 400 names the field
    assert report["verdict"] == "does not work through agl yet: #2 refused: HTTP 400"


def test_a_harness_that_calls_no_model_through_agl_fails_with_the_fix(capsys):
    code, report = check(capsys, "--", *harness("no_call.py"))
    assert code == 1 and report["calls"] == []
    [problem] = report["problems"]
    assert problem.startswith("the harness made no model call through agl (fix: it must take its endpoint from")
    assert report["harness"]["log_tail"] == "done without a model\n"


def test_the_terminal_report_and_the_table_row(capsys, tmp_path, tool_then_answer, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code = main(["harness", "check", "--script", str(tool_then_answer), "--name", "tool loop", "--harness-version",
                 "0.1", "--keep", str(tmp_path / "kept"), "--", *harness("tool_loop.py")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "/v1/chat/completions" in out and "token IDs, logprobs, v0" in out
    assert "#2  assembly: merged onto #1" in out and "samples: 1 (sample 0: #1 → #2)" in out
    assert out.rstrip().splitlines()[-1].startswith("✓ works through agl: 2 call(s) recorded with token IDs")
    kept = tmp_path / "kept"
    assert {"rollouts.db", "harness.log", "sidecar.log"} <= {p.name for p in kept.iterdir()}
    # the kept store is a store: the trace tools read it
    assert main(["traces", "ls", "--store", str(kept / "rollouts.db")]) == 0
    assert "harness-check-" in capsys.readouterr().out


def test_the_json_report_has_the_documented_shape(capsys, tmp_path, tool_then_answer):
    code, report = check(capsys, "--script", str(tool_then_answer), "--name", "tool loop", "--", *harness("tool_loop.py"))
    assert code == 0
    assert set(report) == {"schema", "name", "version", "rollout_id", "harness", "calls", "samples", "breaks",
                           "features", "reward", "problems", "ok", "verdict"}  # fmt: skip
    assert report["schema"] == 1 and report["name"] == "tool loop" and report["version"] is None
    assert set(report["harness"]) == {"command", "exit_code", "outcome", "message", "seconds", "log_tail"}
    assert report["harness"]["command"] == harness("tool_loop.py") and report["harness"]["exit_code"] == 0
    assert set(report["calls"][0]) == {
        "number", "method", "path", "status", "api", "model", "stream", "prompt_tokens", "completion_tokens",
        "recorded", "fields_dropped", "fields_passed", "refused", "answer", "sample", "placement", "problems",
    }  # fmt: skip
    assert set(report["calls"][0]["recorded"]) == {
        "call_seq", "token_ids", "logprobs", "tokens_source", "policy_version", "agent_id", "parent_agent_id",
        "compaction", "origin", "finish_reason", "end_reason",
    }  # fmt: skip
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report))
    assert main(["harness", "table", str(saved)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "| harness | version | features exercised | result |",
        "|---|---|---|---|",
        "| tool loop | - | streaming, tools, tool results | works: 2 call(s) recorded, 1 sample(s) |",
    ]


def test_a_config_gives_the_command_env_cwd_and_first_task_and_flags_win(capsys, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t1", "question": "2+2?"}\n{"id": "t2", "question": "3+3?"}\n')
    config = tmp_path / "config.yaml"
    config.write_text(
        f"tasks: {tasks}\nharness:\n  command: {json.dumps(harness('env_and_task.py'))}\n"
        f"  env: {{GREETING: from-config}}\n  cwd: {tmp_path}\n"
    )
    code, report = check(capsys, "--config", str(config), "--env", "GREETING=from-flag")
    assert code == 0, report["verdict"]
    printed = report["harness"]["log_tail"].splitlines()
    rollout = report["rollout_id"]
    assert printed[0] == f"GREETING from-flag TASK t1 ROLLOUT {rollout} CWD {tmp_path}"
    anthropic_url, openai_url = printed[1].split()[1::2]
    assert openai_url == anthropic_url + "/v1" and anthropic_url.endswith(f"/rollouts/{rollout}")  # as runners set them
