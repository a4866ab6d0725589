"""A CPU task whose rollouts make different numbers of calls and samples: chained lookups, one hop
per fresh context (bench/normalization.py trains on it).

A task is a chain of L keys (L = 1..4, drawn per task) in the demo's table: looking up k_0 gives
k_1, ..., looking up k_{L-1} gives the value. Each hop is a demo episode in a context of its own,
as a harness that hands each hop to a sub-agent (or compacts its history between hops) makes it:

    user: k_h   assistant: call k_h   tool: <table[k_h]>   assistant: <answer>

If the answer is a key, the rollout goes on with a fresh context on that key; otherwise it ends
(at most MAX_HOPS hops). A hop's two calls merge into one sample (the second prompt extends the
first call), and every hop starts a new sample: a rollout has 2 calls and 1 sample per hop, and
how many hops it makes depends on the task and on the policy (a wrong lookup lands on a value and
ends the chain early). Reward: the fraction of the required 5*L positions the policy got right
(the demo's per-position reward over the chain), so a rollout that stops early loses the rest.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from examples.demo import task as demo
from examples.demo.episodes import DemoTokens

MAX_HOPS = 4


def make_chain_tasks(n: int, seed: int, max_hops: int = MAX_HOPS) -> list[dict[str, Any]]:
    """`n` tasks: a start key, a chain length and a table in which the chain's keys point onward."""
    rng = random.Random(seed)
    tasks = []
    for index in range(n):
        length = rng.randint(1, max_hops)
        chain = rng.sample(demo.KEYS, length)
        table = {key: rng.choice(demo.VALUES) for key in demo.KEYS}
        for here, there in zip(chain, chain[1:]):
            table[here] = there
        tasks.append({"id": f"chain-{seed}-{index:04d}", "key": chain[0], "hops": length, "table": table})
    return tasks


def expected_hops(task: dict[str, Any]) -> list[tuple[list[str], list[str]]]:
    """Per required hop: the expected words of its call and of its answer."""
    out, key = [], task["key"]
    for _ in range(task["hops"]):
        answer = task["table"][key]
        out.append(([demo.CALL, key, demo.EOS], [answer, demo.EOS]))
        key = answer
    return out


@dataclass
class Hop:
    prompt1: list[int]
    call1: list[int]
    prompt2: list[int]
    call2: list[int]
    words1: list[str]
    words2: list[str]


@dataclass
class Rollout:
    task: dict[str, Any]
    hops: list[Hop] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0

    @property
    def calls(self) -> int:
        return 2 * len(self.hops)


def score(task: dict[str, Any], hops: Sequence[Hop]) -> float:
    right = 0
    for (want1, want2), hop in zip(expected_hops(task), hops):
        right += demo.matches(hop.words1, want1) + demo.matches(hop.words2, want2)
    return right / (demo.POSITIONS * task["hops"])


def play(
    model: Any,
    tokens: DemoTokens,
    tasks: Sequence[dict[str, Any]],
    *,
    temperature: float,
    generator: Any = None,
) -> list[Rollout]:
    """Play one rollout per task (repeat tasks for groups), every hop's calls batched across rollouts."""
    from examples.demo.sampling import sample_batch

    rollouts = [Rollout(task) for task in tasks]
    keys = [task["key"] for task in tasks]
    eos = {tokens.end}
    for _ in range(MAX_HOPS):
        live = [i for i, r in enumerate(rollouts) if not r.done]
        if not live:
            break
        prompts1 = [tokens.prompt1({"key": keys[i]}) for i in live]
        first = sample_batch(
            model, prompts1, demo.CALL1_MAX_TOKENS, eos_ids=eos, pad_id=tokens.end,
            temperature=temperature, generator=generator,
        )  # fmt: skip
        answers = [demo.run_tool(rollouts[i].task, tokens.text(s.token_ids)) for i, s in zip(live, first)]
        prompts2 = [tokens.prompt2({}, p, s.token_ids, a) for p, s, a in zip(prompts1, first, answers)]
        second = sample_batch(
            model, prompts2, demo.CALL2_MAX_TOKENS, eos_ids=eos, pad_id=tokens.end,
            temperature=temperature, generator=generator,
        )  # fmt: skip
        for i, p1, s1, p2, s2 in zip(live, prompts1, first, prompts2, second):
            words2 = tokens.generated_words(s2.token_ids)
            rollouts[i].hops.append(Hop(p1, s1.token_ids, p2, s2.token_ids, tokens.generated_words(s1.token_ids), words2))
            answer = words2[0] if words2 else ""
            if answer in demo.KEYS and len(rollouts[i].hops) < MAX_HOPS:
                keys[i] = answer  # the next hop: a fresh context on the key the chain points to
            else:
                rollouts[i].done = True
    for rollout in rollouts:
        rollout.reward = score(rollout.task, rollout.hops)
    return rollouts


def hop_sample(hop: Hop) -> tuple[list[int], list[int]]:
    """A hop's calls as one sequence with its generated tokens masked in (the assembly's merge:
    the second prompt extends the first call's prompt and completion); two rows when it does not."""
    first = [*hop.prompt1, *hop.call1]
    if hop.prompt2[: len(first)] != first:
        return [], []
    ids = [*hop.prompt2, *hop.call2]
    mask = [0] * len(ids)
    for position in [*range(len(hop.prompt1), len(first)), *range(len(hop.prompt2), len(ids))]:
        mask[position] = 1
    return ids, mask


def rows(rollout: Rollout) -> list[tuple[list[int], list[int]]]:
    """The rollout's training rows: one per hop (two if a hop's calls did not merge)."""
    out = []
    for hop in rollout.hops:
        ids, mask = hop_sample(hop)
        if ids:
            out.append((ids, mask))
        else:
            out.append(([*hop.prompt1, *hop.call1], [0] * len(hop.prompt1) + [1] * len(hop.call1)))
            out.append(([*hop.prompt2, *hop.call2], [0] * len(hop.prompt2) + [1] * len(hop.call2)))
    return [(ids, mask) for ids, mask in out if any(mask)]
