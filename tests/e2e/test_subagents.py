"""A harness as agent frameworks run one: a main thread that starts four sub-agents at once and
keeps working while they run, all through the real `openai` SDK (AsyncOpenAI) and the real sidecar
to the embedded engine, spans over OTLP into the real receiver and store. Every call is recorded
with its trace parent, and assembly merges each thread onto its own path of the call tree: the
main thread is one sample, each sub-agent its own.

The harness keeps token IDs (completions with token prompts, as harnesses that guard against
retokenization do), so every prompt extends its thread's last sequence exactly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import openai
from agl import semconv

from agl_sidecar.config import build
from agl_sidecar.server import BackgroundSidecar
from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.batch import TrainingBatch
from agl_trainer.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig
from agl_trainer.models.tiny import TinyModelSpec, build_bpe_model
from agl_trainer.receiver import Receiver, ReceiverConfig
from agl_trainer.store import RolloutStore
from tests.support.waiting import wait_until

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
    store_path = tmp_path / "store.sqlite"
    receiver = Receiver(store_path, ReceiverConfig(port=0)).start()
    try:
        with EmbeddedEngine(
            EmbeddedEngineConfig(model_path=model, served_model_name="tiny", max_model_len=256)
        ) as engine, BackgroundSidecar(
            build(
                {
                    "upstream": [engine.urls[0]],
                    "listen": "127.0.0.1:0",
                    "otlp_endpoint": receiver.url,
                    "spool_dir": str(tmp_path / "spool"),
                    "export_interval_s": 0.05,
                }
            )
        ) as sidecar:
            main, subs = asyncio.run(harness(f"{sidecar.url}/rollouts/r-sub/v1"))
            httpx.post(f"{sidecar.url}/rollouts/r-sub/reward", json={"value": 1.0}).raise_for_status()
            httpx.post(f"{sidecar.url}/rollouts/r-sub/end", json={"status": "succeeded"}).raise_for_status()
            store = RolloutStore(store_path, grace_s=0.0)
            wait_until(lambda: len(store.ready_rollouts()) == 1, "the rollout to be ready")
            calls = store.load("r-sub").calls
            result = assemble(store, store.ready_rollouts(), AssemblyConfig())
    finally:
        receiver.stop()

    # every call recorded, in the harness's trace, each with the parent span its thread sent
    assert sorted(call.call_seq for call in calls) == list(range(3 + 2 * SUB_AGENTS))
    assert {call.origin for call in calls} == {semconv.ORIGIN_HARNESS}
    parents = sorted(int.from_bytes(call.parent_span_id) for call in calls)
    assert parents == sorted([1, 1, 1] + [2 + k for k in range(SUB_AGENTS) for _ in range(2)])

    (rollout,) = result.rollouts
    assert len(rollout.samples) == 1 + SUB_AGENTS
    for thread, calls_made in [(main, 3), *((sub, 2) for sub in subs)]:
        [sample] = [s for s in rollout.samples if s.token_ids[:2] == thread.tokens[:2]]
        assert sample.token_ids == thread.tokens and len(sample.call_seqs) == calls_made
        trained = [token for token, mask in zip(sample.token_ids, sample.loss_mask, strict=True) if mask]
        assert trained == [token for completion in thread.completions for token in completion]
    # each sub-agent's first call is a new root (a break classified against the closest call)
    assert len(result.details[0].merge_failures) == SUB_AGENTS
    assert result.report.merged_calls == 2 + SUB_AGENTS
    batch = TrainingBatch.from_rollouts(result.rollouts)
    assert int(batch.loss_mask.sum()) == sum(len(c) for t in [main, *subs] for c in t.completions)
