"""The hops task and its agent: chained lookups, one sub-agent per hop, compaction, retries.

A task is a chain of L keys (L = 1..MAX_HOPS) in a per-task table over the demo's words: looking up
k_0 gives k_1, ..., looking up k_{L-1} gives the answer (a value). The agent program (`agent`) is
what the harness runs, written once as a generator so the real harness (harness.py, the `openai`
SDK through the sidecar) and the in-process player (play.py, batched sampling) run the same
control flow:

    main agent (its own thread)        system: main   user: k3
      assistant: call k3         ->    sub-agent (a fresh context, the demo episode):
                                         user: k3   assistant: call k3   tool: k5   assistant: k5
      tool: k5                   <-    its answer, checked: a failed lookup (the tool said `none`,
      assistant: call k5   ...           or the answer is not what the tool said) is retried with
      tool: v2                           a new sub-agent, up to SUB_ATTEMPTS times per hop
      assistant: v2                    the final answer ends the rollout

The main context is compacted (replaced by `system: main  user: <the latest result>`) once it
holds COMPACT_AFTER tool results, and after an answer it cannot use (anything but `call <key>` or
a value): a compacted context extends no earlier prompt, so it is a new sample of the rollout.
Each sub-agent is a sample too (its two calls merge; a retry whose first call repeats an earlier
one's makes a branch, two samples). A rollout makes 1 to 27 samples (median 5 at the warm start),
and failing rollouts make the most (retries, compactions), as real agents do.

Reward: the fraction of the L + 1 steps done right, in order: each hop's sub-agent returning the
chain's next element (failed hops skipped), then the final answer (1.0 = solved). Plain Python: no torch, no openai.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from examples.demo import task as demo

MAX_HOPS = 4
SUB_ATTEMPTS = 3  # sub-agents per hop: the first and up to two retries
MAX_DELEGATIONS = MAX_HOPS + 2  # hops a main agent may ask for (a wrong key can loop)
MAX_SUB_AGENTS = 12  # a rollout has at most 1 + MAX_COMPACTIONS main contexts and 12 sub-agents
MAX_COMPACTIONS = 3
COMPACT_AFTER = 2  # tool results in the main context before it is compacted
MAIN_MAX_TOKENS = 3
MAIN_ROLE = "main"  # the main agent's system message: what tells its context from a sub-agent's
WORDS = (*demo.WORDS, MAIN_ROLE)  # the hops model's vocabulary (beyond specials and role names)


def make_tasks(
    n: int, seed: int, prefix: str = "hops", max_hops: int = MAX_HOPS, split: demo.Split = "train"
) -> list[dict[str, Any]]:
    """`n` tasks of `split`: a start key, a chain length and a table in which the chain's keys point
    onward. Held out by construction, as the demo's tasks: the chain's last lookup, (its last key,
    the answer), is a pair of `split` (demo.split_of), and every other key -> value entry a training
    pair, so no training chain or lookup ever shows a held-out chain's last step."""
    if n < 1:
        raise ValueError(f"make_tasks: n must be >= 1, got {n}")
    demo.check_split(split)
    rng = random.Random(seed)
    tasks = []
    for index in range(n):
        length = rng.randint(1, max_hops)
        chain = rng.sample(demo.KEYS, length)
        table = {key: rng.choice(demo.values_for(key, "train")) for key in demo.KEYS}
        table[chain[-1]] = rng.choice(demo.values_for(chain[-1], split))
        for here, there in itertools.pairwise(chain):
            table[here] = there
        tasks.append({"id": f"{prefix}-{seed}-{index:05d}", "key": chain[0], "hops": length, "table": table})
    return tasks


def check_task(task: Any) -> dict[str, Any]:
    """The task, or an error that says which field is wrong."""
    if not isinstance(task, dict):
        raise TypeError(f"hops task: expected a JSON object, got {type(task).__name__}")
    key, table, hops = task.get("key"), task.get("table"), task.get("hops")
    if not isinstance(table, dict) or not all(k in table for k in demo.KEYS):
        raise ValueError(f"hops task: 'table' must map every key {demo.KEYS[0]}..{demo.KEYS[-1]} to a word")
    if key not in demo.KEYS:
        raise ValueError(f"hops task: 'key' must be one of {demo.KEYS}, got {key!r}")
    if not isinstance(hops, int) or not 1 <= hops <= MAX_HOPS:
        raise ValueError(f"hops task: 'hops' must be an integer in 1..{MAX_HOPS}, got {hops!r}")
    return task


def chain(task: dict[str, Any]) -> list[str]:
    """The chain's elements after the start key: what each hop's lookup returns (the last is the answer)."""
    out, key = [], task["key"]
    for _ in range(task["hops"]):
        key = task["table"][key]
        out.append(key)
    return out


@dataclass(frozen=True)
class Request:
    """One model call the agent wants: on thread `thread` (`main`, `main.1` after a compaction,
    `sub.3` for the fourth sub-agent), with these messages."""

    thread: str
    messages: list[dict[str, Any]]
    max_tokens: int


@dataclass(frozen=True)
class Reply:
    text: str  # the assistant's text, as the harness got it
    finish_reason: str  # "stop" (it ended its turn) or "length"

    @property
    def words(self) -> list[str]:
        return demo.generated_words(self.text, self.finish_reason)


@dataclass
class Outcome:
    answer: str | None = None  # the main agent's final answer, None if it never gave one
    results: list[str] = field(default_factory=list)  # what each hop's accepted sub-agent returned
    sub_agents: int = 0
    compactions: int = 0
    calls: int = 0
    reward: float = 0.0


def main_messages(current: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": MAIN_ROLE}, {"role": "user", "content": current}]


def reward(task: dict[str, Any], outcome: Outcome) -> float:
    right = 0  # failed hops (`none`) are skipped: a hop redone after a compaction still counts
    for got, want in zip([r for r in outcome.results if r != demo.NO_VALUE], chain(task)):
        if got != want:
            break
        right += 1
    solved = right == task["hops"] and outcome.answer == chain(task)[-1]
    return (right + solved) / (task["hops"] + 1)


Agent = Generator[Request, Reply, Outcome]


def sub_agent(task: dict[str, Any], key: str, thread: str) -> Generator[Request, Reply, str | None]:
    """One lookup in a fresh context (the demo episode); its answer, or None when it failed."""
    first = yield Request(thread, demo.first_messages({"key": key}), demo.CALL1_MAX_TOKENS)
    tool = demo.run_tool(task, first.text)
    second = yield Request(
        thread, demo.second_messages({"key": key}, first.text, tool), demo.CALL2_MAX_TOKENS
    )
    words = second.words
    answer = words[0] if words else None
    return answer if tool != demo.NO_VALUE and answer == tool else None


def agent(task: dict[str, Any]) -> Agent:
    """The harness's control flow; `yield` a Request, get its Reply; returns the Outcome."""
    outcome = Outcome()
    segment = 0
    messages = main_messages(task["key"])
    current = task["key"]  # the latest result: what a compacted context starts from
    seen = 0  # tool results in the main context

    def compact() -> bool:
        nonlocal segment, messages, seen
        if outcome.compactions >= MAX_COMPACTIONS:
            return False
        outcome.compactions += 1
        segment += 1
        messages, seen = main_messages(current), 0
        return True

    while True:
        if seen >= COMPACT_AFTER and not compact():
            break
        thread = "main" if segment == 0 else f"main.{segment}"
        reply = yield Request(thread, messages, MAIN_MAX_TOKENS)
        outcome.calls += 1
        words = reply.text.split()
        if len(words) == 1 and words[0] in demo.VALUES:
            outcome.answer = words[0]
            break
        if len(words) != 2 or words[0] != demo.CALL or words[1] not in demo.KEYS:
            if compact():  # an answer it cannot use: start again from the summary
                continue
            break
        if len(outcome.results) >= MAX_DELEGATIONS or outcome.sub_agents >= MAX_SUB_AGENTS:
            break
        result = None
        for _ in range(min(SUB_ATTEMPTS, MAX_SUB_AGENTS - outcome.sub_agents)):
            thread_id = f"sub.{outcome.sub_agents}"
            outcome.sub_agents += 1
            result = yield from sub_agent(task, words[1], thread_id)
            outcome.calls += 2
            if result is not None:
                break
        result = result or demo.NO_VALUE
        outcome.results.append(result)
        messages = [*messages, {"role": "assistant", "content": reply.text},
                    {"role": "tool", "tool_call_id": f"hop-{len(outcome.results)}", "content": result}]  # fmt: skip
        seen += 1
        if result != demo.NO_VALUE:
            current = result
    outcome.reward = reward(task, outcome)
    return outcome


def run(agent_program: Agent, answer: Any) -> Outcome:
    """Drive an agent with `answer(request) -> Reply` (one call at a time, as a harness does)."""
    try:
        request = next(agent_program)
        while True:
            request = agent_program.send(answer(request))
    except StopIteration as stop:
        return stop.value


def demonstration(task: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The ideal rollout's conversations (each thread's last messages with the answer), for the warm start."""
    last: dict[str, list[dict[str, Any]]] = {}
    lookups = {key: task["table"][key] for key in demo.KEYS}

    def ideal(request: Request) -> Reply:
        messages = request.messages
        if request.thread.startswith("sub"):
            key = messages[0]["content"]
            text = f"{demo.CALL} {key}" if len(messages) == 1 else lookups[key]
        else:
            latest = messages[-1]["content"]
            text = latest if latest in demo.VALUES else f"{demo.CALL} {latest}"
        last[request.thread] = [*messages, {"role": "assistant", "content": text}]
        return Reply(text, "stop")

    run(agent(task), ideal)
    return list(last.values())
