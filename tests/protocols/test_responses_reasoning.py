"""Reasoning across calls, token for token: a Responses client that keeps its history itself (`store:
false`, `include: ["reasoning.encrypted_content"]`, as Codex does) sends the engine's reasoning back
opaque; the sidecar's token in `encrypted_content` renders it back as written, so the second call's
prompt extends the first call's prompt and completion exactly, reasoning included, and assembly
makes one sample of both. Through the real sidecar, receiver and store, to an engine with a real
tokenizer and a chat template that renders reasoning in history."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from agl_testing.template_engine import REASONING_TOOLS_TEMPLATE, Answer, TemplateEngine
from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.models.tiny import build_bpe_tokenizer
from tests.support.pipeline import pipeline

THOUGHT = "The user wants the files listed.\nI will run ls first, then answer."
SHELL = {"type": "function", "name": "exec_command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}  # fmt: skip
BODY = {"model": "tiny", "stream": True, "store": False, "include": ["reasoning.encrypted_content"],
        "reasoning": {"summary": "auto"}, "tools": [SHELL],
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]}]}  # fmt: skip


def script(request: dict[str, Any], n: int) -> Answer:
    if n == 0:
        return Answer(reasoning=THOUGHT, tool_calls=(("exec_command", json.dumps({"cmd": "ls"})),))
    return Answer(reasoning="It printed one file.", content="There is a.py.")


def completed(answer: httpx.Response) -> dict[str, Any]:
    assert answer.status_code == 200, answer.text
    events = [json.loads(line[6:]) for line in answer.text.split("\n") if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed"
    return events[-1]["response"]


def without_token(item: dict[str, Any]) -> dict[str, Any]:
    """A reasoning item as a client that keeps only what it shows would send it back: no content."""
    return {"type": "reasoning", "id": item["id"], "summary": []} if item["type"] == "reasoning" else item


@pytest.mark.parametrize("carry", ["as_codex", "without_token"])
def test_the_next_prompt_extends_the_last_call_across_its_reasoning(tmp_path: Path, carry: str) -> None:
    tokenizer = build_bpe_tokenizer(vocab_size=600)
    tokenizer.chat_template = REASONING_TOOLS_TEMPLATE
    with TemplateEngine(tokenizer, script) as engine, pipeline(tmp_path, engine.base_url) as piped:
        url = f"{piped.sidecar_url}/rollouts/think/v1/responses"
        first = completed(httpx.post(url, json=BODY, timeout=60))
        output = first["output"] if carry == "as_codex" else [without_token(i) for i in first["output"]]
        call = next(item for item in output if item["type"] == "function_call")
        second = {**BODY, "input": [*BODY["input"], *output,
                                    {"type": "function_call_output", "call_id": call["call_id"], "output": "a.py"}]}  # fmt: skip
        completed(httpx.post(url, json=second, timeout=60))
        store = piped.finish("think", 1.0)
        result = assemble(store, store.ready_rollouts(), AssemblyConfig())

    one, two = engine.calls
    whole = one.prompt_ids + one.completion_ids
    assert THOUGHT in tokenizer.decode(one.completion_ids)  # the reasoning is in the tokens trained
    (rollout,) = result.rollouts
    if carry == "as_codex":
        assert two.prompt_ids[: len(whole)] == whole
        (sample,) = rollout.samples
        assert sample.token_ids.tolist() == two.prompt_ids + two.completion_ids and len(sample.call_seqs) == 2
        trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
        assert trained == one.completion_ids + two.completion_ids
        assert result.report.merge_failures == {}
    else:  # the reasoning is gone from the second prompt: no exact merge, and assembly says so
        assert two.prompt_ids[: len(whole)] != whole
        assert len(rollout.samples) == 2 and sum(result.report.merge_failures.values()) == 1
