"""bench/swe_lite_normalization.py: every mode's overrides are settings `agl train` accepts, finished
runs are read and never rerun, a run cut short starts over, and the report pairs modes by seed."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from bench import swe_lite_normalization as bench
from tests.algorithms.tiny import make_tiny_model


def prepared(folder: Path) -> Path:
    """What prepare leaves that the bench reads: a model and the train and val tasks."""
    make_tiny_model(folder / "model-warm")
    for split in ("train", "val"):
        (folder / split).mkdir(parents=True)
        (folder / split / "tasks.jsonl").write_text(json.dumps({"id": f"{split}-0"}) + "\n")
    return folder


def finished_run(
    folder: Path, rewards: list[float], entropy: list[float], greedy: float, calls: float = 5.0, failed: int = 0
) -> None:
    (folder / "rl").mkdir(parents=True)
    rows = [
        {"reward/mean": r, "actor/entropy": e, "assembly/rollouts": 32.0, "assembly/samples": 40.0,
         "assembly/calls": calls * 32}
        for r, e in zip(rewards, entropy, strict=True)
    ]  # fmt: skip
    (folder / "rl/metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "rl/trained.done").write_text(" ".join(bench.budget_flags(60.0, None)) + "\n")
    (folder / "eval-val").mkdir()
    summary = {"k": 1.0, "mean@1": greedy, "failed": failed}
    (folder / "eval-val/results.json").write_text(json.dumps({"summary": summary}))


def test_every_mode_is_a_config_agl_train_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agl_trainer.cli import main

    run = prepared(tmp_path / "run")
    for mode in bench.MODES:
        command = bench.train_command(run, mode, 3, bench.budget_flags(600, None), tmp_path / mode)
        assert command[:2] == ["agl", "train"] and command[-len(bench.MODES[mode]) :] == bench.MODES[mode]
        assert main([*command[1:], "--check"]) == 0, capsys.readouterr()
        assert "config OK (collocated-async" in capsys.readouterr().out
    # a misspelt key does not pass the same check: what makes the loop above a test
    steps = bench.budget_flags(600, 20)
    assert main([*bench.train_command(run, "token", 3, steps, tmp_path / "steps")[1:], "--check"]) == 0
    misspelt = [*bench.train_command(run, "rollout", 3, steps, tmp_path / "x")[1:], "--assembly.merge_call=0"]
    assert main([*misspelt, "--check"]) != 0
    assert "assembly.merge_call: unknown" in capsys.readouterr().err


def test_finished_runs_are_read_not_rerun_and_a_cut_run_starts_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = prepared(tmp_path / "run")
    executed: list[list[str]] = []

    def execute(command: list[str], log: Path) -> None:
        executed.append(command)
        flag = "--output_dir" if command[1] == "train" else "--eval.output_dir"
        out = Path(command[command.index(flag) + 1])
        out.mkdir(parents=True, exist_ok=True)
        if command[1] == "eval":
            (out / "results.json").write_text(json.dumps({"summary": {"k": 1.0, "mean@1": 0.5}}))

    monkeypatch.setattr(bench, "execute", execute)
    args = argparse.Namespace(out=tmp_path / "out", train_s=60.0, steps=None, sampled=False)
    finished_run(args.out / "rollout-s0", [0.5], [0.2], greedy=0.7)
    assert bench.run_one(run, "rollout", 0, args) == args.out / "rollout-s0" and executed == []
    cut = args.out / "token-s0"
    (cut / "rl").mkdir(parents=True)
    (cut / "rl/metrics.jsonl").write_text("{}\n")  # a run stopped before its end: no trained.done
    bench.run_one(run, "token", 0, args)
    assert [c[1] for c in executed] == ["train", "eval"]
    assert "--seed" in executed[0] and executed[0][executed[0].index("--seed") + 1] == "0"
    assert not (cut / "rl/metrics.jsonl").exists()  # the cut run's files went before it started over
    assert (cut / "rl/trained.done").read_text() == "--loop.max_train_s 60.0\n"
    # a study compares runs of one budget: a finished run of another is refused, not mixed in
    with pytest.raises(SystemExit, match="trained with --loop.max_train_s 60.0, not --loop.max_steps 20"):
        bench.run_one(run, "token", 0, argparse.Namespace(**{**vars(args), "steps": 20}))
    assert len(executed) == 2


def test_report_pairs_each_mode_with_rollout_on_the_same_seed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    finished_run(out / "rollout-s0", [0.2] * 6, [0.3] * 3 + [0.2] * 3, greedy=0.70)
    finished_run(out / "rollout-s1", [0.2] * 6, [0.3] * 6, greedy=0.60)
    finished_run(out / "sample-s0", [0.2] * 3, [0.3, 0.3, 0.5], greedy=0.60, calls=6.0)
    finished_run(out / "sample-s1", [0.2] * 3, [0.3] * 3, greedy=0.40, failed=3)
    finished_run(out / "token-s1", [0.2] * 3, [0.3] * 3, greedy=0.65)  # no rollout pair for seed 2
    runs = bench.finished(out, ["rollout", "sample", "token"], [0, 1, 2])
    assert [(r.mode, r.seed) for r in runs] == [("rollout", 0), ("rollout", 1), ("sample", 0), ("sample", 1),
                                                ("token", 1)]  # fmt: skip
    rows = {row["mode"]: row for row in bench.table(runs)}
    assert rows["rollout"]["val_greedy"] == pytest.approx(0.65) and rows["rollout"]["steps"] == 6
    assert rows["rollout"]["entropy_drift"] == pytest.approx(-0.05)  # (-0.1 + 0) / 2 seeds; windows of 2
    assert rows["sample"]["calls_per_rollout"] == pytest.approx(5.5)
    assert rows["sample"]["samples_per_rollout"] == 1.25
    compared = {(row["mode"], row["metric"]): row for row in bench.comparisons(runs)}
    greedy = compared[("sample", "val_greedy")]
    assert greedy["seeds"] == 2 and greedy["difference"] == pytest.approx(-0.15)  # -0.1 and -0.2
    assert greedy["low"] < -0.15 < greedy["high"]
    token = compared[("token", "val_greedy")]
    assert token["seeds"] == 1 and token["difference"] == pytest.approx(0.05) and math.isnan(token["low"])
    assert ("sample", "val_sampled") not in compared  # no mean@4 was run
    assert rows["sample"]["failed"] == 3 and rows["rollout"]["failed"] == 0


def test_the_report_warns_of_failed_held_out_attempts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    finished_run(tmp_path / "rollout-s0", [0.2] * 3, [0.3] * 3, greedy=0.5)
    finished_run(tmp_path / "token-s0", [0.2] * 3, [0.3] * 3, greedy=0.1, failed=23)
    runs = bench.finished(tmp_path, ["rollout", "token"], [0])
    bench.report(runs, {"greedy": 0.2, "failed": 0}, argparse.Namespace(run=tmp_path, steps=None, train_s=60.0))
    out = capsys.readouterr().out
    assert "warning: token-s0: 23 held-out attempts failed" in out and "rollout-s0" not in out


def test_the_cli_refuses_an_unprepared_run_and_an_unknown_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lacks = "lacks ['model-warm/config.json', 'train/tasks.jsonl', 'val/tasks.jsonl']: build it with"
    for argv, message in [
        (["--run", str(tmp_path / "none")], lacks),
        (["--modes", "rollout,call"], "--modes: unknown ['call']"),
        (["--train-s", "0"], "--train-s 0: give a positive number of seconds"),
        (["--steps", "0"], "--steps 0: give 1 or more"),
    ]:
        with pytest.raises(SystemExit):
            bench.main([*argv, "--out", str(tmp_path / "out")])
        assert message in capsys.readouterr().err
