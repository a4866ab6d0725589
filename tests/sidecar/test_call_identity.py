"""A call's identity (agl.call.seq) outlives the sidecar that numbered it: a rollout whose sidecar
restarts half-way, or whose calls are spread over two sidecars, reaches the store with every call
numbered once and in arrival order, and trains as one sample holding every turn."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from agl_sidecar.config import build
from agl_sidecar.server import BackgroundSidecar
from agl_trainer.assembly import AssemblyConfig, assemble
from agl_trainer.receiver import Receiver, ReceiverConfig
from agl_trainer.store import RolloutStore
from tests.sidecar.sidecar_process import SidecarProcess
from agl_testing.fake_vllm import IM_END, FakeVLLM, encode
from tests.support.waiting import wait_until

TURNS = 6


def reply(body: dict, choice: int) -> str:
    return f"turn {len(body['messages']) // 2}"


@contextmanager
def receiving(tmp_path: Path) -> Iterator[Receiver]:
    receiver = Receiver(tmp_path / "store.sqlite", ReceiverConfig(port=0)).start()
    try:
        yield receiver
    finally:
        receiver.stop()


def converse(rollout: str, sidecar_for_turn: Callable[[int], str]) -> list[str]:
    """TURNS turns of one conversation, turn i through sidecar_for_turn(i); the replies."""
    messages: list[dict] = []
    replies = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"step {turn}"})
        body = {"model": "tiny", "messages": messages, "max_tokens": 16, "stream": turn % 2 == 1}
        answer = httpx.post(f"{sidecar_for_turn(turn)}/rollouts/{rollout}/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        text = reply({"messages": messages}, 0)
        messages.append({"role": "assistant", "content": text})
        replies.append(text)
    return replies


def trained_in_order(tmp_path: Path, rollout: str, replies: list[str]) -> None:
    store = RolloutStore(tmp_path / "store.sqlite", grace_s=0.0)
    try:
        wait_until(lambda: len(store.ready_rollouts()) == 1, "the rollout to be ready")
        calls = store.load(rollout).calls
        seqs = [call.call_seq for call in sorted(calls, key=lambda c: c.end_ns)]
        assert len(seqs) == TURNS and seqs == sorted(set(seqs))  # unique, increasing in arrival order
        [detail] = assemble(store, store.ready_rollouts(), AssemblyConfig()).details
    finally:
        store.close()
    assert detail.problems == {}
    [sample] = detail.result.samples  # each turn extends the last: one sample, every turn trained
    assert sample.call_seqs == seqs
    trained = [token for token, mask in zip(sample.token_ids, sample.loss_mask, strict=True) if mask]
    assert trained == [token for text in replies for token in [*encode(text), IM_END]]


def test_a_sidecar_restarted_mid_rollout_numbers_on(tmp_path: Path) -> None:
    with FakeVLLM(reply=reply) as fake, receiving(tmp_path) as receiver:
        args = ["--upstream", fake.base_url, "--otlp-endpoint", receiver.url, "--spool-dir", str(tmp_path / "spool")]
        log = str(tmp_path / "sidecar.log")
        env = {"AGL_SIDECAR_EXPORT_INTERVAL_S": "0.05"}
        processes = [SidecarProcess(*args, log_path=log, env=env).start()]
        try:

            def through(turn: int) -> str:
                if turn == TURNS // 2:  # half-way: SIGTERM (spans sent on the way out), a new process
                    assert processes[-1].signal(signal.SIGTERM) == 0
                    processes.append(SidecarProcess(*args, log_path=log, env=env).start())
                return processes[-1].url

            replies = converse("restarted", through)
            url = processes[-1].url
            httpx.post(f"{url}/rollouts/restarted/reward", json={"value": 1.0}).raise_for_status()
            httpx.post(f"{url}/rollouts/restarted/end", json={"status": "succeeded"}).raise_for_status()
            trained_in_order(tmp_path, "restarted", replies)
        finally:
            for process in processes:
                process.kill()


def test_two_sidecars_serving_one_rollout(tmp_path: Path) -> None:
    with FakeVLLM(reply=reply) as fake, receiving(tmp_path) as receiver:

        def sidecar(name: str) -> BackgroundSidecar:
            return BackgroundSidecar(build({
                "upstream": [fake.base_url], "listen": "127.0.0.1:0", "otlp_endpoint": receiver.url,
                "spool_dir": str(tmp_path / name), "export_interval_s": 0.05,
            }))  # fmt: skip

        with sidecar("a") as a, sidecar("b") as b:
            replies = converse("shared", lambda turn: (a.url, b.url)[turn % 2])
            httpx.post(f"{a.url}/rollouts/shared/reward", json={"value": 1.0}).raise_for_status()
            httpx.post(f"{b.url}/rollouts/shared/end", json={"status": "succeeded"}).raise_for_status()
            trained_in_order(tmp_path, "shared", replies)


@pytest.mark.parametrize("value", [0, 5])
def test_a_per_call_reward_names_the_call_by_position(tmp_path: Path, value: int) -> None:
    """A harness counts its calls (0 = its first); seqs that are not 0, 1, 2 do not change that."""
    with FakeVLLM(reply=reply) as fake, receiving(tmp_path) as receiver:
        settings = {"upstream": [fake.base_url], "listen": "127.0.0.1:0", "otlp_endpoint": receiver.url,
                    "spool_dir": str(tmp_path / "spool"), "export_interval_s": 0.05}  # fmt: skip
        with BackgroundSidecar(build(settings)) as running:
            converse("rewarded", lambda turn: running.url)
            reward = {"value": 2.0, "call_seq": value}
            httpx.post(f"{running.url}/rollouts/rewarded/reward", json=reward).raise_for_status()
            httpx.post(f"{running.url}/rollouts/rewarded/reward", json={"value": 1.0}).raise_for_status()
            httpx.post(f"{running.url}/rollouts/rewarded/end", json={"status": "succeeded"}).raise_for_status()
            store = RolloutStore(tmp_path / "store.sqlite", grace_s=0.0)
            try:
                wait_until(lambda: len(store.ready_rollouts()) == 1, "the rollout to be ready")
                [detail] = assemble(store, store.ready_rollouts(), AssemblyConfig()).details
            finally:
                store.close()
    [sample] = detail.result.samples
    assert sample.token_rewards is not None and sum(sample.token_rewards) == 2.0
    where = [i for i, r in enumerate(sample.token_rewards) if r]
    ends = [i for i, mask in enumerate(sample.loss_mask) if mask and (i + 1 == len(sample.loss_mask) or not sample.loss_mask[i + 1])]
    assert where == [ends[value]]  # on the last token of that turn's completion


def test_a_rollout_that_fell_out_of_the_table_numbers_on() -> None:
    from agl_sidecar.spans.recorder import _Rollouts

    rollouts = _Rollouts(max_rollouts=1)
    first = [rollouts.next_seq("a") for _ in range(3)]
    rollouts.next_seq("b")  # "a" falls out
    later = rollouts.next_seq("a")
    assert first == sorted(set(first)) and later > first[-1]
    assert {seq & 0xFF for seq in [*first, later]} == {rollouts.seqs.instance}  # the instance byte stays
