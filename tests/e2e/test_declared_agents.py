"""Claude Code's agent headers through the real sidecar, sent by the real `anthropic` SDK: a main
agent and two sub-agents it started, their calls interleaved, then a compaction the harness
declares. The stored calls carry the declared agent ids, the tree assembly builds from prefixes
agrees with the declared one (each agent's calls are one sample), and the declared compaction
starts a new sample of the same rollout, under its one reward."""

from __future__ import annotations

import itertools
from pathlib import Path

import anthropic

from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.assembly.assemble import START_COMPACTION
from tests.support.pipeline import pipeline

_answers = itertools.count()


def reply(body: dict, choice: int) -> str:
    return f"answer {next(_answers)}"


class Agent:
    """One Claude Code agent: its system prompt, its conversation, and the headers it sends."""

    def __init__(self, client: anthropic.Anthropic, name: str, parent: str | None, task: str) -> None:
        self.client, self.name, self.system = client, name, f"you are {name}"
        self.headers = {"x-claude-code-agent-id": name}
        if parent is not None:
            self.headers["x-claude-code-parent-agent-id"] = parent
        self.messages: list[dict] = [{"role": "user", "content": task}]
        self.calls = 0

    def turn(self, user: str | None = None, compaction: bool = False) -> str:
        if user is not None:
            self.messages.append({"role": "user", "content": user})
        headers = {**self.headers, **({"x-agl-compaction": "1"} if compaction else {})}
        message = self.client.messages.create(
            model="tiny", max_tokens=32, system=self.system, messages=self.messages, extra_headers=headers
        )
        text = message.content[0].text
        self.messages.append({"role": "assistant", "content": text})
        self.calls += 1
        return text


def test_a_main_agent_and_two_interleaved_sub_agents_with_a_declared_compaction(tmp_path: Path) -> None:
    from agl_testing.fake_vllm import FakeVLLM

    with FakeVLLM(reply=reply) as engine, pipeline(tmp_path, engine.base_url) as piped:
        client = anthropic.Anthropic(base_url=f"{piped.sidecar_url}/rollouts/r-cc", api_key="unused", max_retries=0)
        main = Agent(client, "main", None, "fix the bug")
        main.turn()
        first = Agent(client, "agent-a1", "main", "find the file")
        second = Agent(client, "agent-b2", "main", "read the tests")
        first.turn()
        main.turn("keep going")
        second.turn()
        first.turn("src/a.py")
        second.turn("tests/test_a.py")
        main.turn("sub-agents: a.py, test_a.py")
        # the harness compacts the main agent's context: a summary replaces the history
        main.messages = [{"role": "user", "content": "summary: the bug is in a.py"}]
        main.turn(compaction=True)
        main.turn("now fix it")
        store = piped.finish("r-cc", 1.0)
        calls = sorted(store.load("r-cc").calls, key=lambda c: c.call_seq)
        result = assemble(store, store.ready_rollouts(), AssemblyConfig())

    declared = [(c.agent_id, c.parent_agent_id) for c in calls]
    assert declared == [
        ("main", None), ("agent-a1", "main"), ("main", None), ("agent-b2", "main"), ("agent-a1", "main"),
        ("agent-b2", "main"), ("main", None), ("main", None), ("main", None),
    ]  # fmt: skip
    assert [bool(c.compaction) for c in calls] == [False] * 7 + [True, False]

    [detail] = result.details
    assert result.report.declared_tree_disagreements == 0
    # the prefix tree agrees with the declared one: every call's parent is an earlier call of its agent
    agent_of = {c.call_seq: c.agent_id for c in calls}
    for placement in detail.placements:
        assert placement.parent is None or agent_of[placement.parent] == placement.agent_id
    # one sample per agent thread, and the compaction's: main (3 calls), a1 (2), b2 (2), compacted main (2)
    [rollout] = result.rollouts
    assert rollout.reward == 1.0
    by_agent: dict[str, list[int]] = {}
    for sample in rollout.samples:
        agents = {agent_of[seq] for seq in sample.call_seqs}
        assert len(agents) == 1
        by_agent.setdefault(agents.pop(), []).append(len(sample.call_seqs))
    assert by_agent == {"main": [3, 2], "agent-a1": [2], "agent-b2": [2]}
    compaction_seq = calls[7].call_seq
    [compacted] = [p for p in detail.placements if p.call_seq == compaction_seq]
    assert compacted.start == START_COMPACTION and result.report.compaction_calls == 1
    # the compaction is declared, so it is no merge failure: only the two sub-agents' first calls are
    assert sorted(f.call_seq for f in detail.merge_failures) == [calls[1].call_seq, calls[3].call_seq]
