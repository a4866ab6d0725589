"""The training loop end to end on loopback: runner workers -> agl-sidecar (subprocess) -> embedded
engine; spans -> receiver -> store -> assembly -> torch backend -> weights back into the engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agl_trainer.config import load_config
from agl_trainer.run.session import Session
from agl_trainer.store import RolloutStore


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.demo.model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def write_tasks(path: Path, tasks: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def make_config(
    tmp_path: Path, model_dir: Path, tasks: list[dict[str, Any]], function: str, *, harness_timeout_s: float = 60,
    **loop: Any,
):
    overrides = {
        "tasks": str(write_tasks(tmp_path / "tasks.jsonl", tasks)),
        "output_dir": str(tmp_path / "run"),
        "model.path": str(model_dir),
        "harness.function": function,
        "harness.workers": 1,
        "harness.timeout_s": harness_timeout_s,
        "backend.lr": 1e-3,
        "loop.completion_grace_s": 0.2,
        "loop.checkpoint_every": 1,
        **{f"loop.{k}": v for k, v in loop.items()},
    }
    return load_config(None, [f"--{k}={v}" for k, v in overrides.items()])


def run_session(config: Any, on_step: Any = None, resume: bool = False) -> Any:
    session = Session(config, quiet=True, resume=resume)
    session.on_step = on_step
    return asyncio.run(session.run())


def store_of(config: Any) -> RolloutStore:
    return RolloutStore(Path(config.output_dir) / "rollouts.db")


def test_rollout_spanning_a_weight_update_is_trained_with_importance_weights(tmp_path: Path, model_dir: Path) -> None:
    release, firsts = tmp_path / "release", tmp_path / "firsts"
    firsts.mkdir()
    # Both groups launch under version 0; the slow one can finish only after step 1 trained the fast one,
    # which waits for the slow one's first calls (under version 0, however loaded the machine).
    tasks = [
        {"id": "fast", "firsts": str(firsts), "after_firsts": 4},
        {"id": "slow", "release": str(release), "firsts": str(firsts)},
    ]
    config = make_config(
        tmp_path, model_dir, tasks, "tests.loop.harnesses:spanning",
        mode="collocated-async", batch_rollouts=4, group_size=4, staleness=1, concurrency=8, max_steps=3,
    )  # fmt: skip
    steps: list[dict[str, float]] = []

    def on_step(step: int, metrics: dict[str, float]) -> None:
        steps.append(metrics)
        if step == 1:
            release.touch()  # the slow rollouts make their second call under policy version 1

    result = run_session(config, on_step)
    assert result.summary.steps == 3 and result.summary.failures == {}
    with store_of(config) as store:
        trained = [i for i in store.find("") if i.trained_step is not None]
        versions = {i.rollout_id: [c.policy_version for c in store.load(i.key).calls] for i in trained}
    spanning = [rid for rid, v in versions.items() if v == [0, 1]]
    assert len(spanning) == 4, versions  # the whole first slow group spans the update
    spanning_step = next(m for m in steps if m.get("staleness/max", 0) >= 1)
    assert spanning_step["importance/stale_token_frac"] > 0  # old-version tokens importance-weighted
    assert spanning_step["staleness/max"] == 1  # and never staler than loop.staleness


def test_pause_during_50_concurrent_rollouts_no_harness_sees_an_error(tmp_path: Path, model_dir: Path) -> None:
    # Tool times from 0 to 0.9 s: when the first groups complete, most rollouts are mid-flight.
    tasks = [{"id": f"t{i}", "key": f"k{i % 8}", "calls": 3, "tool_s": 0.1 * (i % 10)} for i in range(20)]
    config = make_config(
        tmp_path, model_dir, tasks, "tests.loop.harnesses:calls",
        mode="collocated-async", batch_rollouts=10, group_size=5, staleness=4, concurrency=50, max_steps=3,
    )  # fmt: skip
    in_flight: list[float] = []
    result = run_session(config, lambda step, m: in_flight.append(m["rollouts/in_flight_at_pause"]))
    assert result.summary.steps == 3
    assert max(in_flight) >= 30  # the sidecar was paused with many rollouts mid-flight...
    assert result.summary.failures == {}  # ...and no harness saw an error (they raise on any)
    with store_of(config) as store:
        causes = store.stats().by_cause
    assert set(causes) <= {"ok"}, causes


def test_crashing_and_hanging_harnesses_are_reported_and_the_run_goes_on(
    tmp_path: Path, model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    tasks = [{"id": "ok1"}, {"id": "bad", "crash": True}, {"id": "ok2"}, {"id": "stuck", "hang": True}]
    config = make_config(
        tmp_path, model_dir, tasks, "tests.loop.harnesses:flaky",
        mode="sync", batch_rollouts=8, group_size=2, concurrency=8, max_steps=2,
    )  # fmt: skip
    config.harness.timeout_s = 1.5
    result = run_session(config)
    assert result.summary.steps == 2
    assert result.summary.failures == {"harness_error": 4, "timeout": 4}
    err = capfd.readouterr().err
    assert "harness_error: RuntimeError: this harness crashed" in err
    assert "timeout: still running after 1.5 s" in err
    trained = [m["rollouts/trained"] for m in result.summary.history]
    assert trained == [4.0, 4.0]  # the good groups trained; the failed rollouts left out


def test_bad_config_and_missing_harness_are_clear_errors(tmp_path: Path, model_dir: Path) -> None:
    from agl_trainer.cli import main

    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "a"}])
    base = [f"--tasks={tasks}", f"--model.path={model_dir}", f"--output_dir={tmp_path / 'r'}"]
    assert main(["train", *base, "--harness.command", "no-such-harness-xyz"]) == 2
    assert main(["train", *base, "--harness.function=tests.loop.harnesses:calls", "--loop.batch_rollouts=7"]) == 2
    assert main(["train", *base, "--harness.function=tests.loop.harnesses:calls", "--loop.bach_rollouts=8"]) == 2
    assert main(["train", *base, "--harness.function=tests.loop.harnesses:nope", "--loop.max_steps=1"]) == 2


def test_cli_messages(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agl_trainer.cli import main

    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": "a"}])
    base = [f"--tasks={tasks}", f"--model.path={model_dir}", f"--output_dir={tmp_path / 'r'}"]
    main(["train", *base, "--harness.command", "no-such-harness-xyz"])
    assert "config key harness.command: program 'no-such-harness-xyz' is not on PATH" in capsys.readouterr().err
    main(["train", *base, "--harness.function=m:f", "--loop.batch_rollouts=7"])
    assert "loop.batch_rollouts: 7 is not a multiple of loop.group_size=8 (fix: use 8)" in capsys.readouterr().err
    main(["train", *base, "--harness.function=m:f", "--loop.bach_rollouts=8"])
    assert "config key loop.bach_rollouts: unknown key (fix: did you mean loop.batch_rollouts?)" in capsys.readouterr().err
    main(["train", *base, "--harness.function=tests.loop.harnesses:nope", "--loop.max_steps=1", "--quiet"])
    assert "has no attribute 'nope'" in capsys.readouterr().err


def test_a_lora_run_syncs_only_the_adapter_and_the_engine_serves_the_trainers_weights(
    tmp_path: Path, model_dir: Path
) -> None:
    """backend.lora through the whole loop: every sync carries the adapter alone (its bytes, far fewer
    than the model's), the embedded engine serves base + adapter, and the canary after each sync finds
    the engine's log-probs equal to the trainer's."""
    tasks = [{"id": f"t{i}", "calls": 2, "tool_s": 0.0} for i in range(3)]
    config = make_config(
        tmp_path, model_dir, tasks, "tests.loop.harnesses:calls",
        mode="sync", batch_rollouts=12, group_size=4, concurrency=12, max_steps=3,
    )  # fmt: skip
    config.backend.lora = msgspec.structs.replace(config.backend.lora, rank=4)  # a frozen section
    config.backend.lr = 5e-2  # the adapter must move for the check to mean anything
    steps: list[dict[str, float]] = []
    result = run_session(config, lambda step, metrics: steps.append(metrics))
    assert result.summary.steps == 3
    model_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    for metrics in steps:
        assert metrics["sync/adapter_only"] == 1.0
        assert 0 < metrics["sync/bytes"] < model_bytes / 4
        assert metrics["agreement/canary/ok"] == 1.0  # engine (base + adapter) == trainer (peft model)
    assert any(m["actor/zero_signal_updates"] == 0 for m in steps)  # at least one step moved the adapter
