"""A harness as agent frameworks run one: a main thread that starts four sub-agents at once and
keeps working while they run, all through the real `openai` SDK (AsyncOpenAI) and the real sidecar
to the embedded engine, spans over OTLP into the real receiver and store. Every call is recorded
with its trace parent, and assembly merges each thread onto its own path of the call tree: the
main thread is one sample, each sub-agent its own.

The first harness keeps token IDs (completions with token prompts, as harnesses that guard against
retokenization do), so every prompt extends its thread's last sequence exactly on any model. The
second speaks chat to a scripted engine whose template round-trips: a sub-agent, an SDK retry, a
compaction and a process the agent spawned (no trace context)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import httpx
import pytest
import openai
from agl import semconv

from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.batch import TrainingBatch
from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig, EmbeddedOptions
from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model
from tests.support.pipeline import pipeline

TRACE = "5a" * 16
SUB_AGENTS = 4
EXTRA = {"return_token_ids": True}


class Thread:
    """One agent thread: its token sequence so far and the calls it made."""

    def __init__(self, client: openai.AsyncOpenAI, prompt: list[int], span: int) -> None:
        self.client, self.tokens, self.span = client, prompt, span
        self.completions: list[list[int]] = []

    async def call(self, observation: list[int]) -> list[int]:
        self.tokens = self.tokens + observation
        response = await self.client.completions.create(
            model="tiny",
            prompt=self.tokens,
            max_tokens=4,
            temperature=1.0,
            extra_body=EXTRA,
            extra_headers={"traceparent": f"00-{TRACE}-{self.span:016x}-01"},
        )
        completion = response.choices[0].model_extra["token_ids"]
        self.tokens = self.tokens + completion
        self.completions.append(completion)
        return completion


async def harness(base_url: str) -> tuple[Thread, list[Thread]]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    main = Thread(client, [5, 6, 7, 8], span=1)
    await main.call([])
    subs = [Thread(client, [9, 20 + k, 11, 12], span=2 + k) for k in range(SUB_AGENTS)]

    async def sub_agent(thread: Thread) -> list[int]:
        first = await thread.call([])
        return await thread.call([13, *first[:1]])  # a tool result, then the sub-agent's answer

    # the sub-agents run at once, and the main thread keeps working meanwhile
    results, _ = await asyncio.gather(asyncio.gather(*(sub_agent(s) for s in subs)), main.call([14]))
    await main.call([15, *[token for result in results for token in result[:1]]])  # their answers
    await client.close()
    return main, subs


@pytest.mark.slow
def test_a_main_thread_and_four_concurrent_sub_agents_become_five_exact_samples(tmp_path: Path) -> None:
    model = build_bpe_model(
        tmp_path / "model", TinyModelSpec(hidden=128, heads=2, kv_heads=2, intermediate=256, max_positions=256)
    )
    engine_config = EmbeddedEngineConfig(model_path=model, served_model_name="tiny", options=EmbeddedOptions(max_model_len=256))
    with EmbeddedEngine(engine_config) as engine, pipeline(tmp_path, engine.urls[0]) as piped:
        main, subs = asyncio.run(harness(f"{piped.sidecar_url}/rollouts/r-sub/v1"))
        store = piped.finish("r-sub", 1.0)
        calls = store.load("r-sub").calls
        result = assemble(store, store.ready_rollouts(), AssemblyConfig())

    # every call recorded, in the harness's trace, each with the parent span its thread sent
    assert len({call.call_seq for call in calls}) == len(calls) == 3 + 2 * SUB_AGENTS
    assert {call.origin for call in calls} == {semconv.ORIGIN_HARNESS}
    parents = sorted(int.from_bytes(call.parent_span_id) for call in calls)
    assert parents == sorted([1, 1, 1] + [2 + k for k in range(SUB_AGENTS) for _ in range(2)])

    (rollout,) = result.rollouts
    assert len(rollout.samples) == 1 + SUB_AGENTS
    for thread, calls_made in [(main, 3), *((sub, 2) for sub in subs)]:
        [sample] = [s for s in rollout.samples if s.token_ids[:2].tolist() == thread.tokens[:2]]
        assert sample.token_ids.tolist() == thread.tokens and len(sample.call_seqs) == calls_made
        trained = [token for token, mask in zip(sample.token_ids, sample.loss_mask, strict=True) if mask]
        assert trained == [token for completion in thread.completions for token in completion]
    # each sub-agent's first call is a new root (a break classified against the closest call)
    assert len(result.details[0].merge_failures) == SUB_AGENTS
    assert result.report.merged_calls == 2 + SUB_AGENTS
    batch = TrainingBatch.from_rollouts(result.rollouts)
    assert int(batch.loss_mask.sum()) == sum(len(c) for t in [main, *subs] for c in t.completions)


_answers = itertools.count()


def chat_reply(body: dict, choice: int) -> str:
    """The fake engine's answer: a new one each call (a retried request gets another answer)."""
    return f"answer {next(_answers)} to {body['messages'][-1]['content'][:12]}"


async def chat_harness(base_url: str) -> list[list[dict]]:
    """Chat threads as frameworks write them; returns each call's messages + the answer, in order."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    headers = {"traceparent": f"00-{TRACE}-{1:016x}-01"}
    made: list[list[dict]] = []

    async def ask(messages: list[dict]) -> list[dict]:
        response = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=32, extra_headers=headers
        )
        answered = [*messages, {"role": "assistant", "content": response.choices[0].message.content}]
        made.append(answered)
        return answered

    main = await ask([{"role": "system", "content": "main agent"}, {"role": "user", "content": "fix the bug"}])

    async def sub_agent() -> list[dict]:
        sub = await ask([{"role": "system", "content": "sub agent"}, {"role": "user", "content": "find the file"}])
        return await ask([*sub, {"role": "tool", "content": "src/a.py", "tool_call_id": "s0"}])

    # a sub-agent runs while the main thread goes on
    _, main = await asyncio.gather(sub_agent(), ask([*main, {"role": "tool", "content": "ran", "tool_call_id": "m0"}]))
    go_on = [*main, {"role": "user", "content": "go on"}]
    await ask(go_on)  # an SDK retry: the same request twice, the harness keeps the second answer
    main = await ask(go_on)
    # compaction: the harness replaces its history with a summary and goes on from there
    compacted = await ask([main[0], {"role": "user", "content": "summary: fixed a.py"}])
    await ask([*compacted, {"role": "user", "content": "now test it"}])
    await client.close()
    # a process the agent spawned, with OPENAI_BASE_URL but no trace context
    async with httpx.AsyncClient() as plain:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "lint"}], "max_tokens": 8}
        (await plain.post(f"{base_url}/chat/completions", json=body)).raise_for_status()
    return made


def test_chat_threads_retry_compaction_and_a_spawned_process_through_the_sidecar(tmp_path: Path) -> None:
    from agl_testing.fake_vllm import IM_END, FakeVLLM, chat_prompt_ids, encode

    with FakeVLLM(reply=chat_reply) as engine, pipeline(tmp_path, engine.base_url) as piped:
        made = asyncio.run(chat_harness(f"{piped.sidecar_url}/rollouts/r-chat/v1"))
        store = piped.finish("r-chat", 1.0)
        calls = store.load("r-chat").calls
        result = assemble(store, store.ready_rollouts(), AssemblyConfig())

    assert len(calls) == len(made) + 1  # every call recorded, the spawned process's too
    origins = [call.origin for call in sorted(calls, key=lambda c: c.call_seq)]
    assert origins == [semconv.ORIGIN_HARNESS] * len(made) + [semconv.ORIGIN_UNTRACED]

    def tokens(messages: list[dict]) -> list[int]:  # a call's prompt + its answer, as the engine saw them
        return chat_prompt_ids(messages[:-1]) + encode(messages[-1]["content"]) + [IM_END]

    assert len(result.rollouts[0].samples) == 5  # main, its retry's branch, sub-agent, compaction, spawned
    by_tokens = {tuple(s.token_ids): s for s in result.rollouts[0].samples}
    first_try, second_try = [m for m in made if m[-2]["content"] == "go on"]
    sub_last = [m for m in made if m[0]["content"] == "sub agent"][-1]
    compacted_last = made[-1]
    main_sample = by_tokens[tuple(tokens(first_try))]  # the first answer to the retried request continues
    assert len(main_sample.call_seqs) == 3
    branch = by_tokens[tuple(tokens(second_try))]  # the second starts a branch: its shared prefix is context
    assert len(branch.call_seqs) == 1 and sum(branch.loss_mask) == len(encode(second_try[-1]["content"])) + 1
    assert len(by_tokens[tuple(tokens(sub_last))].call_seqs) == 2
    assert len(by_tokens[tuple(tokens(compacted_last))].call_seqs) == 2
    trained = sum(sum(s.loss_mask) for s in result.rollouts[0].samples)
    answers = sum(len(encode(m[-1]["content"])) + 1 for m in made)
    spawned = [c for c in calls if c.origin == semconv.ORIGIN_UNTRACED][0]
    assert trained == answers + int(spawned.completion_ids.size)  # every answer trained exactly once
