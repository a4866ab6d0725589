"""Kill the trainer mid-run (SIGKILL) and `agl train --resume`: no rollout trained twice, none lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agl_trainer.store import RolloutStore
from tests.loop.test_loop import write_tasks

AGL = [str(Path(sys.executable).parent / "agl")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.demo.model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def ledger(out: Path) -> list[tuple[int, str, int]]:
    path = out / "trained.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        rows += [(entry["step"], rid, attempt) for rid, attempt in entry["rollouts"]]
    return rows


def diagnosis(out: Path) -> str:
    """What each step trained and why rollouts were dropped: what a failure here needs to be read."""
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    shown = [{k: v for k, v in m.items() if k == "step" or k.startswith("rollouts/") or "drop" in k} for m in steps]
    with RolloutStore(out / "rollouts.db") as store:
        dropped = sorted({(i.dropped_reason, i.end_cause, i.late_spans) for i in store.rollouts() if i.dropped_reason})
    log = out / "sidecar.log"
    tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
    return f"steps: {shown}; dropped: {dropped}; sidecar.log ends: {tail}"


@pytest.mark.slow
def test_kill_and_resume_trains_every_rollout_once(tmp_path: Path, model_dir: Path) -> None:
    tasks = [{"id": f"t{i}", "key": f"k{i % 8}", "calls": 2, "tool_s": 0.05 * (i % 4)} for i in range(6)]
    out = tmp_path / "run"
    args = [
        "train",
        f"--tasks={write_tasks(tmp_path / 'tasks.jsonl', tasks)}",
        f"--model.path={model_dir}",
        f"--output_dir={out}",
        "--harness.function=tests.loop.harnesses:calls",
        "--harness.workers=1",
        "--loop.mode=collocated-async",
        "--loop.batch_rollouts=8",
        "--loop.group_size=4",
        "--loop.concurrency=16",
        "--loop.completion_grace_s=0.2",
        "--loop.max_steps=7",
        "--quiet",
    ]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    first = subprocess.Popen(
        [*AGL, *args], env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 180
        while len({step for step, _, _ in ledger(out)}) < 3 and time.monotonic() < deadline:
            assert first.poll() is None, first.stdout.read().decode()  # type: ignore[union-attr]
            time.sleep(0.05)
        assert len({step for step, _, _ in ledger(out)}) >= 3
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the trainer and its runner workers, mid-step
        first.wait()
    killed_at = max(step for step, _, _ in ledger(out))
    assert killed_at < 7

    resumed = subprocess.run([*AGL, *args, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert not (out / "sidecar.pid").exists()  # the orphaned sidecar was stopped, the new one too

    rows = ledger(out)
    trained = [(rid, attempt) for _, rid, attempt in rows]
    assert len(trained) == len(set(trained)), "a rollout was trained twice"
    assert sorted({step for step, _, _ in rows}) == list(range(1, 8)), diagnosis(out)  # every step, continuing
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 7

    # None lost: every rollout that completed is trained, unless its group was still being
    # generated when the run ended (at most the loop's capacity of (staleness + 1) batches).
    with RolloutStore(out / "rollouts.db") as store:
        infos = store.rollouts()
    trained_set = set(trained)
    done_untrained = {
        i.rollout_id.rsplit("-", 1)[0]
        for i in infos
        if i.complete and i.end_cause == "ok" and i.dropped_reason is None and (i.rollout_id, i.attempt) not in trained_set
    }
    assert len(done_untrained) <= 2 * 8 // 4, done_untrained
    assert all(i.trained_step is not None for i in infos if (i.rollout_id, i.attempt) in trained_set)


@pytest.mark.slow
def test_ctrl_c_stops_everything_cleanly(tmp_path: Path, model_dir: Path) -> None:
    tasks = [{"id": f"t{i}", "key": "k1", "calls": 2, "tool_s": 0.2} for i in range(4)]
    out = tmp_path / "run"
    args = [
        "train",
        f"--tasks={write_tasks(tmp_path / 'tasks.jsonl', tasks)}",
        f"--model.path={model_dir}",
        f"--output_dir={out}",
        "--harness.function=tests.loop.harnesses:calls",
        "--harness.workers=1",
        "--loop.batch_rollouts=8",
        "--loop.group_size=4",
        "--loop.max_steps=1000",
        "--quiet",
    ]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    process = subprocess.Popen([*AGL, *args], env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not ledger(out) and time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read()  # type: ignore[union-attr]
            time.sleep(0.05)
        sidecar_pid = int((out / "sidecar.pid").read_text())
        process.send_signal(signal.SIGINT)  # Ctrl-C: finish the step, stop every part
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, err
    assert "stopping after the current step" in err and "stop requested" in err
    assert not (out / "sidecar.pid").exists()
    assert not Path(f"/proc/{sidecar_pid}").exists() or "Z" in Path(f"/proc/{sidecar_pid}/stat").read_text().split()[2]
    # No runner worker (or multiprocessing helper) left behind; helpers exit on their own pipe EOF.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        survivors = subprocess.run(["pgrep", "-g", str(process.pid)], capture_output=True, text=True).stdout.split()
        if not survivors:
            break
        time.sleep(0.1)
    assert survivors == [], [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in survivors]
    assert (out / "reward.png").exists()
