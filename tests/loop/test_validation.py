"""Validation rounds (loop.val_every, val_tasks): held-out rollouts in mode val reach the engine
greedy through the unmodified harness's URL, the sampled pass (loop.val_sampled) reaches it at
sampling.train, both write val/* metrics, and neither is ever trained."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from agl_trainer.config import ConfigError, load_config
from agl_trainer.loop.validation import VAL_DROP_REASON, ValidationPlan, failure, summarize
from agl_trainer.metrics import plot_run, read_jsonl
from agl_trainer.store import RolloutStore

TRAIN_MAX_TOKENS = 3  # the probe harness asks train tasks for 3 tokens and val tasks for 4:
VAL_MAX_TOKENS = 4  # the engine tells the two apart by that (the sidecar leaves max_tokens alone)


def probe(task: dict[str, Any], base_url: str) -> float:
    """A harness that knows nothing of modes: two calls at temperature 1.3 through base_url."""
    for _ in range(2):
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": task["key"]}],
            "max_tokens": task["max_tokens"],
            "temperature": 1.3,
            "top_p": 1.0,
        }
        request = urllib.request.Request(
            base_url + "/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            json.loads(response.read())
    return float(task["reward"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.demo.model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_val_rounds_are_greedy_never_trained_and_reported(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agl_trainer.engines.embedded.requests import RequestReader
    from agl_trainer.run.session import Session

    seen: list[tuple[int | None, float, float]] = []  # what the engine was asked: (max_tokens, temperature, top_p)
    sampling = RequestReader.sampling

    def recording(self: Any, req: Any, max_tokens: Any, logprobs: Any, prompt_len: int) -> Any:
        params = sampling(self, req, max_tokens, logprobs, prompt_len)
        seen.append((max_tokens, params.temperature, params.top_p))
        return params

    monkeypatch.setattr(RequestReader, "sampling", recording)  # the embedded engine serves in this process
    train = [{"id": f"t{i}", "key": f"k{i}", "max_tokens": TRAIN_MAX_TOKENS, "reward": i / 4} for i in range(4)]
    val = [{"id": f"v{i}", "key": f"k{4 + i}", "max_tokens": VAL_MAX_TOKENS, "reward": 0.25 * (i + 1)} for i in range(3)]
    overrides = {
        "tasks": write_jsonl(tmp_path / "tasks.jsonl", train),
        "val_tasks": write_jsonl(tmp_path / "val.jsonl", val),
        "output_dir": tmp_path / "run",
        "model.path": model_dir,
        "harness.function": "tests.loop.test_validation:probe",
        "harness.workers": 1,
        "harness.timeout_s": 60,
        "sampling.train.temperature": 0.7,
        "sampling.train.top_p": 0.9,
        "loop.mode": "sync",
        "loop.batch_rollouts": 4,
        "loop.group_size": 2,
        "loop.max_steps": 3,
        "loop.val_every": 2,
        "loop.val_repeats": 2,
        "loop.val_sampled": 2,
        "loop.completion_grace_s": 0.2,
    }
    config = load_config(None, [f"--{k}={v}" for k, v in overrides.items()])
    result = asyncio.run(Session(config, quiet=True).run())
    assert result.summary.steps == 3

    # Rounds before the first step, after step 2 (val_every) and at the end (step 3).
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    val_rows = [row for row in rows if "val/reward" in row]
    assert [row["step"] for row in val_rows] == [0, 2, 3]
    for row in val_rows:
        assert row["val/count"] == 6 and row["val/failed"] == 0  # 3 tasks x 2 repeats
        assert row["val/reward"] == pytest.approx(0.5)  # the val tasks' rewards 0.25, 0.5, 0.75
        assert row["val/pass_rate"] == 0.0
        assert row["val/sampled/count"] == 6 and row["val/sampled/failed"] == 0 and row["val/sampled/k"] == 2
        assert row["val/sampled/reward"] == pytest.approx(0.5) and row["val/sampled/pass@k"] == 0.0
    assert [row["step"] for row in rows if "reward/mean" in row] == [1, 2, 3]  # training rows apart
    assert all("val/reward" not in row for row in result.summary.history)
    assert [v["step"] for v in result.summary.validation] == [0.0, 2.0, 3.0]

    # Each pass of each round wrote agl eval's receipt and results (eval/rounds.py), agreeing with val/*.
    from agl_trainer.eval.receipt import read_result

    receipts = sorted(p.name for p in (tmp_path / "run" / "receipts").glob("*.receipt.json"))
    assert receipts == [f"val-step{s:06d}-{p}.receipt.json" for s in (0, 2, 3) for p in ("greedy", "sampled")]
    receipt, results = read_result(tmp_path / "run" / "receipts" / "val-step000002-sampled.receipt.json")
    assert receipt["kind"] == "validation" and receipt["step"] == 2
    assert receipt["sampling"] == {"mode": "train", "temperature": 0.7, "top_p": 0.9, "seed": None}
    assert receipt["budget"]["k"] == 2 and receipt["model"]["base_sha256"] and receipt["machine"]["python"]
    assert results["summary"]["mean@2"] == pytest.approx(val_rows[1]["val/sampled/reward"])
    greedy, greedy_results = read_result(tmp_path / "run" / "receipts" / "val-step000003-greedy.receipt.json")
    assert greedy["sampling"]["temperature"] == 0.0 and greedy_results["summary"]["mean@2"] == pytest.approx(0.5)

    # The engine saw greedy sampling for every mode-val call, sampling.train for every sampled val
    # call and every train call, whatever the harness asked for (1.3): the mode travelled in the URL.
    val_calls = [(t, p) for m, t, p in seen if m == VAL_MAX_TOKENS]
    train_calls = [(t, p) for m, t, p in seen if m == TRAIN_MAX_TOKENS]
    assert val_calls.count((0.0, 1.0)) == 3 * 6 * 2  # 3 rounds x 6 rollouts x 2 calls
    assert val_calls.count((0.7, 0.9)) == 3 * 6 * 2 and len(val_calls) == 3 * 12 * 2  # the sampled pass
    assert len(train_calls) >= 3 * 4 * 2 and set(train_calls) == {(0.7, 0.9)}

    # Val rollouts are recorded as mode val, never trained, and marked so in the store.
    with RolloutStore(tmp_path / "run" / "rollouts.db") as store:
        infos = store.find("")
    vals = [i for i in infos if i.task_id in {"v0", "v1", "v2"}]
    trains = [i for i in infos if i.task_id in {"t0", "t1", "t2", "t3"}]
    assert len(vals) == 36 and sum(i.mode == "val" for i in vals) == 18  # the sampled 18: mode train
    assert all(i.rollout_id.endswith(("-s0", "-s1")) for i in vals if i.mode != "val")
    assert all(i.trained_step is None and i.dropped_reason == VAL_DROP_REASON for i in vals)
    assert sum(i.trained_step is not None for i in trains) == 12  # 3 steps x 4 rollouts, all train tasks
    assert sum(row["rollouts/trained"] for row in result.summary.history) == 12
    assert plot_run(tmp_path / "run") is not None

    # `agl traces serve --store run/rollouts.db` over this run: its overview finds metrics.jsonl next
    # to the store and shows the training curve and the held-out points (the page said "No training
    # steps yet" when every training row's step was written as a float).
    from agl_trainer.viewer import Viewer, ViewerServer

    with ViewerServer(Viewer(tmp_path / "run" / "rollouts.db", index=False), "127.0.0.1:0").start() as viewer:
        with urllib.request.urlopen(viewer.url + "api/overview", timeout=30) as response:
            overview = json.loads(response.read())
    assert overview["curve_source"] == "metrics.jsonl"
    curve = {point["step"]: point for point in overview["curve"]}
    assert sorted(curve) == [0, 1, 2, 3]
    trained = {row["step"]: row["reward/mean"] for row in rows if "reward/mean" in row}
    assert {step: curve[step]["reward"] for step in (1, 2, 3)} == trained and curve[0]["reward"] is None
    assert all(curve[step]["entropy"] is not None for step in (1, 2, 3))
    assert [curve[step]["val_sampled"] for step in (0, 2, 3)] == [pytest.approx(0.5)] * 3
    assert curve[1]["val_reward"] is None and curve[2]["val_reward"] == pytest.approx(0.5)
    assert all(isinstance(row["step"], int) for row in rows)  # the writer keeps the step an integer


def test_val_config_errors_name_the_key(tmp_path: Path, model_dir: Path) -> None:
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [{"id": "a"}])
    base = [f"--tasks={tasks}", f"--model.path={model_dir}", "--harness.function=tests.loop.test_validation:probe"]

    def error(*extra: str) -> str:
        with pytest.raises(ConfigError) as caught:
            load_config(None, [*base, *extra])
        return str(caught.value)

    assert "config key loop.val_every: 5 needs held-out tasks (fix: set val_tasks" in error("--loop.val_every=5")
    assert "config key val_tasks: " in error(f"--val_tasks={tmp_path / 'nope.jsonl'}", "--loop.val_every=5")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "v"}\nnot json\n')
    assert error(f"--val_tasks={bad}").startswith(f"config key val_tasks: tasks file {bad} line 2: not JSON")
    assert "is the training tasks file" in error(f"--val_tasks={tasks}", "--loop.val_every=5")
    assert "config key loop.val_every" in error("--loop.val_every=-1")
    good = write_jsonl(tmp_path / "val.jsonl", [{"id": "v"}])
    config = load_config(None, [*base, f"--val_tasks={good}", "--loop.val_every=5"])
    assert config.loop.val_every == 5 and config.loop.val_repeats == 1


def test_plan_and_summary() -> None:
    plan = ValidationPlan(every=3)
    assert [step for step in range(10) if plan.due(step)] == [0, 3, 6, 9]
    assert not any(ValidationPlan(every=0).due(step) for step in range(5))
    metrics = summarize([1.0, 0.0, 1.0, 0.5], attempted=5)
    assert metrics["val/reward"] == 0.625 and metrics["val/pass_rate"] == 0.5
    assert metrics["val/count"] == 4 and metrics["val/failed"] == 1
    assert "val/reward" not in summarize([], attempted=2)


def test_a_failed_validation_rollout_is_named_with_its_cause() -> None:
    from agl_trainer.runners.base import Cause, RolloutOutcome, RolloutSpec

    spec = RolloutSpec("val-s0-v1-0", "v1", {"id": "v1"}, mode="val")
    assert failure(RolloutOutcome(spec, Cause.OK), has_data=True) is None
    assert failure(RolloutOutcome(spec, Cause.OK), has_data=False) == (
        "val-s0-v1-0: the harness ended well but its data never completed in the store"
    )
    timed_out = RolloutOutcome(spec, Cause.TIMEOUT, message="no answer in 60 s", log_path="runs/x/v.log")
    assert failure(timed_out, has_data=False) == "val-s0-v1-0: timeout: no answer in 60 s (log: runs/x/v.log)"


def test_runner_puts_the_mode_in_the_url_only_for_val() -> None:
    from agl_trainer.runners.base import Endpoint, RolloutSpec

    endpoint = Endpoint(sidecar_url="http://127.0.0.1:9/")
    assert endpoint.base_url(RolloutSpec("r1", "t", {}, 0)) == "http://127.0.0.1:9/rollouts/r1/v1"
    val = RolloutSpec("r1", "t", {}, 2, "val")
    assert endpoint.base_url(val) == "http://127.0.0.1:9/rollouts/r1/attempts/2/modes/val/v1"
    assert endpoint.environment(val)["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/rollouts/r1/attempts/2/modes/val"


def test_sidecar_reads_the_mode_from_the_url(tmp_path: Path) -> None:
    from agl_sidecar.config import build
    from agl_sidecar.server import BackgroundSidecar
    from agl_testing.fake_vllm import FakeVLLM

    with FakeVLLM() as fake:
        settings = {
            "listen": "127.0.0.1:0",
            "upstream": [fake.base_url],
            "spool_dir": str(tmp_path / "spool"),
            "sampling": {"val": {"temperature": 0.0}, "train": {"temperature": 0.7}},
            "default_mode": "train",
        }
        with BackgroundSidecar(build(settings)) as sidecar:

            def post(path: str) -> tuple[int, dict[str, Any]]:
                body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.3}
                request = urllib.request.Request(
                    sidecar.url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
                )
                try:
                    with urllib.request.urlopen(request, timeout=30) as response:
                        return response.status, json.loads(response.read())
                except urllib.error.HTTPError as error:
                    return error.code, json.loads(error.read())

            first = post("/rollouts/r1/modes/val/v1/chat/completions")
            assert first[0] == 200, first
            assert fake.requests[-1]["temperature"] == 0.0
            assert post("/rollouts/r1/attempts/1/modes/val/v1/chat/completions")[0] == 200
            assert fake.requests[-1]["temperature"] == 0.0
            assert post("/rollouts/r1/v1/chat/completions")[0] == 200  # no mode in the URL: train
            assert fake.requests[-1]["temperature"] == 0.7
            status, error = post("/rollouts/r1/modes/eval/v1/chat/completions")
            assert status == 400 and "mode 'eval' in the URL path is not one of ['train', 'val']" in str(error)
            assert len(fake.requests) == 3  # the refused call never reached the engine


def test_round_ids_stay_unique_across_a_restart_and_a_stop_cancels_the_round() -> None:
    from agl_trainer.loop.validation import Validator

    tasks = [{"id": "v0"}, {"id": "v1"}]
    first, resumed = (Validator(tasks, runner=None, data=None, run_id="run", every=5, repeats=2) for _ in range(2))
    ids = [s.rollout_id for s in first.specs(10)]
    assert len(set(ids)) == 4 and all(s.mode == "val" for s in first.specs(10))
    assert not set(ids) & {s.rollout_id for s in resumed.specs(10)}  # the same step after a resume

    started: list[str] = []

    class Forever:  # a harness that never ends: only the stop can end the round
        async def run(self, spec: Any) -> Any:
            started.append(spec.rollout_id)
            await asyncio.Event().wait()

    class Stop(Exception):
        pass

    def check() -> None:
        if len(started) == 4:
            raise Stop

    validator = Validator(tasks, runner=Forever(), data=None, run_id="run", every=5, repeats=2)

    async def go() -> list[asyncio.Task[Any]]:
        with pytest.raises(Stop):
            await validator.run(5, 3, check)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(go()) == []  # every harness of the round was cancelled
    assert validator.last_step is None
