"""The data path across components: a harness's calls through the real sidecar, its spans over
OTLP into the trainer's real receiver and store, and out as one training sample whose tokens are
exactly the engine's. Each part has its own tests; this one checks they agree on the wire."""

from __future__ import annotations

from pathlib import Path

import openai

from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.batch import TrainingBatch
from agl_testing.fake_vllm import IM_END, FakeVLLM, chat_prompt_ids, encode
from tests.support.pipeline import pipeline


def scripted_reply(body: dict, choice: int) -> str:
    return "call k3" if len(body["messages"]) == 1 else "v7"


def test_a_two_call_rollout_becomes_one_exact_sample(tmp_path: Path) -> None:
    with FakeVLLM(reply=scripted_reply) as engine, pipeline(tmp_path, engine.base_url, policy_version=4) as piped:
        client = openai.OpenAI(base_url=f"{piped.sidecar_url}/rollouts/r-e2e/v1", api_key="unused")
        messages = [{"role": "user", "content": "look up k3"}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "tool", "content": "v7", "tool_call_id": "t0"},
        ]
        # Streamed, so both paths of the sidecar feed the same sample.
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, stream=True)
        second_text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        store = piped.finish("r-e2e", 0.5, task_id="task-1", mode="train")
        result = assemble(store, store.ready_rollouts(mode="train"), AssemblyConfig())

    (rollout,) = result.rollouts
    assert rollout.reward == 0.5
    (sample,) = rollout.samples  # the second prompt extends the first exactly: merged
    assert len(sample.call_seqs) == 2 and sample.call_seqs == sorted(sample.call_seqs)
    first_prompt = chat_prompt_ids([{"role": "user", "content": "look up k3"}])
    first_completion = encode("call k3") + [IM_END]  # vLLM reports the EOS it generated
    second_prompt = chat_prompt_ids(messages)
    second_completion = encode("v7") + [IM_END]
    assert second_prompt[: len(first_prompt) + len(first_completion)] == first_prompt + first_completion
    assert sample.token_ids.tolist() == second_prompt + second_completion
    trained = [token for token, mask in zip(sample.token_ids, sample.loss_mask) if mask]
    assert trained == first_completion + second_completion
    assert {v for v, m in zip(sample.policy_versions, sample.loss_mask) if m} == {4}
    assert second_text == "v7"  # the harness got the streamed text
    batch = TrainingBatch.from_rollouts(result.rollouts)
    assert int(batch.loss_mask.sum()) == len(first_completion) + len(second_completion)
