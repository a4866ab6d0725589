"""Steps that never wait for a running group (loop.stale_policy=mask) and generation that goes on while
the trainer trains (loop.generate_during_training), end to end: runner workers -> agl-sidecar
(subprocess) -> embedded engine; spans -> receiver -> store -> assembly -> torch backend."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from agl_trainer.assembly.versions import token_versions
from tests.loop.harnesses import reward_of
from tests.loop.test_loop import make_config, model_dir, run_session, store_of  # noqa: F401 (fixture)


def across_steps_run(tmp_path: Path, model_dir: Path, *, gate: bool, max_steps: int, max_span: int) -> tuple:  # noqa: F811
    """4 tasks for tests.loop.harnesses:across_steps (its first group waits for release/r1 and r2), groups
    of 4, a step a group, staleness 1 per token (stale_policy=mask); returns (the release folder, config)."""
    release = tmp_path / "release"
    release.mkdir()
    tasks = [{"id": f"t{i}", "release": str(release), "gate": gate} for i in range(4)]
    config = make_config(
        tmp_path, model_dir, tasks, "tests.loop.harnesses:across_steps",
        mode="collocated-async", batch_rollouts=4, group_size=4, staleness=1, concurrency=8,
        max_steps=max_steps, stale_policy="mask", max_span=max_span,
    )  # fmt: skip
    return release, config


def test_a_group_runs_across_updates_and_trains_later_with_stale_tokens_masked(
    tmp_path: Path,
    model_dir: Path,  # noqa: F811
) -> None:
    # The first group makes a call under versions 0, 1 and 2 (it waits for files the steps write), so it
    # completes only after step 2: with stale_policy=wait, step 2 (which must train it at staleness 1)
    # would wait for it; with mask, steps 1 and 2 train the other groups and it trains at step 3 or later,
    # its tokens older than the bound left out of the loss.
    release, config = across_steps_run(tmp_path, model_dir, gate=True, max_steps=4, max_span=8)
    steps: dict[int, dict[str, float]] = {}

    def on_step(step: int, metrics: dict[str, float]) -> None:
        steps[step] = metrics
        if step <= 2:
            (release / f"r{step}").touch()  # the first group's next call runs under version `step`

    result = run_session(config, on_step)
    assert result.summary.steps == 4 and result.summary.failures == {}
    with store_of(config) as store:
        infos = [i for i in store.find("") if i.mode == "train"]
        loaded = {i.rollout_id: store.load(i.key) for i in infos}
    trained = {i.rollout_id: i.trained_step for i in infos if i.trained_step is not None}
    first_group = sorted(rid for rid in loaded if "-g000000-" in rid)
    assert len(first_group) == 4 and set(first_group) <= set(trained)  # it trained, and was not lost
    for rid in first_group:  # its calls were served by three policy versions, in order
        versions = [call.policy_version for call in loaded[rid].calls]
        assert versions[0] == 0 and versions[-1] >= 2 and versions == sorted(versions), versions
    # trained after the steps it ran across (the groups launched after step 2 wait for it to end)
    assert {trained[rid] for rid in first_group} <= {3, 4}
    # No rollout trained twice: each step's count is what the store says that step trained.
    for step, metrics in steps.items():
        at_step = [rid for rid, s in trained.items() if s == step]
        assert metrics["rollouts/trained"] == len(at_step)
        # rewards land on the rollout that earned them (each harness returns its id's reward)
        assert metrics["reward/mean"] == pytest.approx(statistics.fmean(reward_of(rid) for rid in at_step))
        # per token: what the step masked is exactly its rollouts' tokens older than the bound
        # (step s trains at version s - 1; the bound is loop.staleness = 1)
        oldest_allowed = step - 1 - 1
        stale = sum(
            int(np.sum(token_versions(call) < oldest_allowed))
            for rid in at_step
            for call in loaded[rid].calls
            if call.completion_ids is not None
        )
        assert metrics["staleness/masked_tokens"] == stale
        assert metrics["staleness/max"] <= 1  # no trained token is older than the bound
    first_step = trained[first_group[0]]
    assert steps[first_step]["staleness/masked_tokens"] > 0  # the version-0 tokens (lag >= 2) left out


def test_a_group_still_running_at_its_max_span_th_update_is_dropped_there(
    tmp_path: Path,
    model_dir: Path,  # noqa: F811
) -> None:
    # The first group never gets its release file r1: with max_span=2 it is dropped at its second
    # update, its harnesses killed and the store told why.
    _, config = across_steps_run(tmp_path, model_dir, gate=False, max_steps=3, max_span=2)
    steps: dict[int, dict[str, float]] = {}
    result = run_session(config, lambda step, metrics: steps.__setitem__(step, metrics))
    assert result.summary.steps == 3
    with store_of(config) as store:
        first_group = [i for i in store.find("") if "-g000000-" in i.rollout_id]
    assert len(first_group) == 4
    assert {i.dropped_reason for i in first_group} == {"over loop.max_span=2"}
    assert all(i.trained_step is None for i in first_group)
    # dropped at the update from version 1 (its second), not before: step 2 counts them
    assert [steps[s]["rollouts/dropped_stale"] for s in (1, 2, 3)] == [0.0, 4.0, 0.0]


@pytest.mark.parametrize("during", [True, False])
def test_generation_goes_on_while_the_trainer_trains_only_when_asked(
    tmp_path: Path,
    model_dir: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    during: bool,
) -> None:
    # The engine's decode steps are counted; each training step waits (a bounded time) for one to happen
    # while it trains. With generate_during_training the rollouts in flight and new launches keep the
    # engine stepping; without it the keep switch has frozen the engine for the whole update.
    from agl_trainer.backends.torch_backend import TorchBackend
    from agl_trainer.engines.embedded.batching import BatchScheduler

    decode_steps = [0]
    step = BatchScheduler._step

    def counted(self, admitted):  # type: ignore[no-untyped-def]
        step(self, admitted)
        decode_steps[0] += 1

    seen: list[bool] = []
    train_step = TorchBackend.train_step
    lock = threading.Lock()

    def waiting_train_step(self, batch, policy_version):  # type: ignore[no-untyped-def]
        with lock:
            before = decode_steps[0]
            deadline = time.monotonic() + (60.0 if during else 1.0)
            while decode_steps[0] == before and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append(decode_steps[0] > before)
        return train_step(self, batch, policy_version)

    monkeypatch.setattr(BatchScheduler, "_step", counted)
    monkeypatch.setattr(TorchBackend, "train_step", waiting_train_step)
    tasks = [{"id": f"t{i}", "key": f"k{i % 4}", "calls": 3, "tool_s": 0.05} for i in range(8)]
    config = make_config(
        tmp_path, model_dir, tasks, "tests.loop.harnesses:calls",
        mode="collocated-async", batch_rollouts=4, group_size=4, staleness=3, concurrency=8, max_steps=3,
        switch="keep", stale_policy="mask", generate_during_training=during,
    )  # fmt: skip
    steps: list[dict[str, float]] = []
    result = run_session(config, lambda _, metrics: steps.append(metrics))
    assert result.summary.steps == 3 and result.summary.failures == {}
    counts = [{k: v for k, v in m.items() if k.startswith(("rollouts/", "assembly/"))} for m in steps]
    assert seen == [during] * 3, counts
    assert all((m["time/generating_during_training_s"] > 0) == during for m in steps)
    assert all(m["staleness/max"] <= 3 for m in steps if "staleness/max" in m)
    with store_of(config) as store:
        assert store.stats().violations == {}  # calls across the weight loads meet the span contract


def test_generate_during_training_needs_the_keep_switch(tmp_path: Path, model_dir: Path) -> None:  # noqa: F811
    from agl_trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"loop.generate_during_training: .* \(fix: loop.switch=keep"):
        make_config(
            tmp_path, model_dir, [{"id": "t"}], "tests.loop.harnesses:calls",
            mode="collocated-async", generate_during_training=True,
        )  # fmt: skip
