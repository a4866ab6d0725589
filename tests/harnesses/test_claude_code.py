"""Claude Code 2.1.328, unmodified and headless (`claude -p`), through agl-sidecar to a scripted
engine (support.ScriptedEngine: vLLM's wire format, token IDs the template's own), streaming as it
does by default: a tool loop, sub-agents nested to depth 3, an auto-compaction. Each run's spans,
received and stored by the real receiver, assemble into the expected samples with the engine's exact
token IDs, the declared agents and the compaction named; Claude Code never sees a 4xx or 5xx."""

from __future__ import annotations

import math
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from agl_testing.clis import Cli
from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.assembly.assemble import START_COMPACTION, RolloutAssembly
from agl_trainer.store.records import CallRow
from tests.harnesses.conftest import needs_claude
from tests.harnesses.support import ScriptedEngine, Served, Turn, harness_env
from tests.support.pipeline import pipeline

pytestmark = needs_claude


@dataclass
class Run:
    stdout: str
    calls: list[CallRow]  # the stored spans of the rollout, by call seq
    assembly: RolloutAssembly
    served: list[Served]  # what the engine answered, in order
    metrics: str  # the sidecar's /metrics after the run


def run_claude(
    cli: Cli, tmp_path: Path, tokenizer: Any, script: Callable[[list[dict[str, Any]], dict[str, Any]], Turn],
    prompts: list[list[str]], rollout: str, *arguments: str, reward: float = 1.0,
) -> Run:  # fmt: skip
    """`claude -p` once per entry of `prompts` (its arguments: the prompt, `--continue` ...) against the
    sidecar (rollout `rollout`) and a scripted engine; the run's stored calls and their assembly."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    with ScriptedEngine(tokenizer, script) as engine, pipeline(tmp_path, engine.base_url) as piped:
        environment = harness_env(tmp_path / "scratch", ANTHROPIC_BASE_URL=f"{piped.sidecar_url}/rollouts/{rollout}",
                                  ANTHROPIC_API_KEY="unused")  # fmt: skip
        said = []
        for prompt in prompts:
            done = subprocess.run(
                [str(cli.path), "-p", *prompt, "--model", "tiny", "--debug-to-stderr", *arguments],
                cwd=work, env=environment, capture_output=True, text=True, timeout=180,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
            errors = [line for line in done.stderr.splitlines() if "API error" in line]
            assert not errors, errors  # Claude Code saw no failed call
            said.append(done.stdout.strip())
        metrics = httpx.get(f"{piped.sidecar_url}/metrics").text
        store = piped.finish(rollout, reward)
        calls = sorted(store.load(rollout).calls, key=lambda c: c.call_seq)
        result = assemble(store, store.ready_rollouts(), AssemblyConfig(), tokenizer=tokenizer)
        [assembly] = result.details
        return Run(said[-1], calls, assembly, list(engine.served), metrics)


def assert_exact_tokens(run: Run) -> None:
    """Every call's span holds the engine's token IDs, in order, and no call failed anywhere."""
    assert len(run.calls) == len(run.served)
    for call, served in zip(run.calls, run.served, strict=True):
        assert call.completion_ids is not None and call.completion_ids.tolist() == served.completion_ids
        assert call.end_reason == "completed"
    for line in run.metrics.splitlines():
        if line.startswith("agl_sidecar_requests_total{"):
            assert 'status="200"' in line, line


def last_user(messages: list[dict[str, Any]]) -> str:
    users = [m for m in messages if m["role"] in ("user", "tool")]
    return str(users[-1].get("content")) if users else ""


def test_a_tool_loop_with_thinking_merges_into_one_sample(claude_cli: Cli, cc_tokenizer: Any, tmp_path: Path) -> None:
    """Bash, then an answer: the engine's reasoning goes back and forth as signed thinking blocks
    (Claude Code asks `display: omitted`, so it sees none of the text) and renders back exactly, so
    the two calls are one sample whose trained tokens are exactly the engine's completions."""

    def script(messages: list[dict[str, Any]], body: dict[str, Any]) -> Turn:
        if "hi-from-bash" in last_user(messages) and any(m["role"] == "tool" for m in messages):
            return Turn("The command printed hi-from-bash.", reasoning="It printed the greeting.")
        return Turn(reasoning="I should run it.", tool_calls=[("Bash", {"command": "echo hi-from-bash", "description": "Print a greeting"})])

    run = run_claude(claude_cli, tmp_path, cc_tokenizer, script, [["run the command echo hi-from-bash"]], "cc-tool",
                     "--allowedTools", "Bash")  # fmt: skip
    assert run.stdout == "The command printed hi-from-bash."
    assert_exact_tokens(run)
    first, second = run.served
    assert second.request["messages"][-2]["reasoning"] == "I should run it."  # the thinking came back
    assert not run.assembly.merge_failures
    [sample] = run.assembly.result.samples  # type: ignore[union-attr]
    assert sample.call_seqs == [c.call_seq for c in run.calls]
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
    assert trained == first.completion_ids + second.completion_ids
    assert sample.token_ids[: len(second.prompt_ids)].tolist() == second.prompt_ids
    # the main thread is declared: Claude Code's session is its agent
    assert len({c.agent_id for c in run.calls}) == 1 and run.calls[0].agent_id is not None


def agent_call(marker: str) -> Turn:
    task = {"description": "a delegated task", "prompt": marker, "subagent_type": "general-purpose", "run_in_background": False}
    return Turn(tool_calls=[("Agent", task)])


# Each agent: its task (the first user turn's marker) -> its first answer, and what it says when its tool returns.
CHAIN = {
    "delegate level one": (agent_call("LEVEL-ONE: delegate level two"), "all delegated work done"),
    "LEVEL-ONE": (agent_call("LEVEL-TWO: delegate level three"), "level one done"),
    "LEVEL-TWO": (agent_call("LEVEL-THREE: run echo deep"), "level two done"),
    "LEVEL-THREE": (Turn(tool_calls=[("Bash", {"command": "echo deep", "description": "Print deep"})]), "level three done"),
}


def chain_script(messages: list[dict[str, Any]], body: dict[str, Any]) -> Turn:
    task = str(next(m for m in messages if m["role"] == "user")["content"])
    [marker] = [m for m in CHAIN if m in task]
    first, done = CHAIN[marker]
    return Turn(done) if any(m["role"] == "tool" for m in messages) else first


def test_sub_agents_nested_to_depth_three_declare_their_tree(claude_cli: Cli, cc_tokenizer: Any, tmp_path: Path) -> None:
    """The main agent starts a sub-agent through the Agent tool, which starts one, which starts one
    (Claude Code's default depth: the third has no Agent tool). Every call declares its agent (the
    main thread by its session id, Claude Code's agent headers for the others); each agent's calls
    merge into one sample, and the tree the prefixes build agrees with the declared one."""
    run = run_claude(claude_cli, tmp_path, cc_tokenizer, chain_script, [["delegate level one"]], "cc-agents",
                     "--allowedTools", "Bash,Agent")  # fmt: skip
    assert run.stdout == "all delegated work done"
    assert_exact_tokens(run)
    depth = {}
    for call, served in zip(run.calls, run.served, strict=True):
        task = str(next(m for m in served.request["messages"] if m["role"] == "user")["content"])
        [marker] = [m for m in CHAIN if m in task]
        depth.setdefault(marker, set()).add((call.agent_id, call.parent_agent_id))
        tools = [t["function"]["name"] for t in served.request["tools"]]
        assert ("Agent" in tools) == (marker != "LEVEL-THREE")  # depth 3: no more sub-agents
    agents = {marker: pairs.pop() for marker, pairs in depth.items() if len(pairs) == 1}
    assert len(agents) == 4  # each level's calls declare one agent
    main, one, two, three = (agents[m] for m in CHAIN)
    assert main[1] is None and one[1] == main[0] and two[1] == one[0] and three[1] == two[0]
    assert len({main[0], one[0], two[0], three[0]}) == 4
    assert re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", main[0])  # the main thread: its session
    detail = run.assembly
    assert sum(p.declared is not None for p in detail.placements) == 0  # the prefix tree agrees
    samples = detail.result.samples  # type: ignore[union-attr]
    agent_of = {c.call_seq: c.agent_id for c in run.calls}
    assert sorted(len(s.call_seqs) for s in samples) == [2, 2, 2, 2]
    assert all(len({agent_of[seq] for seq in s.call_seqs}) == 1 for s in samples)
    # a sub-agent's first call starts from a context of its own: those three are the only breaks
    first_calls = {min(seq for seq in agent_of if agent_of[seq] == a[0]) for a in (one, two, three)}
    assert {f.call_seq for f in detail.merge_failures} == first_calls


SUMMARY = "<analysis>The user had me run echo one.</analysis>\n<summary>The user asked to run echo one; it printed one.</summary>"


def compaction_script(messages: list[dict[str, Any]], body: dict[str, Any]) -> Turn:
    if "Your task is to create a detailed summary" in str(messages[-1].get("content")):
        return Turn(SUMMARY)
    if messages[-1]["role"] == "tool" or (len(messages) > 1 and messages[-2]["role"] == "tool"):
        return Turn("It printed one.")
    if "what did we do" in str(messages):
        return Turn("We ran echo one.")
    return Turn(tool_calls=[("Bash", {"command": "echo one", "description": "Print one"})])


def test_a_compaction_is_declared_and_its_summary_trained(claude_cli: Cli, cc_tokenizer: Any, tmp_path: Path) -> None:
    """A tool loop, then `/compact` (the same summarization call auto-compaction makes), then a turn on
    the compacted context, all one session. Claude Code's summary call and its first call on the
    summary are recognised and declared: each starts a sample (the summary, the policy's, trained),
    and neither is a merge failure."""
    run = run_claude(
        claude_cli, tmp_path, cc_tokenizer, compaction_script,
        [["run the command echo one"], ["--continue", "/compact"], ["--continue", "what did we do?"]],
        "cc-compact", "--allowedTools", "Bash",
    )  # fmt: skip
    assert run.stdout == "We ran echo one."
    assert_exact_tokens(run)
    tool, answer, summary, resumed = run.calls
    assert [bool(c.compaction) for c in run.calls] == [False, False, True, True]
    assert len({c.agent_id for c in run.calls}) == 1  # one session: --continue keeps it
    assert "The user asked to run echo one" in str(run.served[3].request["messages"])  # the summary carried on
    detail = run.assembly
    assert not detail.merge_failures
    starts = {p.call_seq: p.start for p in detail.placements}
    assert starts[summary.call_seq] == starts[resumed.call_seq] == START_COMPACTION
    by_first = {s.call_seqs[0]: s for s in detail.result.samples}  # type: ignore[union-attr]
    assert by_first[tool.call_seq].call_seqs == [tool.call_seq, answer.call_seq]
    trained = [t for t, m in zip(by_first[summary.call_seq].token_ids, by_first[summary.call_seq].loss_mask, strict=True) if m]
    assert trained == run.served[2].completion_ids  # the policy's summary is trained


@pytest.mark.slow
def test_one_rl_step_on_claude_code_rollouts_with_the_embedded_engine(claude_cli: Cli, cc_tokenizer: Any, tmp_path: Path) -> None:
    """Two tool-loop rollouts of one task (Claude Code sends the task id through
    ANTHROPIC_CUSTOM_HEADERS), scored by the policy itself: a tiny model on the embedded engine
    gives the engine logprobs. Their samples train one GRPO step of the torch backend, whose
    weights go into the embedded engine: the trainer's logprobs agreed with the engine's before the
    step, and the engine's logprob of the rewarded answer rises after it."""
    from agl_trainer.backends.torch_backend import TorchBackend
    from agl_trainer.backends.torch_config import TorchBackendConfig
    from agl_trainer.batch import TrainingBatch
    from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
    from agl_trainer.models.tiny import TinyModelSpec, save_model
    from agl_trainer.weights.update import WeightUpdate

    model_dir = save_model(tmp_path / "model", cc_tokenizer, TinyModelSpec(hidden=64, max_positions=4096))
    engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=model_dir))
    engine.start()
    try:
        def score(prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
            """The served policy's logprob of each completion token (vLLM's prompt_logprobs)."""
            ids = prompt_ids + completion_ids
            answer = httpx.post(f"{engine.urls[0]}/v1/completions", timeout=120,
                                json={"model": "tiny", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}).json()  # fmt: skip
            scored = answer["choices"][0]["prompt_logprobs"]
            return [scored[i][str(ids[i])]["logprob"] for i in range(len(prompt_ids), len(ids))]

        rollouts = []
        for rollout, answer, reward in (("rl-good", "It printed one.", 1.0), ("rl-bad", "No idea.", 0.0)):
            def script(messages: list[dict[str, Any]], body: dict[str, Any], answer: str = answer) -> Turn:
                if any(m["role"] == "tool" for m in messages):
                    return Turn(answer)
                return Turn(tool_calls=[("Bash", {"command": "echo one", "description": "Print one"})])

            run_dir = tmp_path / rollout
            with ScriptedEngine(cc_tokenizer, script, scorer=score) as scripted, pipeline(run_dir, scripted.base_url) as piped:
                environment = harness_env(run_dir / "scratch", ANTHROPIC_API_KEY="unused",
                                          ANTHROPIC_BASE_URL=f"{piped.sidecar_url}/rollouts/{rollout}",
                                          ANTHROPIC_CUSTOM_HEADERS="x-agl-task-id: echo-one")  # fmt: skip
                (run_dir / "work").mkdir()
                done = subprocess.run([str(claude_cli.path), "-p", "run the command echo one", "--model", "tiny",
                                       "--allowedTools", "Bash"], cwd=run_dir / "work", env=environment,
                                      capture_output=True, text=True, timeout=180)  # fmt: skip
                assert done.returncode == 0 and done.stdout.strip() == answer, done.stderr[-2000:]
                store = piped.finish(rollout, reward)
                [result] = assemble(store, store.ready_rollouts(), AssemblyConfig(), tokenizer=cc_tokenizer).rollouts
                rollouts.append(result)
        assert [r.task_id for r in rollouts] == ["echo-one", "echo-one"]
        assert all(len(r.samples) == 1 for r in rollouts)  # each tool loop merged into one sample

        backend = TorchBackend(TorchBackendConfig(model_path=model_dir, device="cpu", lr=1e-2))
        batch = TrainingBatch.from_rollouts(rollouts)
        before = backend.compute_logprobs(batch)
        known = batch.loss_mask.bool()
        assert torch.allclose(before[known], batch.engine_logprobs[known], atol=1e-4)  # the engine's = the trainer's
        metrics = backend.train_step(batch, policy_version=0)
        assert metrics and all(math.isfinite(v) for v in metrics.values())
        good = rollouts[0].samples[0]
        answer_ids = last_trained(good)  # the rewarded answer: the last call's completion
        old = score(good.token_ids[: -len(answer_ids)].tolist(), answer_ids)
        engine.update_weights(WeightUpdate(version=1, state_dict=backend.state_dict_for_engine()))
        new = score(good.token_ids[: -len(answer_ids)].tolist(), answer_ids)
        assert sum(new) > sum(old)  # the rewarded answer is likelier under the new policy
    finally:
        engine.stop()


def last_trained(sample: Any) -> list[int]:
    """The sample's last trained run of tokens (its last call's completion)."""
    start = len(sample.loss_mask)
    while start > 0 and sample.loss_mask[start - 1]:
        start -= 1
    return sample.token_ids[start:].tolist()
