"""`agl eval` on the demo's warm-started and trained checkpoints: through the demo's harness, the
sidecar, the embedded engine, the receiver and the store (all real, on loopback). Receipts are
complete, the same seed gives the same results, and --compare refuses different budgets."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from agl_trainer.cli import main
from agl_trainer.eval.receipt import model_hash, read_result, sha256_file

DEMO_CONFIG = "examples/demo/config.yaml"
TRACKERS = ["--metrics.trackers=[wandb, mlflow]", "--metrics.wandb.mode=offline"]  # mlflow: file:OUTPUT_DIR/mlruns
FAST = ["--viewer.enabled=false", "--diagnostics.canary.enabled=false", "--loop.completion_grace_s=0.2"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The warm-started demo model, 6 held-out tasks, and a run trained 2 steps from the warm model."""
    from agl_trainer.config import load_config
    from agl_trainer.run.session import Session
    from examples.demo.prepare import prepare_demo_model
    from examples.demo.run import write_val_tasks
    from examples.demo.task import make_tasks, write_tasks

    root = tmp_path_factory.mktemp("evaldemo")
    prepared = prepare_demo_model(root, seed=0, progress=False)
    tasks = write_tasks(root / "tasks.jsonl", 32, 0)
    val = write_val_tasks(root / "val.jsonl", 6, 0, exclude=make_tasks(32, 0))
    overrides = [
        f"--tasks={tasks}", f"--val_tasks={val}", f"--output_dir={root / 'run'}", f"--model.path={prepared.path}",
        "--loop.batch_rollouts=16", "--loop.concurrency=16", "--loop.max_steps=2", "--loop.max_train_s=0",
        "--loop.checkpoint_every=1", "--loop.val_every=0", *FAST, *TRACKERS,
    ]  # fmt: skip
    result = asyncio.run(Session(load_config(DEMO_CONFIG, overrides), quiet=True).run())
    assert result.summary.steps == 2
    return {"root": root, "warm": Path(prepared.path), "run": root / "run", "tasks": tasks, "val": val}


def evaluate(demo: dict[str, Path], name: str, checkpoint: Path, *extra: str) -> Path:
    out = demo["root"] / name
    argv = [
        "eval", DEMO_CONFIG, "--checkpoint", str(checkpoint), f"--tasks={demo['tasks']}", f"--val_tasks={demo['val']}",
        "--eval.k=3", f"--eval.output_dir={out}", "--quiet", *FAST, *extra,
    ]  # fmt: skip
    assert main(argv) == 0
    return out


def unrewarded(out: Path) -> str:
    """Why an evaluation's attempts have no reward: each one's cause, and the end of the sidecar's log."""
    _, results = read_result(out)
    rows = [row for row in results["rollouts"] if row["reward"] is None]
    log = (out / "sidecar.log").read_text(errors="replace")[-3000:] if (out / "sidecar.log").exists() else ""
    return f"no reward: {rows}\nsidecar.log (end): {log}"


def rollout_rewards(out: Path) -> dict[str, Any]:
    _, results = read_result(out)
    return {row["rollout_id"]: row["reward"] for row in results["rollouts"]}


@pytest.mark.slow
def test_eval_warm_and_trained_receipts_reproducible_and_compared(
    demo: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    warm = evaluate(demo, "warm", demo["warm"])
    again = evaluate(demo, "warm-again", demo["warm"])
    trained = evaluate(demo, "trained", demo["run"])  # the run's latest checkpoint

    receipt, results = read_result(warm)
    # Every attempt ran and produced data; the rewards are the demo's (0..1 in steps of 0.2).
    rewards = rollout_rewards(warm)
    assert len(rewards) == 6 * 3 and all(r is not None and 0.0 <= r <= 1.0 for r in rewards.values())
    assert results["summary"]["tasks"] == 6 and results["summary"]["failed"] == 0
    means = [row["mean"] for row in results["tasks"]]
    assert results["summary"]["mean@3"] == pytest.approx(sum(means) / 6)

    # The receipt names everything the score depends on.
    assert receipt["model"]["sha256"] == model_hash(demo["warm"])[0]
    assert receipt["harness"]["command"] == "examples.demo.harness:run_episode"
    assert receipt["harness"]["version"]["sha256"] and receipt["harness"]["version"]["files"][0].endswith("harness.py")
    assert receipt["budget"] == {"k": 3, "max_turns": 0, "context_tokens": 0, "max_tokens_per_call": 0,
                                 "timeout_s": 120.0, "retries": 2}  # fmt: skip
    assert receipt["sampling"] == {"mode": "train", "temperature": 1.0, "top_p": 1.0, "seed": 0}
    assert receipt["tasks"]["sha256"] == sha256_file(demo["val"])
    assert receipt["agl"]["version"].startswith("0.") and receipt["agl"]["config"]["eval"]["k"] == 3
    assert receipt["started_at"] <= receipt["ended_at"]
    assert receipt["machine"]["host"] and receipt["machine"]["python"] and receipt["machine"]["torch"]

    # The same seed: the same reward for every attempt; the traces are in a store the viewer reads.
    assert rollout_rewards(again) == rewards, unrewarded(again)
    assert main(["traces", "ls", "--store", str(warm / "rollouts.db"), "--all"]) == 0
    assert "eval-00005-2" in capsys.readouterr().out

    # The same weights served elsewhere (an OpenAI-compatible URL): the same samples, the URL in the receipt.
    from agl_trainer.engines.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig

    with EmbeddedEngine(EmbeddedEngineConfig(model_path=str(demo["warm"]), served_model_name="tiny")) as engine:
        url = f"{engine.urls[0]}/v1"
        served = evaluate(demo, "served", demo["warm"], f"--model-url={url}")
    assert rollout_rewards(served) == rewards, unrewarded(served)
    assert read_result(served)[0]["model"] == {"url": url, "name": "tiny", "sha256": None}

    # The trained checkpoint is other weights; the two compare side by side.
    trained_receipt, _ = read_result(trained)
    assert trained_receipt["model"]["sha256"] != receipt["model"]["sha256"]
    assert Path(trained_receipt["model"]["path"]).parts[-2:] == ("backend", "model")
    assert main(["eval", "--compare", str(warm), str(trained)]) == 0
    table = capsys.readouterr().out
    assert "mean@3" in table and "pass@3" in table and "test-00000" in table

    # A different turn budget (handed to the harness as AGL_MAX_TURNS) is in the receipt; --compare refuses it.
    budget = evaluate(demo, "turns", demo["warm"], "--eval.max_turns=5", *TRACKERS)
    budget_receipt, budget_results = read_result(budget)
    assert budget_receipt["budget"]["max_turns"] == 5
    # Its results went to W&B (offline run) and MLflow (file store) too, as did the training's metrics.
    from tests.loop.test_trackers import mlflow_runs
    from tests.support.wandb_offline import read_run

    (wandb_run,) = (budget / "wandb").glob("offline-run-*")
    assert read_run(wandb_run)["summary"]["eval/mean@3"] == pytest.approx(budget_results["summary"]["mean@3"])
    (eval_run,) = mlflow_runs(budget / "mlruns")
    assert eval_run["eval/mean_3"] == [(0, pytest.approx(budget_results["summary"]["mean@3"]))]
    (train_wandb,) = (demo["run"] / "wandb").glob("offline-run-*")
    assert [row["_step"] for row in read_run(train_wandb)["history"] if "reward/mean" in row] == [1, 2]
    (train_run,) = mlflow_runs(demo["run"] / "mlruns")
    assert [step for step, _ in train_run["reward/mean"]] == [1, 2]
    assert main(["eval", "--compare", str(warm), str(budget)]) == 1
    assert "budget.max_turns: 0 vs 5" in capsys.readouterr().err


@pytest.mark.slow
def test_train_and_eval_hand_their_harnesses_a_run_id(demo: dict[str, Path]) -> None:
    """AGL_RUN_ID in every rollout's process: a training run's own (run.json's), each evaluation's
    own (its rollout ids repeat across evaluations; examples/swe keys repository copies by both)."""
    from agl_trainer.config import load_config
    from agl_trainer.run.session import Session

    def recorded(name: str) -> list[str]:
        return (demo["root"] / f"{name}.ids").read_text().split()

    def recording(name: str) -> list[str]:
        log = demo["root"] / f"{name}.ids"
        return ["--harness.function=tests.eval.run_id_harness:run_episode", f"--harness.env={{AGL_TEST_RUN_ID_LOG: {log}}}"]

    for name in ("first", "second"):
        evaluate(demo, name, demo["warm"], "--eval.k=1", *recording(name))
    first, second = recorded("first"), recorded("second")
    assert len(first) == len(second) == 6  # one line a rollout: 6 tasks x 1 attempt
    assert len(set(first)) == len(set(second)) == 1 and first[0].startswith("eval-") and first[0] != second[0]

    out = demo["root"] / "train-ids"
    overrides = [
        f"--tasks={demo['tasks']}", f"--val_tasks={demo['val']}", f"--output_dir={out}", f"--model.path={demo['warm']}",
        "--loop.batch_rollouts=8", "--loop.concurrency=8", "--loop.max_steps=1", "--loop.max_train_s=0",
        "--loop.val_every=0", *FAST, *recording("train"),
    ]  # fmt: skip
    result = asyncio.run(Session(load_config(DEMO_CONFIG, overrides), quiet=True).run())
    assert result.summary.steps == 1
    trained = recorded("train")
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    assert len(trained) >= 8 and set(trained) == {run_id}


@pytest.mark.slow
def test_eval_draws_no_loading_bars(demo: dict[str, Path], capfd: pytest.CaptureFixture[str]) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # as a user's process has it
    evaluate(demo, "eval-quiet", demo["warm"])
    printed = capfd.readouterr()
    assert "Loading weights" not in printed.out + printed.err
    assert hf_logging.is_progress_bar_enabled()  # the user's setting, given back


def test_eval_config_errors_name_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a"}) + "\n")
    base = ["eval", DEMO_CONFIG, f"--tasks={tasks}", f"--val_tasks={tasks}x", "--model.path=.", "--check"]
    assert main(base) == 2
    assert "config key val_tasks" in capsys.readouterr().err
    assert main(["eval", DEMO_CONFIG, f"--tasks={tasks}", "--val_tasks=null", "--eval.k=0", "--check"]) == 2
    assert "config key eval.k" in capsys.readouterr().err
    assert main(["eval", DEMO_CONFIG, "--checkpoint", str(tmp_path), "--check"]) == 2
    assert f"--checkpoint {tmp_path}: no model there" in capsys.readouterr().err
    done = tmp_path / "done"
    done.mkdir()
    (done / "receipt.json").write_text("{}")
    argv = ["eval", DEMO_CONFIG, f"--tasks={tasks}", "--val_tasks=null", "--model.path=.", f"--eval.output_dir={done}"]
    assert main([*argv, "--check"]) == 2
    assert "already holds an evaluation" in capsys.readouterr().err
    assert main([*argv[:-1], "--eval.model_url=ftp://x", "--check"]) == 2
    assert "config key eval.model_url" in capsys.readouterr().err
    assert os.environ.get("AGL_MAX_TURNS") is None  # budgets go to harnesses, never into this process
