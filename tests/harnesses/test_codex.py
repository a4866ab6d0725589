"""Codex CLI 0.169.0 (npm, pinned in testing/clis), unmodified, headless against agl-sidecar: its model
calls reach a scripted engine (real tokenizer and chat template, vLLM's wire format, token IDs) and
come back as Codex expects; each run's spans assemble into the expected samples with the engine's
exact token IDs, its agents and compactions as declared; the sidecar answers no call with a 4xx/5xx.

Two ways to point Codex at the sidecar: a custom provider (`wire_api = "responses"`: streaming HTTP,
Codex compacts locally with a summarization request) and Codex's own OpenAI provider moved there
(`openai_base_url`: the Responses WebSocket, `store: false` requests chained by
`previous_response_id`, and remote compaction: a `compaction_trigger` item the sidecar serves by
asking the policy for the summary). The last test makes one RL step on such runs, the engine's
logprobs and the updated weights the embedded engine's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from agl import semconv

from agl_sidecar.protocols.responses_compaction import COMPACTION_PROMPT, SUMMARY_PREFIX
from agl_testing.clis import installed_cli
from agl_testing.template_engine import Answer
from agl_trainer.assembly.assemble import START_COMPACTION, START_FIRST, START_NO_PREFIX
from tests.harnesses.codex_support import CUSTOM, CUSTOM_WS, OPENAI, Rollout, codex_tokenizer, last_user_text, run_rollout, tool_results

CLI = installed_cli("codex")
pytestmark = pytest.mark.skipif(isinstance(CLI, str), reason=str(CLI))
SHELL_OUTPUT = "hi-from-shell"
# A long first thought: its tokens put the first call past a small auto-compact limit.
LONG_THOUGHT = "I will run echo to see what the shell prints. " * 40
COMPACT_AT = "model_auto_compact_token_limit = 1000"


def is_summary_request(request: dict[str, Any]) -> bool:
    """The sidecar's compaction prompt (remote compaction) or Codex's own (local compaction)."""
    last = last_user_text(request)
    return last == COMPACTION_PROMPT or "CONTEXT CHECKPOINT COMPACTION" in last


def summarized(request: dict[str, Any]) -> bool:
    return any(isinstance(m["content"], str) and "summary of the shell run" in m["content"] for m in request["messages"])


def shell_then_answer(request: dict[str, Any], n: int, thought: str = "I will run echo.") -> Answer:
    """A shell call, then an answer quoting its output; a summary when asked for one."""
    if is_summary_request(request):
        return Answer(content="the summary of the shell run: echo printed " + SHELL_OUTPUT)
    if summarized(request):
        return Answer(content="done after the compaction")
    results = tool_results(request)
    if results:
        return Answer(reasoning="The shell answered.", content="done: " + results[-1].strip().splitlines()[-1])
    return Answer(reasoning=thought, tool_calls=(("exec_command", json.dumps({"cmd": f"echo {SHELL_OUTPUT}"})),))


def assert_clean(rollout: Rollout, calls: int) -> None:
    """Codex finished; every model call went to the engine once and was answered 200; every span
    holds the engine's exact token IDs and Codex's thread as its agent."""
    run = rollout.run
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.websocket == (rollout.provider != CUSTOM)
    assert len(rollout.engine.calls) == len(rollout.calls) == calls
    assert rollout.statuses == {f'{{api="{semconv.API_RESPONSES}",status="200"}}': calls}, rollout.statuses
    full: dict[int, list[int]] = {}  # each call's prompt + completion, prompts by reference resolved
    for made, call in zip(rollout.engine.calls, rollout.calls, strict=True):
        prompt = [int(t) for t in call.prompt_ids]
        if call.prompt_ref_seq is not None:  # docs/spans.md "Prompts by reference"
            prompt = full[call.prompt_ref_seq][: call.prompt_ref_length] + prompt
        full[call.call_seq] = prompt + [int(t) for t in call.completion_ids]
        assert prompt == made.prompt_ids and [int(t) for t in call.completion_ids] == made.completion_ids
        assert call.api == semconv.API_RESPONSES and call.end_reason == "completed"


@pytest.mark.parametrize("provider", [CUSTOM, CUSTOM_WS, OPENAI], ids=["http", "custom-websocket", "websocket"])
def test_a_shell_tool_loop_is_one_sample(tmp_path: Path, provider: str) -> None:
    rollout = run_rollout(tmp_path, CLI, shell_then_answer, "run echo hi-from-shell", "loop", provider)
    assert_clean(rollout, calls=2)
    assert f"done: {SHELL_OUTPUT}" in rollout.run.stdout
    first, second = rollout.engine.calls
    assert SHELL_OUTPUT in tool_results(second.request)[0]  # Codex really ran the command
    assert {c.agent_id for c in rollout.calls} == {rollout.run.session_id}
    (result,) = rollout.assembled.rollouts
    (sample,) = result.samples  # call 2 extends call 1 exactly, the reasoning included
    assert sample.token_ids.tolist() == second.prompt_ids + second.completion_ids
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
    assert trained == first.completion_ids + second.completion_ids
    assert rollout.assembled.report.merge_failures == {}


def delegating(request: dict[str, Any], n: int) -> Answer:
    """The main thread spawns a sub-agent, waits for it and answers; the sub-agent answers."""
    results = tool_results(request)
    if last_user_text(request) == "find the answer" and not results:  # the sub-agent's task
        return Answer(content="the answer is 42")
    if not results:
        return Answer(tool_calls=(("multi_agent_v1__spawn_agent", json.dumps({"message": "find the answer"})),))
    if len(results) == 1:
        agent = json.loads(results[0])["agent_id"]
        return Answer(tool_calls=(("multi_agent_v1__wait_agent", json.dumps({"targets": [agent], "timeout_ms": 30000})),))
    return Answer(content="done: the sub-agent says 42")


@pytest.mark.parametrize("provider", [CUSTOM, OPENAI], ids=["http", "websocket"])
def test_a_sub_agent_is_a_sample_of_its_own_declared_agent(tmp_path: Path, provider: str) -> None:
    rollout = run_rollout(tmp_path, CLI, delegating, "delegate the question", "sub", provider)
    assert_clean(rollout, calls=4)
    assert "42" in tool_results(rollout.engine.calls[-1].request)[-1]  # the sub-agent's answer reached the main
    main = rollout.run.session_id
    sub = {c.agent_id for c in rollout.calls} - {main}
    assert len(sub) == 1  # Codex's sub-agent thread, spawned by the main thread
    (sub_call,) = [c for c in rollout.calls if c.agent_id in sub]
    assert sub_call.parent_agent_id == main
    (details,) = rollout.assembled.details
    by_agent = {p.agent_id: [] for p in details.placements}
    for placement in details.placements:
        by_agent[placement.agent_id].append(placement)
    assert [p.start for p in by_agent[main]] == [START_FIRST, None, None]  # one sample: the main thread
    assert [p.start for p in by_agent[sub_call.agent_id]] == [START_NO_PREFIX]  # its own context
    assert len(rollout.assembled.rollouts[0].samples) == 2
    assert rollout.assembled.report.declared_tree_disagreements == 0


@pytest.mark.parametrize("provider", [CUSTOM, OPENAI], ids=["local", "remote"])
def test_a_compaction_is_a_declared_sample_and_its_summary_the_policys(tmp_path: Path, provider: str) -> None:
    def script(request: dict[str, Any], n: int) -> Answer:
        return shell_then_answer(request, n, thought=LONG_THOUGHT)

    rollout = run_rollout(tmp_path, CLI, script, "run echo hi-from-shell", "compact", provider, COMPACT_AT)
    assert_clean(rollout, calls=3)
    assert "done after the compaction" in rollout.run.stdout
    shell, summary, after = rollout.engine.calls
    assert is_summary_request(summary.request)
    if provider == OPENAI:  # remote: the sidecar asked the engine; its summary replaced the history
        assert summary.request["messages"][-1] == {"role": "user", "content": COMPACTION_PROMPT}
        assert summary.request["tool_choice"] == "none"
    text = rollout.engine.tokenizer.decode(summary.completion_ids)
    assert "the summary of the shell run" in text  # the policy's summary, as tokens in its span
    assert any(isinstance(m["content"], str) and m["content"].endswith(summary.answer.content)
               for m in after.request["messages"])  # fmt: skip
    if provider == OPENAI:
        assert SUMMARY_PREFIX + summary.answer.content in [m["content"] for m in after.request["messages"]]
    assert [c.compaction for c in rollout.calls] == [None, 1, 1]
    (details,) = rollout.assembled.details
    assert [p.start for p in details.placements] == [START_FIRST, START_COMPACTION, START_COMPACTION]
    assert rollout.assembled.report.compaction_calls == 2 and rollout.assembled.report.merge_failures == {}
    assert len(rollout.assembled.rollouts[0].samples) == 3


@pytest.mark.slow
def test_one_rl_step_on_codex_runs_with_the_embedded_engine(tmp_path: Path) -> None:
    """Two Codex runs of one task (a tool loop over HTTP rewarded 1, a remotely compacted one over
    the WebSocket rewarded 0), their logprobs the embedded engine's, assembled and trained one torch
    step; the new weights, loaded into the embedded engine, make the rewarded run's answer more likely
    and the other's less."""
    import torch
    from agl_trainer.algorithms.config import AlgorithmConfig
    from agl_trainer.backends import TorchBackend
    from agl_trainer.backends.torch_config import TorchBackendConfig
    from agl_trainer.batch import TrainingBatch
    from agl_trainer.engines.base import policy_update
    from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig, EmbeddedOptions
    from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model

    spec = TinyModelSpec(hidden=128, heads=2, kv_heads=2, intermediate=256, max_positions=4096)
    model = build_bpe_model(tmp_path / "model", spec, tokenizer=codex_tokenizer())
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=model, served_model_name="tiny", options=EmbeddedOptions(max_model_len=4096)))
    with engine:
        scorer = engine.urls[0]

        def logprobs(prompt: list[int], completion: list[int]) -> list[float]:
            body = {"model": "tiny", "prompt": prompt + completion, "max_tokens": 1, "prompt_logprobs": 0}
            scored = httpx.post(scorer + "/v1/completions", json=body, timeout=120).json()["choices"][0]["prompt_logprobs"]
            return [scored[len(prompt) + j][str(t)]["logprob"] for j, t in enumerate(completion)]

        def score(prompt: list[int], completion: list[int]) -> float:
            return sum(logprobs(prompt, completion))

        good = run_rollout(tmp_path, CLI, shell_then_answer, "run echo hi-from-shell", "good", CUSTOM, reward=1.0,
                           scorer=scorer)  # fmt: skip
        bad = run_rollout(tmp_path, CLI, lambda r, n: shell_then_answer(r, n, LONG_THOUGHT), "run echo hi-from-shell",
                          "bad", OPENAI, COMPACT_AT, reward=0.0, scorer=scorer)  # fmt: skip
        for rollout in (good, bad):
            assert rollout.run.returncode == 0, rollout.run.stderr[-3000:]
        rollouts = good.assembled.rollouts + bad.assembled.rollouts
        assert [len(r.samples) for r in rollouts] == [1, 3] and {r.task_id for r in rollouts} == {"codex"}
        for rollout in (good, bad):  # the span's logprobs are the engine's, token for token
            for made, call in zip(rollout.engine.calls, rollout.calls, strict=True):
                assert call.logprobs is not None
                want = logprobs(made.prompt_ids, made.completion_ids)
                assert max(abs(float(a) - b) for a, b in zip(call.logprobs, want, strict=True)) < 1e-4

        before = [score(c.prompt_ids, c.completion_ids) for c in good.engine.calls + bad.engine.calls]
        config = TorchBackendConfig(model_path=model, device="cpu", lr=1e-3, micro_batch_tokens=16384,
                                    algorithm=AlgorithmConfig(advantage_estimator="grpo"))  # fmt: skip
        backend = TorchBackend(config)
        batch = TrainingBatch.from_rollouts(rollouts)
        metrics = backend.train_step(batch, policy_version=0)
        assert all(torch.isfinite(torch.tensor(value)) for value in metrics.values())
        engine.update_weights(policy_update(backend, engine, 1))
        after = [score(c.prompt_ids, c.completion_ids) for c in good.engine.calls + bad.engine.calls]

    moved = [a - b for a, b in zip(after, before, strict=True)]
    rewarded, other = moved[: len(good.engine.calls)], moved[len(good.engine.calls) :]
    assert all(m > 0 for m in rewarded) and all(m < 0 for m in other), (rewarded, other)
