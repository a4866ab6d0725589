"""bench/simulate.py: the event simulation of an RL run (bench/_simulation.py). What could be wrong:
rollouts lost or trained twice, the staleness bound not held, the engine or the loop's timing
(sync with free generation must take exactly its analytic step time), nondeterminism, and the
ordering of the modes on a long-tailed workload. Every number asserted comes from the simulation
(no wall clock)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from bench.simulate import (
    MEASURED,
    MODES,
    Call,
    Cluster,
    EngineModel,
    LoopSpec,
    Scenario,
    Scripted,
    Simulation,
    TrainerModel,
    calibrate,
    const,
    load_traces,
    main,
    run_modes,
    simulate,
    swe,
    this_machine,
)


def small(**loop: object) -> Scenario:
    """this machine's 60 ms scenario, fewer steps (a second of simulation at most)."""
    sc = this_machine(60)
    return replace(sc, loop=replace(sc.loop, steps=6, **loop))


def ran(sc: Scenario, mode: str, seed: int = 0) -> Simulation:
    sim = Simulation(sc, mode, seed)  # type: ignore[arg-type]
    sim.run()
    return sim


@pytest.mark.parametrize("mode", MODES)
def test_every_rollout_started_is_trained_once_or_still_in_flight(mode: str) -> None:
    sim = ran(small(), mode)
    result = sim.result()
    trained = [r.index for r in sim.trained]
    assert len(trained) == len(set(trained))  # none trained twice
    assert result.launched == result.trained_total + result.dropped + result.in_flight
    assert result.dropped == 0
    for r in sim.trained:
        assert r.seen and r.harness_done and r.call is None  # complete before it was trained
        assert all(m.trained_step == r.trained_step for m in r.group.members)  # groups train whole
    assert result.trained_total >= sim.sc.loop.batch_rollouts * sim.sc.loop.steps


def test_a_dropped_group_is_neither_trained_nor_in_flight() -> None:
    sc = small(staleness=1, overdue="drop")
    sim = ran(sc, "partial")
    result = sim.result()
    assert result.dropped > 0 and result.wasted_tokens > 0
    assert result.launched == result.trained_total + result.dropped + result.in_flight
    assert all(r.alive for r in sim.trained)


@pytest.mark.parametrize("staleness", [0, 1, 2])
@pytest.mark.parametrize("overdue", ["wait", "drop", "mask"])
def test_partial_never_trains_a_token_older_than_the_staleness_bound(staleness: int, overdue: str) -> None:
    sc = small(staleness=staleness, overdue=overdue)
    for seed in range(3):
        sim = ran(sc, "partial", seed)
        assert sim.trained
        assert max(sim.staleness_of[r.index] for r in sim.trained) <= staleness
        assert sim.result().staleness_max <= staleness


def test_masking_never_waits_for_a_group_and_trains_no_token_past_the_bound() -> None:
    sc = small(staleness=1, overdue="mask", max_span=100)
    sim = ran(sc, "partial")
    result = sim.result()
    assert result.dropped == 0 and result.masked_fraction > 0
    assert result.launched == result.trained_total + result.in_flight
    oldest_allowed = {r.index: r.trained_step - 1 for r in sim.trained}  # version == step here
    assert any(v < oldest_allowed[r.index] for r in sim.trained for v, _ in r.generated)  # some were masked
    assert result.staleness_max <= 1


def test_masking_drops_a_group_at_the_update_it_would_run_across_max_span_updates() -> None:
    result = ran(small(staleness=1, overdue="mask", max_span=2), "partial").result()
    assert result.dropped > 0
    assert result.launched == result.trained_total + result.in_flight + result.dropped
    assert result.span_max <= 1  # a trained rollout ran across at most max_span - 1 updates


def test_partial_trains_rollouts_that_span_several_versions() -> None:
    result = simulate(small(), "partial")
    assert result.span_max >= 1  # rollouts continued across weight switches
    assert result.staleness_mean > 0


def test_sync_with_free_generation_and_no_tool_time_takes_the_analytic_step_time() -> None:
    calls = ((const(10), const(50)), const(0.0), (const(10), const(7)))
    engine = EngineModel(0.0, 0.0, 0.0, math.inf, 256, math.inf, call_overhead_s=0.03)
    trainer = TrainerModel(fixed_s=0.5, per_rollout_s=0.01, gpu_s_per_token=0.001, sync_s=0.2, switch_s=0.7)
    loop = LoopSpec(
        batch_rollouts=16, group_size=4, concurrency=16, staleness=1, steps=5, start_s=0.4, finish_s=1.1
    )
    sc = Scenario("analytic", Scripted("free", calls), Cluster(4, "collocated", engine, trainer), loop)
    tokens = 16 * (10 + 50 + 10 + 7)
    step = 0.4 + 2 * 0.03 + 1.1 + (0.5 + 16 * 0.01 + 0.001 * tokens / 4) + 0.2 + 0.7
    result = simulate(sc, "sync")
    assert result.seconds == pytest.approx(5 * step)
    assert result.step_s == pytest.approx([step] * 5)
    assert result.trained == 80 and result.staleness_max == 0
    assert result.gpu["generating"] == 0.0
    assert result.gpu["idle"] == pytest.approx((0.4 + 0.06 + 1.1) / step)


def test_a_call_takes_its_tokens_in_steps() -> None:
    """One rollout, one call of 10 tokens at 50 ms a step: 0.5 s of generation."""
    engine = EngineModel(0.05, 0.0, 0.0, math.inf, 256, math.inf, call_overhead_s=0.0)
    trainer = TrainerModel(0.0, 0.0, 0.0, 0.0)
    loop = LoopSpec(batch_rollouts=1, group_size=1, concurrency=1, staleness=1, steps=1)
    sc = Scenario(
        "one", Scripted("one", ((const(0), const(10)),)), Cluster(1, "collocated", engine, trainer), loop
    )
    result = simulate(sc, "sync")
    assert result.seconds == pytest.approx(0.5)
    assert result.gpu["generating"] == pytest.approx(1.0)


def test_the_same_seed_gives_the_same_run_and_another_seed_another() -> None:
    sc = small()
    for mode in MODES:
        assert asdict(simulate(sc, mode, 3)) == asdict(simulate(sc, mode, 3))
    assert asdict(simulate(sc, "keep", 3)) != asdict(simulate(sc, "keep", 4))


def test_on_a_long_tailed_workload_partial_keep_drain_sync_in_that_order() -> None:
    """The thinking harness (a few calls of 40 or 90 tokens among 4-token ones) at 60 ms a step."""
    rows = run_modes(this_machine(60), MODES, seeds=4)
    throughput = [rows[mode]["throughput"] for mode in ("sync", "drain", "keep", "partial")]
    assert throughput == sorted(throughput)
    assert rows["drain"]["draining_s"] > 0 and rows["keep"]["draining_s"] == 0
    assert rows["sync"]["staleness_max"] == 0


def test_split_gpus_partial_generates_while_the_trainer_trains() -> None:
    sc = swe(8, "split")
    sc = replace(sc, loop=replace(sc.loop, steps=5, warmup_steps=1))
    keep, partial = simulate(sc, "keep"), simulate(sc, "partial")
    assert partial.throughput > keep.throughput
    assert partial.gpu["generating"] > keep.gpu["generating"]


def test_the_calibration_reproduces_the_measured_ratios_within_15_percent() -> None:
    cal = calibrate(seeds=6)
    assert [row["comparison"] for row in cal["comparisons"]] == [m.name for m in MEASURED]
    assert sum(row["fitted"] for row in cal["comparisons"]) >= 7  # the misfits are the exception, and named
    for row in cal["comparisons"]:
        assert row["off"] <= 0.15 or not row["fitted"], row


def test_rollouts_replayed_from_a_store(tmp_path: Path) -> None:
    from agl_trainer.store import RolloutStore
    from agl_trainer.store.records import CallSpan, RolloutSpan

    t0 = 1_700_000_000_000_000_000
    records: list = []
    for k, gap_ns in enumerate((2_000_000_000, 500_000_000)):
        rid, length, start = f"r{k}", 0, t0
        for seq, (new, out) in enumerate(((40, 5), (8, 3))):
            records.append(CallSpan(
                span_id=os.urandom(8), call_seq=seq, name="chat", end_ns=start + 100_000_000,
                prompt_ids=np.arange(new, dtype=np.int32), completion_ids=np.arange(out, dtype=np.int32),
                logprobs=np.zeros(out, np.float32), prompt_ref_seq=None if seq == 0 else seq - 1,
                prompt_ref_length=None if seq == 0 else length, prompt_length=None, policy_version=0,
                finish_reason="stop", end_reason="completed", tokens_source="engine",
                trace_id=bytes([k + 1]) * 16, rollout_id=rid, attempt=0, task_id="t", mode="train",
                start_ns=start, status_code=0,
            ))  # fmt: skip
            length += new + out
            start += 100_000_000 + gap_ns
        records.append(RolloutSpan(
            trace_id=bytes([k + 1]) * 16, span_id=os.urandom(8), rollout_id=rid, attempt=0, task_id="t",
            mode="train", status="succeeded", start_ns=t0, end_ns=start, error=None,
        ))  # fmt: skip
    path = tmp_path / "rollouts.db"
    with RolloutStore(path, durability="normal", grace_s=0.0) as store:
        store.write_batches([records])
        store.refresh_completion()
    recorded = load_traces(path)
    by_gap = sorted(recorded.rollouts, key=lambda r: r[2])
    # r1: no gap before its first call, 0.5 s between the calls, then 0.5 s to the rollout's end
    assert by_gap[0] == pytest.approx((0.0, Call(40, 5), 0.5, Call(8, 3), 0.5))
    assert by_gap[1] == pytest.approx((0.0, Call(40, 5), 2.0, Call(8, 3), 2.0))
    sc = replace(small(), workload=recorded)
    assert simulate(sc, "keep").trained > 0


def test_the_command_line_prints_a_ratio_a_line_and_writes_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.json"
    assert main(["--scenario", "this-machine", "--steps", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("drain vs sync: ", "keep vs drain: ", "partial vs drain: ", "partial vs sync: "):
        assert line in printed
    results = json.loads(out.read_text())
    (scenario,) = results.values()
    assert set(scenario["modes"]) == set(MODES)
    assert scenario["modes"]["partial"]["vs_drain"] > 0
