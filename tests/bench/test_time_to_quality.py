"""bench/time_to_quality.py's measurements from a run's rows, against values computed by hand."""

from __future__ import annotations

import pytest

from bench.time_to_quality import CONFIG, combine, measure, overrides, table


def rows() -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    history = [
        {"time/step_s": 2.0, "rollouts/trained": 8, "perf/trained_tokens": 100, "tokens/trained": 100,
         "staleness/mean": 0.0, "time/canary_s": 0.02},
        {"time/step_s": 3.0, "rollouts/trained": 8, "perf/trained_tokens": 80, "tokens/trained": 80,
         "staleness/masked_tokens": 20, "importance/ratio_masked_tokens": 5, "staleness/mean": 1.0},
        {"time/step_s": 5.0, "rollouts/trained": 4, "perf/trained_tokens": 60, "tokens/trained": 60,
         "rollouts/dropped_stale": 4, "staleness/mean": 0.5, "importance/capped_frac": 0.3,
         "agreement/canary/background_s": 0.5},
    ]  # fmt: skip
    validation = [{"step": 0.0, "val/reward": 0.1}, {"step": 2.0, "val/reward": 0.3}, {"step": 3.0, "val/reward": 0.6}]
    return history, validation


def test_time_to_target_is_the_wall_at_the_first_round_at_or_above_it() -> None:
    history, validation = rows()
    m = measure(history, validation, target=0.3)
    assert m["curve"] == [(0.0, 0.1), (5.0, 0.3), (10.0, 0.6)]  # rounds after 0, 2 and 3 steps
    assert m["time_to_target_s"] == 5.0 and m["final"] == 0.6 and m["start"] == 0.1 and m["steps"] == 3
    assert measure(history, validation, target=0.7)["time_to_target_s"] is None


def test_throughput_counts_only_tokens_that_entered_the_loss() -> None:
    m = measure(*rows(), target=0.5)
    assert m["rollouts_per_s"] == pytest.approx(20 / 10)
    assert m["loss_tokens_per_s"] == pytest.approx((240 - 5) / 10)  # less the ratio-masked ones
    assert m["masked_share"] == pytest.approx(20 / (20 + 240)) and m["dropped_rollouts"] == 4
    assert m["staleness_mean"] == pytest.approx(0.5) and m["capped_frac"] == pytest.approx(0.1)
    assert m["canary_share"] == pytest.approx(0.02 / 10)  # on the step's path
    assert m["canary_background_share"] == pytest.approx(0.5 / 10)  # beside generation, after a keep switch


def test_the_table_prints_ratios_against_sync() -> None:
    history, validation = rows()
    sync = measure(history, validation, target=0.3)
    fast = measure([{**row, "time/step_s": row["time/step_s"] / 2} for row in history], validation, target=0.3)
    text = table(0, {"sync": sync, "partial": fast}, 0.3)
    partial = next(line for line in text.splitlines() if line.startswith("partial"))
    assert "0.50x" in partial and "2.00x" in partial  # half the wall to the target, twice the rates
    assert partial.split()[-2:] == ["0.40%", "10.00%"]  # the canary on the step's path and beside it, of 5 s
    assert "not reached" in table(0, {"sync": measure(history, validation, target=0.9)}, 0.9)


def test_repeats_report_the_median_time_with_never_reached_ranked_last() -> None:
    history, validation = rows()
    halved = [{**row, "time/step_s": row["time/step_s"] / 2} for row in history]
    fast = measure(halved, validation, target=0.3)
    slow = measure(history, validation, target=0.3)  # reached at 5.0 s
    never = measure(history, validation, target=0.9)
    assert combine([never, fast, slow])["time_to_target_s"] == 5.0  # 2.5, 5.0, never: the middle is 5.0
    assert combine([never, never, fast])["time_to_target_s"] is None  # two of three never reached it
    assert combine([fast, slow])["time_to_target_s"] == pytest.approx(3.75)  # mean of the two middle
    assert combine([fast, never])["time_to_target_s"] is None
    both = combine([fast, slow])
    assert both["rollouts_per_s"] == pytest.approx((4.0 + 2.0) / 2) and both["wall_s"] == pytest.approx(7.5)
    assert both["runs"] == [fast, slow] and both["final"] == 0.6
    text = table(0, {"sync": combine([slow, never, fast])}, 0.3)
    each_run = "  sync runs: to target s [5.0, not reached, 2.5]; final [0.600, 0.600, 0.600]"
    assert each_run in text.splitlines()


def test_each_repeat_trains_in_its_own_folder(tmp_path) -> None:
    import argparse
    from types import SimpleNamespace

    prepared = SimpleNamespace(tasks="t.jsonl", val_tasks="v.jsonl", path="m")
    args = argparse.Namespace(device_step_ms=60.0, budget_s=30.0, val_every=5)
    folders = {
        option
        for repeat in range(3)
        for option in overrides("sync", prepared, 1, tmp_path, args, repeat)
        if option.startswith("--output_dir=")
    }
    names = ("sync", "sync-r1", "sync-r2")
    assert folders == {f"--output_dir={tmp_path / 'seed-1' / name}" for name in names}


@pytest.mark.parametrize(
    ("arm", "staleness", "scope", "concurrency"),
    [
        ("partial", 2, "stale", 64),
        ("mask-only", 2, "off", 64),
        ("tis-only", 8, "stale", 64),
        ("partial-wide", 2, "stale", 128),
    ],
)
def test_the_ablation_arms_differ_from_partial_only_in_their_knob(
    tmp_path, arm: str, staleness: int, scope: str, concurrency: int
) -> None:
    """Masking vs correcting: each arm's overrides, through the hops config as a run loads them."""
    import argparse
    from types import SimpleNamespace

    from agl_trainer.config import load_config

    for split in ("train", "val"):
        (tmp_path / f"{split}.jsonl").write_text(f'{{"id": "{split}-0"}}\n')
    prepared = SimpleNamespace(tasks=tmp_path / "train.jsonl", val_tasks=tmp_path / "val.jsonl", path=tmp_path)
    args = argparse.Namespace(device_step_ms=60.0, budget_s=30.0, val_every=5)
    config = load_config(CONFIG, overrides(arm, prepared, 0, tmp_path, args))
    assert (config.loop.mode, config.loop.switch, config.loop.stale_policy) == ("collocated-async", "keep", "mask")
    assert config.loop.generate_during_training and config.loop.staleness == staleness
    assert config.backend.algorithm.importance_scope == scope and config.loop.concurrency == concurrency


@pytest.mark.parametrize("base", ["drain", "partial"])
@pytest.mark.parametrize(
    ("loop", "mode", "switch", "policy", "during"),
    [
        ("sync", "sync", "drain", "wait", False),
        ("drain", "collocated-async", "drain", "wait", False),
        ("keep", "collocated-async", "keep", "wait", False),
        ("partial", "collocated-async", "keep", "mask", True),
    ],
)
def test_each_loop_is_itself_whatever_loop_the_config_trains(
    tmp_path, base: str, loop: str, mode: str, switch: str, policy: str, during: bool
) -> None:
    """A loop's overrides name every knob that tells the loops apart, so the bench compares the same four
    loops on a hops config that trains drain (before) or partial (now): no loop inherits the mask."""
    import argparse
    from types import SimpleNamespace

    import yaml

    from agl_trainer.config import load_config

    for split in ("train", "val"):
        (tmp_path / f"{split}.jsonl").write_text(f'{{"id": "{split}-0"}}\n')
    raw = yaml.safe_load(CONFIG.read_text())
    raw["loop"].update(
        {"switch": "drain", "stale_policy": "wait", "generate_during_training": False}
        if base == "drain"
        else {"switch": "keep", "stale_policy": "mask", "generate_during_training": True}
    )
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    prepared = SimpleNamespace(tasks=tmp_path / "train.jsonl", val_tasks=tmp_path / "val.jsonl", path=tmp_path)
    args = argparse.Namespace(device_step_ms=60.0, budget_s=30.0, val_every=5)
    config = load_config(config_path, overrides(loop, prepared, 0, tmp_path, args))
    assert (config.loop.mode, config.loop.switch, config.loop.stale_policy) == (mode, switch, policy)
    assert config.loop.generate_during_training is during
