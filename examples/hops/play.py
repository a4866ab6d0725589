"""Hops rollouts played in one process: the agent program of task.py against a model, every
pending call of every rollout sampled in one batch (grouped by max_tokens).

    rollouts = play(model, tokens, tasks, temperature=1.0, generator=g)
    rollouts[i].outcome.reward, rollouts[i].calls, rollouts[i].samples()
    evaluate(model, tokens, tasks, k=4)   # -> {"greedy": ..., "sampled": ... (mean@k)}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from examples.hops.task import Agent, Outcome, Reply, Request, agent
from examples.hops.tokens import Call, HopsTokens, samples


@dataclass
class Rollout:
    task: dict[str, Any]
    program: Agent
    calls: list[Call] = field(default_factory=list)
    pending: Request | None = None
    outcome: Outcome | None = None

    @property
    def reward(self) -> float:
        assert self.outcome is not None
        return self.outcome.reward

    def samples(self) -> list[tuple[list[int], list[int]]]:
        return samples(self.calls)

    def advance(self, reply: Reply | None) -> None:
        try:
            self.pending = next(self.program) if reply is None else self.program.send(reply)
        except StopIteration as stop:
            self.pending, self.outcome = None, stop.value


def play(
    model: Any,
    tokens: HopsTokens,
    tasks: Sequence[dict[str, Any]],
    *,
    temperature: float,
    generator: Any = None,
) -> list[Rollout]:
    """One rollout per task (repeat tasks for groups)."""
    from examples.demo.sampling import sample_batch

    rollouts = [Rollout(task, agent(task)) for task in tasks]
    for rollout in rollouts:
        rollout.advance(None)
    while live := [r for r in rollouts if r.pending is not None]:
        groups: dict[int, list[Rollout]] = {}
        for rollout in live:
            groups.setdefault(rollout.pending.max_tokens, []).append(rollout)  # type: ignore[union-attr]
        for max_tokens, group in groups.items():
            prompts = [tokens.render(r.pending.messages) for r in group]  # type: ignore[union-attr]
            drawn = sample_batch(
                model, prompts, max_tokens, eos_ids={tokens.end}, pad_id=tokens.end,
                temperature=temperature, generator=generator,
            )  # fmt: skip
            for rollout, prompt, sample in zip(group, prompts, drawn):
                rollout.calls.append(Call(rollout.pending.thread, prompt, sample.token_ids))  # type: ignore[union-attr]
                rollout.advance(Reply(tokens.text(sample.token_ids), tokens.finish_reason(sample.token_ids)))
    return rollouts


def mean_reward(rollouts: Sequence[Rollout]) -> float:
    return sum(r.reward for r in rollouts) / len(rollouts)


def evaluate(
    model: Any, tokens: HopsTokens, tasks: Sequence[dict[str, Any]], *, k: int = 4, seed: int = 0
) -> dict[str, float]:
    """Held-out reward: greedy, and sampled at temperature 1 (mean over k rollouts per task)."""
    import torch

    greedy = mean_reward(play(model, tokens, tasks, temperature=0.0))
    generator = torch.Generator().manual_seed(seed)
    sampled = mean_reward(
        play(model, tokens, [t for t in tasks for _ in range(k)], temperature=1.0, generator=generator)
    )
    return {"greedy": greedy, "sampled": sampled}
