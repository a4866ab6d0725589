"""bench/normalization.py on the hops example: how it turns rollouts into training input for each
aggregation, its confidence intervals, and a smoke run of `--quick`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bench.normalization import MODES, comparisons, Curves, paired_interval, results_for


@dataclass
class Played:
    """What results_for reads of a played rollout (examples/hops/play.Rollout)."""

    task: dict
    reward: float
    rows: list[tuple[list[int], list[int]]]

    def samples(self) -> list[tuple[list[int], list[int]]]:
        return self.rows


def rows(n: int) -> list[tuple[list[int], list[int]]]:
    return [([5, 6, 7 + k, 8], [0, 0, 1, 1]) for k in range(n)]


def test_sample_level_weighs_a_rollout_by_its_samples_rollout_level_does_not() -> None:
    from agl_trainer.algorithms import AlgorithmConfig
    from agl_trainer.backends.step_plan import algorithm_batch, mini_batches, plan_step
    from agl_trainer.batch import TrainingBatch

    task = {"id": "t"}
    many, one = (
        Played(task, 0.0, rows(12)),
        Played(task, 1.0, rows(1)),
    )  # a failing rollout retried and compacted
    results = results_for([many, one], 0)
    assert [(r.rollout_id, r.reward, len(r.samples)) for r in results] == [("r0", 0.0, 12), ("r1", 1.0, 1)]
    share, advantage = {}, {}
    for mode, (agg, unit) in MODES.items():
        algo = AlgorithmConfig(loss_agg_mode=agg, advantage_unit=unit, importance_scope="off")
        batch = algorithm_batch(TrainingBatch.from_rollouts(results, pad_token_id=2), algo)
        plan = plan_step(batch, algo, vocab_size=64)
        (mini,) = mini_batches(batch, plan, algo, 1)
        share[mode] = float(mini.weights[:12].sum() / mini.weights.sum())  # rows 0-11: the failing rollout
        advantage[mode] = (float(plan.token_advantages[0, 2]), float(plan.token_advantages[12, 2]))
    assert share["rollout"] == pytest.approx(0.5)  # every rollout weighs the same
    assert share["sample"] == pytest.approx(12 / 13)  # 12 of the 13 rows
    assert share["token"] == pytest.approx(12 / 13)  # 12 of the 13 rows' tokens (2 each)
    # GRPO over 2 rollouts (rewards 0, 1): -+0.707; over 13 rows (12 zeros, a one): the baseline is 1/13
    std = math.sqrt(1 / 13)  # unbiased std of twelve 0s and one 1: (12/169 + 144/169) / 12 = 1/13
    assert advantage["rollout"] == pytest.approx((-1 / math.sqrt(2), 1 / math.sqrt(2)), abs=1e-5)
    assert advantage["sample"] == pytest.approx(((0 - 1 / 13) / std, (1 - 1 / 13) / std), rel=1e-4)


def test_paired_interval_is_a_t_interval_over_seeds() -> None:
    mean, low, high = paired_interval([0.1, 0.2, 0.3])
    half = 4.303 * 0.1 / math.sqrt(3)  # t(0.975, 2 degrees of freedom) * sd / sqrt(n)
    assert (mean, low, high) == pytest.approx((0.2, 0.2 - half, 0.2 + half))
    mean, low, high = paired_interval([0.05])
    assert mean == 0.05 and math.isnan(low) and math.isnan(high)


def test_comparisons_pair_each_mode_with_rollout_on_the_same_seed() -> None:
    def curves(mode: str, seed: int, final: float, drift: float) -> Curves:
        return Curves(mode, seed, entropy=[1.0] * 3 + [1.0 + drift] * 3, val=[(0, 0.1), (10, final)],
                      val_sampled=[(0, 0.1), (10, final / 2)])  # fmt: skip

    runs = [curves("rollout", 0, 0.5, -0.2), curves("rollout", 1, 0.7, -0.4), curves("sample", 1, 0.6, 0.0),
            curves("sample", 0, 0.5, 0.0)]  # fmt: skip
    rows = {(row["mode"], row["metric"]): row for row in comparisons(runs)}
    greedy = rows[("sample", "val_greedy")]
    # finals are the mean of the last two rounds: seed 0 (0.3 vs 0.3), seed 1 (0.35 vs 0.4)
    assert greedy["difference"] == pytest.approx(-0.025) and greedy["seeds"] == 2
    assert greedy["rollout"] == pytest.approx(0.35) and greedy["low"] < -0.025 < greedy["high"]
    assert rows[("sample", "entropy_drift")]["difference"] == pytest.approx(0.3)
    assert ("token", "val_greedy") not in rows


@pytest.mark.slow
def test_quick_bench_prints_the_comparisons_and_writes_the_curves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.normalization import main

    assert main(["--quick", "--steps", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for mode in MODES:
        assert f"\n{mode:8} {MODES[mode][0]}" in out
    for mode in ("sample", "token"):
        for metric in ("val_greedy", "val_sampled", "entropy_drift"):
            assert f"\n{mode} - rollout, {metric}: " in out
    data = json.loads((tmp_path / "normalization.json").read_text())
    assert [row["mode"] for row in data["table"]] == list(MODES)
    assert all(
        len(run["entropy"]) == 2 and run["val"][0][0] == 0 and run["val_sampled"][0][0] == 0
        for run in data["runs"]
    )
    assert all(1 <= s <= 16 for run in data["runs"] for s in run["samples"])
    assert (tmp_path / "normalization.png").read_bytes()[:4] == b"\x89PNG"
