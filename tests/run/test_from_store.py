"""`agl train CONFIG --from-store traces.db`: train later on rollouts production harnesses left in a
store (their rewards from agl.emit_reward), off-policy; a second run continues, never repeats."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from agl_trainer.loop.stored import select
from agl_trainer.store import RolloutKey
from agl_trainer.store.records import RolloutInfo


def info(rid: str, task: str, *, cause: str | None = "ok", rewards: int = 1, completed_at: float = 100.0) -> RolloutInfo:
    return RolloutInfo(
        rollout_id=rid, attempt=0, task_id=task, mode="train", status=None, complete=True, end_cause=cause,
        first_seen_at=completed_at, last_span_at=completed_at, completed_at=completed_at, trained_step=None,
        dropped_reason=None, calls=2, rewards=rewards,
    )  # fmt: skip


def test_selection_groups_by_task_and_applies_the_policies() -> None:
    infos = [
        info("a1", "A"), info("a2", "A"), info("a3", "A"),  # group_size 2: [a1, a2] and a3 alone (waits)
        info("b1", "B"), info("b2", "B", rewards=0),  # b2 has no reward yet: waits, so b1 waits too
        info("c1", "C", cause="harness_error"),
        info("d1", "D", completed_at=10.0),
        info("e1", "E"), info("e2", "E"),
    ]  # fmt: skip
    versions = {RolloutKey(r.rollout_id): 5 for r in infos} | {RolloutKey("e1"): 2}
    chosen = select(infos, versions, group_size=2, min_group_size=2, staleness=2, max_age_s=60, now=150.0, current=5)
    assert chosen.groups == [[RolloutKey("a1"), RolloutKey("a2")]]
    assert chosen.dropped == {"failed": [RolloutKey("c1")], "too_old": [RolloutKey("d1")], "stale": [RolloutKey("e1")]}
    assert chosen.waiting == 4  # a3, b1, b2, e2
    unbounded = select(infos, versions, group_size=8, min_group_size=1, staleness=-1, max_age_s=0, now=150.0,
                       current=5)  # fmt: skip
    assert [len(g) for g in unbounded.groups] == [3, 1, 1, 2] and unbounded.dropped == {"failed": [RolloutKey("c1")]}


def test_a_missing_store_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agl_trainer.cli import main
    from examples.demo.model import build_demo_model

    model = build_demo_model(tmp_path / "tiny", seed=0)
    code = main(["train", "--from-store", str(tmp_path / "nope.db"), f"--model.path={model}",
                 f"--output_dir={tmp_path / 'run'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "--from-store" in err and "no such rollout store" in err, err


def test_a_rollout_that_never_sent_its_end_is_trained_once_quiet(tmp_path: Path) -> None:
    import httpx
    from agl_trainer.receiver import Receiver, ReceiverConfig
    from agl_trainer.store import RolloutStore
    from agl_trainer.store.cursor import close_quiet_among
    from tests.dataplane.otlp import call_span, request, reward_span, rollout_span

    spans = [call_span("ended", 0, [1, 2], [3, 4]), reward_span("ended", 1.0), rollout_span("ended"),
             call_span("no-end", 0, [1, 2], [3, 5]), reward_span("no-end", 0.0)]  # fmt: skip
    with Receiver(tmp_path / "t.db", ReceiverConfig(port=0)) as receiver:
        body = request(spans).SerializeToString()
        response = httpx.post(f"{receiver.url}/v1/traces", content=body,
                              headers={"content-type": "application/x-protobuf"})  # fmt: skip
        assert response.status_code == 200
    with RolloutStore(tmp_path / "t.db", grace_s=0.0) as store:
        assert close_quiet_among(store, store.incomplete_rollouts(), 600.0, store.clock()) == 0  # its last span is fresh: it may go on
        assert [i.rollout_id for i in store.ready_rollouts()] == ["ended"]
        assert close_quiet_among(store, store.incomplete_rollouts(), 600.0, store.clock() + 601) == 1
        ready = {i.rollout_id: i.end_cause for i in store.ready_rollouts()}
        assert ready == {"ended": "ok", "no-end": "ok"}


# --- collected by the demo harness through the sidecar, trained later ---------------------------


async def collect(base_url: str, tasks: list[dict[str, Any]], episodes: int, concurrency: int = 64) -> int:
    """Production-style: each episode in agl.rollout, calls through the sidecar, reward by agl.emit_reward."""
    import agl
    from examples.demo.harness import run_episode_async

    slots = asyncio.Semaphore(concurrency)

    async def one(task: dict[str, Any]) -> None:
        rid = f"prod-{uuid.uuid4().hex[:12]}"
        async with slots:
            with agl.rollout(rid, task_id=str(task["task_id"])):
                await run_episode_async(task, f"{base_url}/rollouts/{rid}/v1", emit=True)

    await asyncio.gather(*(one(t) for t in tasks for _ in range(episodes)))
    return len(tasks) * episodes


def held_out_reward(model_dir: Path, seed: int, repeats: int = 16) -> float:
    import torch
    from examples.demo.episodes import DemoTokens, mean_reward
    from examples.demo.prepare import EVAL_TASKS
    from examples.demo.task import make_tasks
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokens = DemoTokens(AutoTokenizer.from_pretrained(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    held_out = make_tasks(EVAL_TASKS, seed + 10_000, "test")  # pairs no training task shows
    return mean_reward(model, tokens, held_out, seed=seed, repeats=repeats)


@pytest.mark.slow
def test_rollouts_collected_in_production_train_later_and_the_reward_rises(tmp_path: Path) -> None:
    import agl
    from agl_trainer.cli import main
    from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
    from agl_trainer.receiver import Receiver, ReceiverConfig
    from agl_trainer.run.sidecar_client import SidecarProcess
    from agl_trainer.store import RolloutStore
    from examples.demo.prepare import prepare_demo_model
    from examples.demo.task import make_tasks

    seed = 0
    prepared = prepare_demo_model(tmp_path / "demo", seed=seed, progress=False)
    store_path = tmp_path / "traces.db"
    tasks = make_tasks(160, seed)
    # Production: the policy served as is (version 0), harnesses report rewards over OTLP.
    with Receiver(store_path, ReceiverConfig(port=0)) as receiver:
        engine = EmbeddedEngine(EmbeddedEngineConfig(model_path=str(prepared.path), served_model_name="tiny"))
        engine.start()
        sidecar = SidecarProcess(engine.urls, receiver.url, log_path=tmp_path / "sidecar.log")
        try:
            sidecar.start()
            agl.init(endpoint=receiver.url)
            collected = asyncio.run(collect(sidecar.url, tasks, episodes=8))
            assert agl.flush(10.0)
            asyncio.run(_drain(sidecar))
        finally:
            sidecar.stop()
            engine.stop()
            agl.init(endpoint="http://127.0.0.1:9")  # nothing more of this process goes to that receiver
    with RolloutStore(store_path) as store:
        assert sum(1 for i in store.rollouts() if i.rewards) == collected

    run = tmp_path / "offline"
    # loop.staleness -1: every stored rollout trains, however far the weights moved (the demo config's
    # staleness 1, one knob for live and stored rollouts, would drop those 2+ versions behind)
    common = [f"--model.path={prepared.path}", f"--output_dir={run}", f"--seed={seed}", "--loop.batch_rollouts=64",
              "--loop.staleness=-1",
              "--backend.options.ppo_epochs=3",
              "--loop.checkpoint_every=2", "--loop.completion_grace_s=0", "--quiet"]  # fmt: skip
    assert main(["train", "examples/demo/config.yaml", "--from-store", str(store_path), "--loop.max_steps=4", *common]) == 0
    # Stopped at 4 steps: --resume continues from the checkpoint and the store's marks.
    assert main(["train", "examples/demo/config.yaml", "--from-store", str(store_path), "--resume",
                 "--loop.max_steps=100", *common]) == 0  # fmt: skip
    ledger = [json.loads(line) for line in (run / "trained.jsonl").read_text().splitlines()]
    trained = [tuple(r) for entry in ledger for r in entry["rollouts"]]
    assert len(trained) == len(set(trained)) == collected  # every collected rollout once, none twice
    assert [entry["step"] for entry in ledger] == list(range(2, collected // 64 + 1, 2))  # the resume went on
    # A second run over the same store finds nothing left to train.
    assert main(["train", "examples/demo/config.yaml", "--from-store", str(store_path),
                 *[a.replace(str(run), str(tmp_path / "again")) for a in common]]) == 0  # fmt: skip
    assert not (tmp_path / "again" / "trained.jsonl").exists()

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Step 1 trains the weights that sampled every token (version 0: on-policy); every later step's
    # weights are newer than every token (off-policy, importance-corrected), by as many steps.
    assert rows[0]["importance/stale_token_frac"] == 0.0 and rows[0]["staleness/max"] == 0.0
    assert all(row["importance/stale_token_frac"] == 1.0 for row in rows[1:])
    assert [row["staleness/max"] for row in rows] == [float(step) for step in range(len(rows))]
    final = Path((run / "checkpoints" / "latest").read_text().strip())
    after = held_out_reward(run / "checkpoints" / final / "backend" / "model", seed)
    # On-policy validation (sampled, 64 held-out tasks x 16) of the trained weights against the served
    # policy's. Measured on two collections: 0.54 -> 0.70-0.73 with 3 PPO epochs a step (one epoch:
    # 0.49-0.62, too close to the noise of a collection); the evaluation's own noise is ~0.015.
    before = held_out_reward(prepared.path, seed)
    assert after >= before + 0.08, (before, after)


async def _drain(sidecar: Any) -> None:
    """Every span the sidecar recorded reached the receiver (a drained pause says so)."""
    from agl_trainer.run.sidecar_client import SidecarAdmin

    async with SidecarAdmin(sidecar.url, sidecar.admin_token) as admin:
        state = await admin.pause(drain=True, timeout_s=60)
        assert state.spans_flushed, state
        await admin.resume()


# --- the store read incrementally: a step reads what changed since the last one --------------------


def test_a_step_after_the_first_reads_only_what_changed_and_selects_as_a_full_scan(tmp_path: Path) -> None:
    from agl_trainer.store import RolloutStore
    from agl_trainer.store.cursor import FullScan, StoreCursor
    from agl_testing.rollouts import end, reward, write_rollouts

    path = tmp_path / "t.db"
    with RolloutStore(path, grace_s=0.0) as store:
        write_rollouts(store, [f"r-{i}" for i in range(40)])
        write_rollouts(store, ["r-40"], rewarded=False)  # ended; its reward comes later
        write_rollouts(store, ["r-41"], ended=False)  # in flight
        cursor, full = StoreCursor(store, path), FullScan(store, path)

        def step() -> list[RolloutKey]:
            now = store.clock()
            ours, reference = cursor.refresh(600.0, now), full.refresh(600.0, now)
            assert [(i.key, i.calls, i.rewards) for i in ours] == [(i.key, i.calls, i.rewards) for i in reference]
            assert (cursor.min_versions, cursor.max_versions) == (full.min_versions, full.max_versions)
            assert cursor.newest == full.newest
            policy = dict(group_size=4, min_group_size=2, staleness=0, max_age_s=0, now=now, current=1)
            assert select(ours, cursor.min_versions, max_versions=cursor.max_versions, **policy) == select(
                reference, full.min_versions, max_versions=full.max_versions, **policy
            )
            return [i.key for i in ours]

        first = step()
        assert len(first) == 41 and cursor.rows_read == 42  # every ready rollout and the one in flight
        trained = first[:16]
        cursor.forget(trained)
        full.forget(trained)
        write_rollouts(store, [f"r-{i}" for i in range(42, 50)], version=1)  # newer policy: the rest turn stale
        store.write([reward("r-40", "task-0"), end("r-41", "task-1")])
        with RolloutStore(path, grace_s=0.0, clock=lambda: 1.0) as behind:  # a receiver whose clock lags
            write_rollouts(behind, ["r-50"])
            behind.refresh_completion()  # completed "before" every other: first in the order
        second = step()
        assert cursor.rows_read == 9 + 1 + 1  # the new rows, the one that ended, the one whose reward came
        assert full.rows_read == 51 + 51  # the reference reads every rollout and every unmarked ready one again
        assert set(second) == {RolloutKey(f"r-{i}") for i in range(51)} - set(trained)
        assert second[0] == RolloutKey("r-50")
        assert cursor.newest == 1
        step()
        assert cursor.rows_read == 0  # nothing changed, nothing read


def test_rollouts_added_between_runs_are_trained_once_across_a_resume(tmp_path: Path) -> None:
    from agl_trainer.cli import main
    from agl_trainer.store import RolloutStore
    from examples.demo.model import build_demo_model
    from agl_testing.rollouts import write_rollouts

    model = build_demo_model(tmp_path / "tiny", seed=0)
    path, run = tmp_path / "t.db", tmp_path / "run"
    with RolloutStore(path) as store:
        write_rollouts(store, [f"r-{i}" for i in range(16)])
    common = ["train", "examples/demo/config.yaml", "--from-store", str(path), f"--model.path={model}",
              f"--output_dir={run}", "--loop.batch_rollouts=4", "--loop.group_size=2", "--loop.checkpoint_every=1",
              "--loop.completion_grace_s=0", "--loop.staleness=-1", "--quiet"]  # fmt: skip
    assert main([*common, "--loop.max_steps=2"]) == 0
    with RolloutStore(path) as store:
        write_rollouts(store, [f"r-{i}" for i in range(16, 24)])
    assert main([*common, "--resume", "--loop.max_steps=100"]) == 0
    ledger = [json.loads(line) for line in (run / "trained.jsonl").read_text().splitlines()]
    trained = [tuple(r) for entry in ledger for r in entry["rollouts"]]
    assert sorted(trained) == sorted((f"r-{i}", 0) for i in range(24))  # each once, the added ones too
    assert [entry["step"] for entry in ledger] == list(range(1, 7))


def test_a_stored_run_counts_policy_versions_from_offline_policy_version(tmp_path: Path) -> None:
    # The one training loop numbers the weights it trains: a stored run's first are model.path's, the
    # version the store gives them (offline.policy_version); each step adds one. Its rows say how long
    # the step read the store, and carry none of a live run's engine times.
    from agl_trainer.cli import main
    from agl_trainer.store import RolloutStore
    from examples.demo.model import build_demo_model
    from agl_testing.rollouts import write_rollouts

    model = build_demo_model(tmp_path / "tiny", seed=0)
    path, run = tmp_path / "t.db", tmp_path / "run"
    with RolloutStore(path) as store:
        write_rollouts(store, [f"r-{i}" for i in range(8)], version=5)
    common = ["train", "examples/demo/config.yaml", "--from-store", str(path), f"--model.path={model}",
              f"--output_dir={run}", "--loop.batch_rollouts=4", "--loop.group_size=2", "--loop.checkpoint_every=1",
              "--offline.policy_version=5", "--loop.max_steps=100", "--quiet"]  # fmt: skip
    assert main(common) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(row["policy_version"], row["staleness/max"]) for row in rows] == [(6.0, 0.0), (7.0, 1.0)]
    assert all("time/reading_s" in row and "engine/idle_fraction" not in row for row in rows)
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert json.loads((run / "checkpoints" / latest / "loop.json").read_text())["policy_version"] == 7
    # --resume goes on from the checkpoint's version, whatever offline.policy_version says now
    with RolloutStore(path) as store:
        write_rollouts(store, [f"r-{i}" for i in range(8, 12)], tasks=2, version=7)
    assert main([*common, "--resume", "--offline.policy_version=0"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(row["policy_version"], row["staleness/max"]) for row in rows][2:] == [(8.0, 0.0)]


# --- a hostile store: one bad rollout never costs the others ----------------------------------------


def test_a_hostile_store_sets_bad_rollouts_aside_and_trains_the_rest(tmp_path: Path, capsys, monkeypatch) -> None:
    # Before: a call with version 2**63-1 made every good rollout stale under max_policy_lag 1, and
    # the drops were written to the store; an out-of-vocabulary token id or a non-finite reward was a
    # traceback at step 1, on every rerun (SQLite keeps no NaN: an infinite one). staleness/* was always 1 (measured against the newest
    # version in the store plus one, not the weights being trained).
    import numpy as np
    from agl_trainer.cli import main
    from agl_trainer.store import RolloutStore
    from examples.demo.model import build_demo_model
    from agl_testing.rollouts import call, end, reward, write_rollouts

    model = build_demo_model(tmp_path / "tiny", seed=0)
    path, run = tmp_path / "t.db", tmp_path / "run"
    with RolloutStore(path) as store:
        future = call("future", "task-0", version=2**63 - 1)
        oov = call("oov", "task-1")
        oov.completion_ids = np.array([9, 10**9, 11], np.int64)
        store.write_batches([
            [future, reward("future", "task-0"), end("future", "task-0")],
            [oov, reward("oov", "task-1"), end("oov", "task-1")],
            [call("inf", "task-1"), reward("inf", "task-1", float("inf")), end("inf", "task-1")],
        ])  # fmt: skip
        write_rollouts(store, [f"r-{i}" for i in range(8)], tasks=2)  # version 0: model.path's weights
    common = ["train", "examples/demo/config.yaml", "--from-store", str(path), f"--model.path={model}",
              f"--output_dir={run}", "--loop.batch_rollouts=8", "--loop.group_size=2", "--loop.checkpoint_every=1",
              "--loop.completion_grace_s=0", "--loop.staleness=1", "--offline.min_group_size=1",
              "--loop.max_steps=100"]  # fmt: skip
    assert main(common) == 0
    out = capsys.readouterr().out
    assert "1 rollouts skipped" in out and "offline.policy_version" in out
    ledger = [json.loads(line) for line in (run / "trained.jsonl").read_text().splitlines()]
    trained = sorted(tuple(r) for entry in ledger for r in entry["rollouts"])
    # step 1 draws the bad two beside six good ones and trains the six (lag 0); step 2 the last two (lag 1)
    assert trained == sorted((f"r-{i}", 0) for i in range(8))
    with RolloutStore(path) as store:
        reasons = {i.rollout_id: i.dropped_reason for i in store.rollouts()}
    assert reasons["oov"] == "token_out_of_vocab" and reasons["inf"] == "invalid_reward"
    assert reasons["future"] is None  # skipped, not recorded: a later run with a later policy may take it
    assert all(reasons[f"r-{i}"] is None for i in range(8))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lag = [(row["staleness/max"], row["policy_version"]) for row in rows if "staleness/max" in row]
    assert lag[:2] == [(0.0, 1.0), (1.0, 2.0)]  # measured against the weights trained, not the store's newest
    # agl traces ls shows why
    monkeypatch.setenv("COLUMNS", "250")  # a wide table: no reason folded over two lines
    assert main(["traces", "ls", "--store", str(path), "--all"]) == 0
    listing = capsys.readouterr().out
    assert "token_out_of_vocab" in listing and "invalid_reward" in listing
    # a rerun over the same store: no traceback, nothing left to train
    assert main([*(a.replace(str(run), str(tmp_path / "again")) for a in common)]) == 0


def test_a_draw_the_model_can_take_nothing_of_is_no_step(tmp_path: Path) -> None:
    # The stored source admits nothing of a draw whose rollouts are all set aside: the loop draws
    # again without a step (no version, no checkpoint spent on it), and the next draw trains as step 1.
    from agl_trainer.cli import main
    from agl_trainer.store import RolloutStore
    from examples.demo.model import build_demo_model
    from agl_testing.rollouts import call, end, reward, write_rollouts

    model = build_demo_model(tmp_path / "tiny", seed=0)
    path, run = tmp_path / "t.db", tmp_path / "run"
    with RolloutStore(path) as store:
        store.write_batches([[call(rid, "bad"), reward(rid, "bad", float("inf")), end(rid, "bad")]
                             for rid in ("inf-0", "inf-1")])  # fmt: skip
        write_rollouts(store, ["r-0", "r-1"], tasks=1)  # completed after them: drawn second
    assert main(["train", "examples/demo/config.yaml", "--from-store", str(path), f"--model.path={model}",
                 f"--output_dir={run}", "--loop.batch_rollouts=2", "--loop.group_size=2", "--loop.checkpoint_every=1",
                 "--loop.max_steps=100", "--quiet"]) == 0  # fmt: skip
    ledger = [json.loads(line) for line in (run / "trained.jsonl").read_text().splitlines()]
    assert ledger == [{"step": 1, "rollouts": [["r-0", 0], ["r-1", 0]]}]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["policy_version"], row["rollouts/trained"]) for row in rows] == [(1, 1.0, 2.0)]
    with RolloutStore(path) as store:
        reasons = {i.rollout_id: i.dropped_reason for i in store.rollouts()}
    assert reasons == {"inf-0": "invalid_reward", "inf-1": "invalid_reward", "r-0": None, "r-1": None}


def test_set_aside_reasons_for_what_the_model_cannot_take() -> None:
    from agl_trainer.batch import RolloutResult, Sample
    from agl_trainer.loop.stored_checks import INVALID_REWARD, OUT_OF_VOCAB, VERSION_AHEAD, split

    def result(rid: str, reward: float = 1.0, ids: list[int] | None = None, versions: list[int] | None = None):
        ids = ids or [1, 2, 3]
        sample = Sample(rollout_id=rid, task_id="t", token_ids=ids, loss_mask=[0, 1, 1], engine_logprobs=[0.0] * 3,
                        policy_versions=versions or [-1, 2, 2], call_seqs=[0])  # fmt: skip
        return RolloutResult(rollout_id=rid, task_id="t", reward=reward, samples=[sample])

    good, bad = split([result("ok"), result("inf", float("-inf")), result("oov", ids=[1, 2, 99]),
                       result("neg", ids=[-1, 2, 3]), result("ahead", versions=[-1, 2, 3])], vocab_size=99, current=2)  # fmt: skip
    assert [r.rollout_id for r in good] == ["ok"]
    assert {k: [key.rollout_id for key in v] for k, v in bad.items()} == {
        INVALID_REWARD: ["inf"], OUT_OF_VOCAB: ["oov", "neg"], VERSION_AHEAD: ["ahead"]}


def test_skip_flat_groups_sets_a_stored_group_with_one_reward_aside_and_trains_the_next(tmp_path: Path) -> None:
    # Drawn first (completed together, then by id): task "flat" (both rollouts reward 1) would fill the batch
    # of 2 and train nothing; with loop.skip_flat_groups it is recorded as dropped and task "mixed" (rewards
    # 0 and 1) takes its place in step 1.
    from agl_trainer.cli import main
    from agl_trainer.loop.groups import FLAT_GROUP
    from agl_trainer.store import RolloutStore
    from examples.demo.model import build_demo_model
    from agl_testing.rollouts import call, end, reward

    model = build_demo_model(tmp_path / "tiny", seed=0)
    path, run = tmp_path / "t.db", tmp_path / "run"
    rewards = {"flat-0": ("flat", 1.0), "flat-1": ("flat", 1.0), "mixed-0": ("mixed", 0.0), "mixed-1": ("mixed", 1.0)}
    with RolloutStore(path) as store:
        store.write_batches([[call(rid, task), reward(rid, task, value), end(rid, task)]
                             for rid, (task, value) in rewards.items()])  # fmt: skip
    assert main(["train", "examples/demo/config.yaml", "--from-store", str(path), f"--model.path={model}",
                 f"--output_dir={run}", "--loop.batch_rollouts=2", "--loop.group_size=2", "--loop.checkpoint_every=1",
                 "--loop.skip_flat_groups=true", "--loop.max_steps=100", "--quiet"]) == 0  # fmt: skip
    ledger = [json.loads(line) for line in (run / "trained.jsonl").read_text().splitlines()]
    assert ledger == [{"step": 1, "rollouts": [["mixed-0", 0], ["mixed-1", 0]]}]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(row["rollouts/trained"], row["rollouts/set_aside_flat"]) for row in rows] == [(2.0, 2.0)]
    with RolloutStore(path) as store:
        reasons = {i.rollout_id: i.dropped_reason for i in store.rollouts()}
    assert reasons == {"flat-0": FLAT_GROUP, "flat-1": FLAT_GROUP, "mixed-0": None, "mixed-1": None}
