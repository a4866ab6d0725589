"""`agl demo` end to end with a fixed seed and a fixed number of steps (no wall-clock budget: the
test asserts the same thing on a quiet or a busy machine): warm start, then RL through the pipeline;
the training reward and the held-out sampled reward rise, validation never trains, and the log
holds no per-checkpoint progress bars."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

STEPS = 40


@pytest.mark.slow
def test_demo_reward_rises(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from agl_trainer.store import RolloutStore

    from examples.demo.run import run_demo

    # max_train_s far above what 40 steps take anywhere: it only guards against a hang
    summary = run_demo(tmp_path / "demo", seed=0, budget_s=3600, max_steps=STEPS, quiet=True)
    printed = capfd.readouterr()
    assert 0.3 < summary["reward_warm_start"] < 0.7  # the warm start is its own, measured phase
    assert summary["steps"] == STEPS
    # A clear rise through the full pipeline (first RL steps vs last ones).
    assert summary["reward_rl_last"] >= summary["reward_rl_first"] + 0.1, summary
    # The held-out gain the demo reports: sampled at the training temperature (mean@4), where the
    # warm start is about 0.5 (greedy already solves the held-out tasks, so it cannot show a gain).
    assert summary["val_sampled_last"] >= summary["val_sampled_first"] + 0.08, summary
    assert "agl demo: held-out gain: val/sampled/reward (mean@4" in printed.out
    held_out = "agl demo: held-out: 32 tasks (test split) over 16 (key, value) pairs the training never shows"
    assert held_out in printed.out
    assert "Writing model shards" not in printed.err + printed.out  # no bar per checkpoint
    out = tmp_path / "demo"
    assert (out / "reward.png").stat().st_size > 0
    assert any((out / "tensorboard").iterdir())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "reward/mean" in row]
    assert len(train) == STEPS and all("actor/entropy" in row for row in train)
    # Held-out validation: a round before the first step, every val_every (20) steps, at the end.
    val_steps = [row["step"] for row in rows if "val/reward" in row]
    assert val_steps == [0, 20, 40] and summary["val_rounds"] == 3
    assert all(row["val/sampled/count"] == 128 for row in rows if "val/reward" in row)  # 32 tasks x 4

    # The validation tasks are not training tasks (ids, or the (key, value) pair the model sees, in
    # any training table), and no val rollout was trained.
    tasks = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    val_tasks = [json.loads(line) for line in (out / "val_tasks.jsonl").read_text().splitlines()]
    assert len(val_tasks) == 32 and not {t["task_id"] for t in val_tasks} & {t["task_id"] for t in tasks}
    shown = {(key, value) for t in tasks for key, value in t["table"].items()}
    assert not {(t["key"], t["table"][t["key"]]) for t in val_tasks} & shown
    with RolloutStore(out / "rollouts.db") as store:
        infos = store.find("")
    val_ids = {t["task_id"] for t in val_tasks}
    val = [i for i in infos if i.task_id in val_ids]
    assert len(val) == 3 * (32 + 128)
    assert all(i.trained_step is None and i.dropped_reason == "validation" for i in val)
    trained = [i for i in infos if i.trained_step is not None]
    assert trained and all(i.task_id.startswith("demo-") for i in trained)
    assert len(trained) == sum(row["rollouts/trained"] for row in train)


LORA_STEPS = 60


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 60 steps plus the warm start: 376 s alone on 2 cores, past 600 s beside other work
def test_demo_with_lora_rank_8_learns(tmp_path: Path) -> None:
    """`agl demo --backend.lora.rank 8`: adapters over the frozen warm-started model, on the demo
    config's targets (the projections and the tied output head, where the tiny model's skill is),
    synced to the engine as the adapter alone, at the demo's learning rate; reward and held-out rise."""
    from agl_trainer.loop.checkpoint import Checkpoints

    from examples.demo.run import run_demo

    out = tmp_path / "demo"
    summary = run_demo(
        out, seed=0, budget_s=3600, max_steps=LORA_STEPS, quiet=True, val_every=LORA_STEPS // 2,
        overrides=["--backend.lora.rank=8"],
    )  # fmt: skip
    assert summary["steps"] == LORA_STEPS
    assert summary["reward_rl_last"] >= summary["reward_rl_first"] + 0.08, summary
    assert summary["val_sampled_last"] >= summary["val_sampled_first"] + 0.1, summary
    latest = Checkpoints(out / "checkpoints").latest()
    assert latest is not None
    backend = latest / "backend"
    adapter = json.loads((backend / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and "lm_head" in adapter["target_modules"]
    assert not (backend / "model").exists()  # the base stays the warm start's: only the adapter trained


def test_demo_config_overrides_are_checked_before_anything_runs(tmp_path: Path, capsys, monkeypatch) -> None:
    """`agl demo --backend.lora.rank 8` passes config keys through; a misspelled key or a value out of
    range is a clear error before the warm start, and nothing is written."""
    from agl_trainer.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the demo runs from the repository root
    out = tmp_path / "demo"
    assert main(["demo", "--output-dir", str(out), "--backend.lora.rnak", "8"]) == 2
    assert "backend.lora.rnak: unknown key (fix: did you mean backend.lora.rank?)" in capsys.readouterr().err
    assert main(["demo", "--output-dir", str(out), "--backend.lora.rank=-1"]) == 2
    assert "backend.lora.rank" in capsys.readouterr().err
    assert main(["demo", "--output-dir", str(out), "extra.yaml"]) == 2
    assert "takes no config file" in capsys.readouterr().err
    assert not out.exists()


def test_a_valid_override_reaches_the_demo_before_its_files_exist(tmp_path: Path, monkeypatch) -> None:
    """The config check before the warm start skips the config's paths (runs/demo/tasks.jsonl, the warm
    model): the demo writes them itself, so a fresh checkout runs `agl demo --backend.lora.rank 8`."""
    from agl_trainer.cli import main

    import examples.demo.run

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    calls: list[dict] = []

    def recorded(out: Path, **kwargs: object) -> dict:
        calls.append({"out": out, **kwargs})
        return {"steps": 1}

    monkeypatch.setattr(examples.demo.run, "run_demo", recorded)
    out = tmp_path / "demo"
    assert main(["demo", "--output-dir", str(out), "--backend.lora.rank", "8"]) == 0
    assert calls and calls[0]["overrides"] == ["--backend.lora.rank", "8"]
